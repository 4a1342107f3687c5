"""quantize_tensorwise_multi (kernels/multi_quantize.py): many tensors, two launches, each tensor's outputs
bit for bit those of quantize_tensorwise_ref (and, on the GPU, of the single-tensor launcher).

The interpreter tier runs the Triton launcher on CPU tensors (TRITON_INTERPRET=1, hardware-faithful
conversions from conftest.py); the GPU tier repeats it on CUDA tensors at weight-like sizes.
"""

import os

import pytest
import torch

from float8.kernels import multi_quantize as mq
from float8.kernels.quantize import quantize_tensorwise
from float8.kernels.reference import amax_ref, quantize_tensorwise_ref

from .helpers import FP8, HP, assert_outputs, make_x, needs_interpreter
from .helpers import CountedLaunches as _Counted

NAMES = ("data", "data_t", "scale_inv", "amax")
# Tile edges (64 x 128), one element, an empty tensor among full ones, more tensors than a power of two.
SHAPES = [(64, 128), (65, 129), (1, 1), (0, 16), (3, 300), (130, 7), (16, 16)]


def _check_each(got, xs, f8, margin, p2, with_t, nan_bits=True):
    assert [len(g) for g in got] == [len(xs)] * 4
    # An FP8 GEMM reads each scale-inverse through a pointer cuBLASLt wants 16-byte aligned.
    assert all(s.data_ptr() % 16 == 0 for s in got[2])
    for i, x in enumerate(xs):
        ref = quantize_tensorwise_ref(x, f8, None, margin, p2, with_t)
        mine = tuple(g[i] for g in got)
        try:
            assert_outputs(mine, ref, NAMES, nan_bits=nan_bits)
        except AssertionError as e:
            raise AssertionError(f"tensor {i} of shape {tuple(x.shape)}: {e}") from None


@needs_interpreter
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("with_transpose", [False, True])
@pytest.mark.parametrize("margin,power_of_2", [(0, False), (2, True)])
def test_interpreted_matches_reference(fp8_dtype, with_transpose, margin, power_of_2, monkeypatch):
    # Every tensor has its own scale: the magnitudes differ by orders, and two hold NaN/inf (their scale
    # and values turn NaN, the others' must not).
    xs = [make_x(s, torch.bfloat16, seed=i, scale=10.0 ** (i - 3), specials=i in (2, 4)) for i, s in enumerate(SHAPES)]
    names = ("_multi_amax_kernel", "_multi_cast_kernel", "_multi_cast_flat_kernel")
    kernels = {n: _Counted(getattr(mq, n)) for n in names}
    for n, k in kernels.items():
        monkeypatch.setattr(mq, n, k)
    got = mq.quantize_tensorwise_multi_triton(xs, fp8_dtype, margin, power_of_2, with_transpose)
    # Without a transpose the aligned tensors (torch's allocations) take the flat cast.
    want = {"_multi_amax_kernel": 1, "_multi_cast_kernel": int(with_transpose)}
    want["_multi_cast_flat_kernel"] = int(not with_transpose)
    assert {n: k.n for n, k in kernels.items()} == want
    _check_each(got, xs, fp8_dtype, margin, power_of_2, with_transpose)


@needs_interpreter
def test_interpreted_unaligned_tensors_take_the_tiled_cast(monkeypatch):
    """A tensor whose data is not 16-byte aligned (a view at an odd offset) is read without the vector
    loads' alignment promise: the tiled cast and the unaligned amax, the same bits."""
    base = make_x((64 * 129 + 1,), torch.bfloat16, seed=3, specials=True)
    xs = [make_x((65, 129), torch.bfloat16, seed=1), base[1:].view(64, 129)]
    assert xs[1].data_ptr() % 16
    kernels = {n: _Counted(getattr(mq, n)) for n in ("_multi_cast_kernel", "_multi_cast_flat_kernel")}
    for n, k in kernels.items():
        monkeypatch.setattr(mq, n, k)
    aligned_flags = []
    amax_kernel = mq._multi_amax_kernel

    class _Amax:  # records the ALIGNED constexpr each amax launch gets
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                aligned_flags.append(kwargs["ALIGNED"])
                return amax_kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(mq, "_multi_amax_kernel", _Amax())
    got = mq.quantize_tensorwise_multi_triton(xs, FP8[0])
    assert (kernels["_multi_cast_kernel"].n, kernels["_multi_cast_flat_kernel"].n) == (1, 0)
    assert aligned_flags == [False]  # no vector-load promise for the amax either
    _check_each(got, xs, FP8[0], 0, False, False)
    amaxes = mq.amax_multi_triton(xs)
    assert aligned_flags == [False, False]
    want = torch.stack([amax_ref(x) for x in xs])
    assert torch.equal(amaxes.isnan(), want.isnan()) and torch.equal(torch.nan_to_num(amaxes), torch.nan_to_num(want))


