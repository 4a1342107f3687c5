"""kernels/scratch.py: the workspace a layer's prepared calls keep between calls, one buffer per (stream,
thread, dtype) grown to the largest call. On the CPU with CPU tensors (the GPU calls that use it:
tests/ops/test_prepared_inference.py)."""

import copy

import torch

from float8.kernels import scratch as S
from float8.ops.weight_cache import InferencePlans

CPU = torch.device("cpu")


def test_a_key_keeps_one_buffer_grown_to_the_largest_request():
    s = S.Scratch()
    a = s.get(("stream", 1), torch.float32, 100, CPU)
    assert a.numel() == 100 and a.dtype == torch.float32
    assert s.get(("stream", 1), torch.float32, 60, CPU) is a  # smaller: the same buffer
    b = s.get(("stream", 1), torch.float32, 300, CPU)
    assert b is not a and b.numel() == 300
    assert s.tensors() == [b]  # the old one is not held
    assert s.get(("stream", 1), torch.float32, 100, CPU) is b


def test_streams_threads_and_dtypes_get_buffers_of_their_own():
    s = S.Scratch()
    got = [
        s.get(("s1", 1), torch.float32, 8, CPU),
        s.get(("s2", 1), torch.float32, 8, CPU),
        s.get(("s1", 2), torch.float32, 8, CPU),
        s.get(("s1", 1), torch.uint8, 8, CPU),
    ]
    assert len({t.data_ptr() for t in got}) == 4 and len(s.tensors()) == 4


def test_bounded_and_cleared():
    s = S.Scratch()
    first = s.get(("s", 0), torch.uint8, 16, CPU)
    for i in range(1, S.MAX_BUFFERS + 5):
        s.get(("s", i), torch.uint8, 16, CPU)
    assert len(s.tensors()) == S.MAX_BUFFERS
    assert all(t is not first for t in s.tensors())  # the oldest went first
    s.clear()
    assert s.tensors() == []


def test_a_linears_plans_own_the_scratch_and_drop_it_with_them():
    plans = InferencePlans()
    plans.scratch.get(("s", 1), torch.float32, 32, CPU)
    plans.add(("shape", torch.bfloat16), object())
    twin = copy.deepcopy(plans)
    assert twin.scratch is not plans.scratch and twin.scratch.tensors() == []
    plans.clear()
    assert len(plans) == 0 and plans.scratch.tensors() == []


def test_a_converted_model_shares_one_workspace_and_its_copies_share_a_fresh_one():
    """ops.convert gives all of a model's Linears one Scratch (they take turns with one buffer); a deepcopy
    or a pickle of the model shares one new, empty Scratch among its Linears, apart from the original's."""
    import pickle

    import float8.ops as ops

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    ops.convert(model, fp8_weights=True)
    lins = [m for m in model.modules() if isinstance(m, ops.Linear)]
    assert len(lins) == 2 and lins[0]._inference_plans.scratch is lins[1]._inference_plans.scratch
    lins[0]._inference_plans.scratch.get(("s", 1), torch.float32, 8, CPU)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        tl = [m for m in twin.modules() if isinstance(m, ops.Linear)]
        s = tl[0]._inference_plans.scratch
        assert s is tl[1]._inference_plans.scratch and s is not lins[0]._inference_plans.scratch
        assert s.tensors() == []
    assert len(lins[0]._inference_plans.scratch.tensors()) == 1
    lins[1].refresh_fp8_weight()  # a layer's plans dropped: the shared buffers too (made again when needed)
    assert lins[0]._inference_plans.scratch.tensors() == []


def test_converting_again_moves_the_plans_off_the_old_workspace():
    """A second ops.convert shares a new Scratch: the plans made with the old one are dropped with it, so
    none keeps growing a workspace that no longer is the layer's (nor counted by memory_footprint)."""
    import float8.ops as ops

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    ops.convert(model, fp8_weights=True)
    lin = model[0]
    old = lin._inference_plans.scratch
    lin._inference_plans.add(("shape", torch.bfloat16), object())  # as a GPU call would leave it
    ops.convert(model, fp8_weights=True)
    assert lin._inference_plans.scratch is not old and len(lin._inference_plans) == 0
    assert model[2]._inference_plans.scratch is lin._inference_plans.scratch


def test_devices_get_buffers_of_their_own():
    """Stream handles repeat across devices (the default stream is 0 on each): the key a prepared call uses
    holds the device, so one Scratch shared by layers on two GPUs never hands one GPU's buffer to the other."""
    s = S.Scratch()
    a = s.get((0, 0, 1), torch.float32, 8, CPU)
    b = s.get((1, 0, 1), torch.float32, 8, torch.device("meta"))
    assert a is not b and b.device.type == "meta"


def test_a_prepared_calls_stream_key_names_its_device(monkeypatch):
    """PreparedMM._stream_key: (device, stream handle, thread) outside a capture, None during one. Stream
    handles faked: a CPU build has no CUDA streams."""
    import threading

    from float8.kernels import weight_only

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    keys = [weight_only.PreparedMM._stream_key(d) for d in (0, 1)]
    assert keys == [(0, 0, threading.get_ident()), (1, 0, threading.get_ident())]
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: True, raising=False)
    assert weight_only.PreparedMM._stream_key(0) is None
