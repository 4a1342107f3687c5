"""torch.save / torch.load(weights_only=True) in a fresh process, state_dicts, deepcopy, pickle."""

import copy
import pickle
import subprocess
import sys
import textwrap

import torch

from float8 import Float8Tensor, RowwiseScaling
from tests.tolerances import assert_same_bits


def same(a: Float8Tensor, b: Float8Tensor) -> None:
    assert isinstance(b, Float8Tensor)
    assert b.dtype == a.dtype and b.fp8_dtype == a.fp8_dtype
    assert_same_bits(b.fp8_data, a.fp8_data)
    assert_same_bits(b.scale_inv, a.scale_inv)
    assert (a.transpose_cache is None) == (b.transpose_cache is None)


def test_save_and_load_weights_only_in_a_fresh_process(tmp_path):
    t = Float8Tensor.quantize(torch.randn(32, 64, dtype=torch.bfloat16), with_transpose=True)
    r = Float8Tensor.quantize(torch.randn(8, 16), torch.float8_e5m2, scaling=RowwiseScaling())
    model = torch.nn.Linear(64, 32)
    state = {"weight": t, "rowwise": r, "plain": model.state_dict()}
    path = tmp_path / "fp8.pt"
    torch.save(state, path)
    expected = tmp_path / "expected.pt"
    torch.save({k: v.dequantize() for k, v in (("weight", t), ("rowwise", r))}, expected)
    script = textwrap.dedent(
        f"""
        import torch, float8
        state = torch.load({str(path)!r}, weights_only=True)
        expected = torch.load({str(expected)!r}, weights_only=True)
        for name in ("weight", "rowwise"):
            t = state[name]
            assert type(t).__name__ == "Float8Tensor", type(t)
            assert torch.equal(t.dequantize(), expected[name]), name
        assert state["weight"].transpose_cache is not None
        assert state["rowwise"].fp8_dtype == torch.float8_e5m2
        assert set(state["plain"]) == {{"weight", "bias"}}
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_module_state_dict_round_trip(tmp_path):
    class Holder(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.weight = torch.nn.Parameter(w, requires_grad=False)

    w = Float8Tensor.quantize(torch.randn(16, 32))
    path = tmp_path / "sd.pt"
    torch.save(Holder(w).state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    same(w, loaded["weight"])
    target = Holder(Float8Tensor.quantize(torch.zeros(16, 32)))
    target.load_state_dict(loaded)
    same(w, target.weight)


def test_deepcopy_and_pickle():
    t = Float8Tensor.quantize(torch.randn(16, 32), with_transpose=True)
    d = copy.deepcopy(t)
    same(t, d)
    assert d.fp8_data.data_ptr() != t.fp8_data.data_ptr()
    p = pickle.loads(pickle.dumps(t))
    same(t, p)


def test_flatten_lists_only_existing_inner_tensors():
    t = Float8Tensor.quantize(torch.randn(16, 32))
    names, ctx = t.__tensor_flatten__()
    assert names == ["_data", "_scale_inv"]
    tt = Float8Tensor.quantize(torch.randn(16, 32), with_transpose=True)
    names, ctx = tt.__tensor_flatten__()
    assert names == ["_data", "_scale_inv", "_transpose"]
    rebuilt = Float8Tensor.__tensor_unflatten__({n: getattr(tt, n) for n in names}, ctx, tt.shape, tt.stride())
    same(tt, rebuilt)