@needs_interpreter
@pytest.mark.parametrize("dtype", HP)
def test_interpreted_input_dtypes(dtype):
    xs = [make_x(s, dtype, seed=i) for i, s in enumerate([(33, 17), (64, 64)])]
    for f8 in FP8:
        _check_each(mq.quantize_tensorwise_multi_triton(xs, f8, 0, False, True), xs, f8, 0, False, True)


@needs_interpreter
def test_interpreted_one_tensor_and_many():
    # One tensor (the binary search has one candidate) and 37 (not a power of two, several halvings).
    for n in (1, 37):
        xs = [make_x((16 + i, 24), torch.bfloat16, seed=i, scale=1.0 + i) for i in range(n)]
        _check_each(mq.quantize_tensorwise_multi_triton(xs, FP8[0], 0, False, True), xs, FP8[0], 0, False, True)


def test_reference_path_on_cpu():
    xs = [make_x(s, torch.float32, seed=i) for i, s in enumerate([(5, 7), (0, 3)])]
    got = mq.quantize_tensorwise_multi(xs, FP8[1], 1, False, True)
    _check_each(got, xs, FP8[1], 1, False, True)


@pytest.mark.parametrize(
    "xs,err,match",
    [
        ([], ValueError, "non-empty list"),
        ([torch.zeros(4, 4), torch.zeros(4)], ValueError, r"xs\[1\] must be 2-D"),
        ([torch.zeros(4, 8).t()], ValueError, "contiguous"),
        ([torch.zeros(4, 4, dtype=torch.float64)], TypeError, "float64"),
        ([torch.zeros(4, 4), torch.zeros(4, 4, dtype=torch.bfloat16)], ValueError, "share xs\\[0\\]'s dtype"),
        ([torch.zeros(4, 4, dtype=torch.float8_e4m3fn)], TypeError, "float8_e4m3fn"),
    ],
)
def test_bad_input(xs, err, match):
    with pytest.raises(err, match=match):
        mq.quantize_tensorwise_multi(xs, FP8[0])


def test_bad_scaling_args():
    with pytest.raises(ValueError, match="margin"):
        mq.quantize_tensorwise_multi([torch.zeros(4, 4)], FP8[0], margin=-1)
    with pytest.raises(TypeError, match="with_transpose"):
        mq.quantize_tensorwise_multi([torch.zeros(4, 4)], FP8[0], with_transpose=1)


# amax_multi: shapes of any rank (FSDP shards are 2-D, a norm's weight 1-D), an empty one, and specials.
AMAX_SHAPES = [(64, 128), (65, 129), (1,), (0, 16), (3, 5, 7), (70000,), (16, 16)]


@needs_interpreter
@pytest.mark.parametrize("dtype", HP)
def test_interpreted_amax_multi_is_each_tensors_amax_in_one_launch(dtype, monkeypatch):
    xs = [make_x(s, dtype, seed=i, scale=10.0 ** (i - 3), specials=i in (1, 4)) for i, s in enumerate(AMAX_SHAPES)]
    kernel = _Counted(mq._multi_amax_kernel)
    monkeypatch.setattr(mq, "_multi_amax_kernel", kernel)
    got = mq.amax_multi_triton(xs)
    assert kernel.n == 1 and got.shape == (len(xs),) and got.dtype == torch.float32
    want = torch.stack([amax_ref(x) for x in xs])
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan()[[1, 4]].all()
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert got[3] == 0  # the empty tensor
    ref = mq.amax_multi(xs)  # the public function, on CPU tensors: the reference
    assert torch.equal(torch.nan_to_num(ref), torch.nan_to_num(want)) and torch.equal(ref.isnan(), want.isnan())


def test_amax_multi_reference_path_and_bad_input():
    xs = [torch.randn(4, 4), torch.full((3,), -7.0)]
    assert torch.equal(mq.amax_multi_ref(xs), torch.stack([xs[0].abs().max(), torch.tensor(7.0)]))
    with pytest.raises(ValueError, match="non-empty"):
        mq.amax_multi([])
    with pytest.raises(ValueError, match="contiguous"):
        mq.amax_multi([torch.randn(4, 4).t()])
    with pytest.raises(ValueError, match="dtype and device"):
        mq.amax_multi([torch.randn(4), torch.randn(4, dtype=torch.bfloat16)])
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        mq.amax_multi([torch.zeros(4, dtype=torch.int32)])


def test_device_table_on_the_cpu_is_the_values():
    t = mq.device_table([3, -1, 2**40], torch.device("cpu"), "op")
    assert t.dtype == torch.int64 and t.tolist() == [3, -1, 2**40]


@needs_interpreter
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_interpreted_cast_with_scale_gives_quantize_tensorwises_bits(fp8_dtype, monkeypatch):
    # The FSDP pre-all-gather cast: quantize_tensorwise with a given scale, less its amax output. The
    # launcher itself runs (use_triton forced on: the interpreter takes CPU tensors), at ordinary and at
    # degenerate scales (a precomputed scale from a NaN or inf amax is NaN; 0 and inf are refused upstream
    # but must not turn finite here).
    from float8.kernels import quantize as qz

    launched = []
    real = qz.launch_cast
    monkeypatch.setattr(qz, "launch_cast", lambda *a, **k: launched.append(1) or real(*a, **k))
    monkeypatch.setattr(qz, "use_triton", lambda x, writes_fp8=True: True)
    for i, shape in enumerate([(65, 129), (0, 16), (300,)]):
        x = make_x(shape, torch.float32, seed=i, specials=i == 0)
        for value in (0.37, float("nan"), float("inf"), 0.0, 3e38):
            scale = torch.tensor(value, dtype=torch.float32)
            data, scale_inv = qz.cast_with_scale(x, fp8_dtype, scale)
            want = quantize_tensorwise_ref(x, fp8_dtype, scale)
            assert_outputs((data, scale_inv), (want[0], want[2]), ("data", "scale_inv"))
    assert len(launched) == 15


@needs_interpreter
def test_cast_with_scale_under_a_dispatch_mode_takes_the_registered_op(monkeypatch):
    # A dispatch mode (tests/distributed/test_fsdp.py counts all-reduces with one) cannot see a direct
    # launch: the call goes through quantize_tensorwise, which runs the kernel with the mode set aside.
    from torch.utils._python_dispatch import TorchDispatchMode

    from float8.kernels import quantize as qz

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    launched = []
    real = qz.launch_cast
    monkeypatch.setattr(qz, "launch_cast", lambda *a, **k: launched.append(1) or real(*a, **k))
    monkeypatch.setattr(qz, "use_triton", lambda x, writes_fp8=True: True)
    x, scale = make_x((33, 65), torch.float32, seed=1), torch.tensor(0.37)
    with Passthrough():
        data, scale_inv = qz.cast_with_scale(x, FP8[0], scale)
    assert launched == []
    want = quantize_tensorwise_ref(x, FP8[0], scale)
    assert_outputs((data, scale_inv), (want[0], want[2]), ("data", "scale_inv"))
    qz.cast_with_scale(x, FP8[0], scale)
    assert launched == [1]


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1",
    reason="TRITON_INTERPRET=1 would run these on the interpreter, not the GPU",
)
@pytest.mark.parametrize("with_transpose", [False, True])
def test_gpu_matches_single_tensor_launcher(with_transpose):
    # Weight-like shapes (a Llama block's Linears at d=1024) plus ragged ones, and a tensor with NaN.
    shapes = [(3072, 1024), (1024, 1024), (5632, 1024), (1024, 2816), (65, 129), (0, 16), (1, 1)]
    xs = [
        make_x(s, torch.bfloat16, seed=i, scale=10.0 ** (i % 4 - 2), specials=i == 4, device="cuda")
        for i, s in enumerate(shapes)
    ]
    for f8 in FP8:
        got = mq.quantize_tensorwise_multi(xs, f8, 0, False, with_transpose)
        _check_each(got, xs, f8, 0, False, with_transpose, nan_bits=False)
        for i, x in enumerate(xs):  # and the single-tensor launcher, NaN payloads included
            single = quantize_tensorwise(x, f8, None, 0, False, with_transpose)
            assert_outputs(tuple(g[i] for g in got), single, NAMES)


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1",
    reason="TRITON_INTERPRET=1 would run these on the interpreter, not the GPU",
)
def test_gpu_amax_multi_and_cast_with_scale_match_the_single_tensor_ops():
    # FSDP-shard-like fp32 masters, ragged and empty ones, one with NaN/inf.
    from float8.kernels.amax import amax
    from float8.kernels.quantize import cast_with_scale

    shapes = [(1536, 4096), (512, 4096), (7168, 4096), (65, 129), (0, 16), (3000,)]
    xs = [make_x(s, torch.float32, seed=i, specials=i == 3, device="cuda") for i, s in enumerate(shapes)]
    got = mq.amax_multi(xs)
    want = torch.stack([amax(x) for x in xs])
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    for f8 in FP8:
        for x in xs:
            scale = torch.tensor(0.37, device="cuda")
            data, scale_inv = cast_with_scale(x, f8, scale)
            single = quantize_tensorwise(x, f8, scale)
            assert_outputs((data, scale_inv), (single[0], single[2]), ("data", "scale_inv"))


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1",
    reason="TRITON_INTERPRET=1 would run these on the interpreter, not the GPU",
)
def test_gpu_multi_launchers_never_wait_for_the_gpu():
    """The pointer table goes to the GPU without a stream sync (a pageable copy waited for every queued
    kernel: after an optimizer step, the whole step), and the results are right although the copy was
    queued behind long work and the host buffer may be reused once it has run."""
    # Each call its own tensors (so its own table): a table read after its host buffer was reused for the
    # next call's would quantize the wrong tensors.
    calls = [
        [torch.randn(s, device="cuda", dtype=torch.bfloat16) * (i + 1) for s in [(1024, 1024), (512, 2048), (65, 129)]]
        for i in range(4)
    ]
    want = [[quantize_tensorwise(x, FP8[0]) for x in xs] for xs in calls]
    want_amax = [torch.stack([amax_ref(x) for x in xs]) for xs in calls]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises
    try:
        for _ in range(8):
            a @ a  # tens of ms queued before the tables' copies
        got = [(mq.quantize_tensorwise_multi(xs, FP8[0]), mq.amax_multi(xs)) for xs in calls]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for (quantized, amaxes), wants, want_a in zip(got, want, want_amax):
        for i in range(len(wants)):
            assert_outputs(tuple(g[i] for g in quantized), wants[i], NAMES)
        assert torch.equal(amaxes, want_a)


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1",
    reason="TRITON_INTERPRET=1 would run these on the interpreter, not the GPU",
)
def test_gpu_unaligned_tensors_give_the_single_tensor_bits():
    """A view 2 bytes into its storage is read without the vector loads' alignment promise (a false
    promise would fault or read the wrong bytes): the tiled cast and the unaligned amax, the same bits."""
    base = torch.randn(64 * 129 + 1, device="cuda", dtype=torch.bfloat16)
    xs = [torch.randn(300, 64, device="cuda", dtype=torch.bfloat16), base[1:].view(64, 129)]
    assert xs[1].data_ptr() % 16
    got = mq.quantize_tensorwise_multi(xs, FP8[0])
    for i, x in enumerate(xs):
        assert_outputs(tuple(g[i] for g in got), quantize_tensorwise(x, FP8[0]), NAMES)
    assert torch.equal(mq.amax_multi(xs), torch.stack([amax_ref(x) for x in xs]))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_multi_launchers_run_on_their_tensors_device():
    """Tensors on cuda:1 while cuda:0 is current: the table, the zeroed amaxes and the kernels all on cuda:1."""
    xs = [torch.randn(s, device="cuda:1", dtype=torch.bfloat16) for s in [(256, 512), (65, 129)]]
    with torch.cuda.device(0):
        got = mq.quantize_tensorwise_multi(xs, FP8[0])
        amaxes = mq.amax_multi(xs)
    torch.cuda.synchronize(1)
    for i, x in enumerate(xs):
        assert_outputs(tuple(g[i] for g in got), quantize_tensorwise(x, FP8[0]), NAMES)
    assert torch.equal(amaxes, torch.stack([amax_ref(x) for x in xs]))


@pytest.mark.gpu
def test_gpu_multi_launchers_refuse_a_cuda_graph_capture():
    """A graph would keep the copy from a host buffer that is reused after the capture: refused, named."""
    xs = [torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)]
    mq.quantize_tensorwise_multi(xs, FP8[0])  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="not capturable in a CUDA graph"):
        with torch.cuda.graph(graph):
            mq.quantize_tensorwise_multi(xs, FP8[0])
