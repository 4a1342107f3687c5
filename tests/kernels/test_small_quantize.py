"""The one-launch path of current per-tensor scaling for small tensors (common.SMALL_NUMEL).

quantize_tensorwise_triton and quantize_transpose_tensorwise_triton hand a small x to one single-program
kernel (amax, scale, cast, all outputs; no torch.zeros, no atomics). Checked here: it is bit-identical to the
*_ref functions and to the general path (amax, scale_inv, data, data_t), including NaN/inf/zero/empty inputs
and margin/power_of_2; it is the path taken at and below the threshold, and the general one above it. The
interpreter tier runs on CPU tensors (TRITON_INTERPRET=1, hardware-faithful conversions from conftest.py);
the GPU tier repeats the comparisons on CUDA tensors.
"""

import importlib
import os

import pytest
import torch

from float8.kernels.launch import FastLauncher

from .helpers import (
    FP8,
    HP,
    assert_bits,
    assert_outputs,
    fp8_grid,
    make_x,
    needs_interpreter,
)
from .helpers import (
    CountedLaunches as _Counted,
)

common_m, quant_m, ct_m = (
    importlib.import_module(f"float8.kernels.{m}") for m in ("common", "quantize", "cast_transpose")
)

CAST = ("data", "data_t", "scale_inv", "amax")  # quantize_tensorwise_triton: data_t (0,) without a transpose
CAST_T = ("data", "data_t", "scale_inv", "amax")
SHAPES = [(1, 1), (3, 5), (16, 64), (64, 128), (128, 128), (1, 8192)]
SHAPES_T = [s for s in SHAPES if max(s) <= common_m.SMALL_DIM] + [(128, 1), (1, 128), (1, 3, 70), (1, 1, 9, 4)]
LAYOUTS = ["contiguous", "transposed", "offset", "strided"]
SCALING = [(0, False), (0, True), (3, False), (2, True)]
KERNELS = [
    ("quantize", "_quantize_small_kernel"),
    ("cast_transpose", "_quantize_transpose_small_kernel"),
    ("amax", "_amax_kernel"),
    ("cast", "_cast_kernel"),
    ("cast_transpose", "_cast_transpose_kernel"),
]


class _CountedCalls:
    """Stands in for a FastLauncher: counts its calls (launches) and forwards them."""

    def __init__(self, launcher):
        self.launcher, self.n = launcher, 0

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self.launcher(*args, **kwargs)


@pytest.fixture
def launches(monkeypatch):
    """Counts launches per kernel name, and torch.zeros calls (under "zeros")."""
    counted = {}
    for mod, name in KERNELS:
        m = importlib.import_module(f"float8.kernels.{mod}")
        kernel = getattr(m, name)
        counted[name] = _Counted(kernel)
        monkeypatch.setattr(m, name, counted[name])
        for attr, launcher in list(vars(m).items()):  # a FastLauncher of this kernel (kernels/launch.py)
            if isinstance(launcher, FastLauncher) and launcher.kernel is kernel:
                counted[name] = _CountedCalls(launcher)
                monkeypatch.setattr(m, attr, counted[name])
    zeros = torch.zeros
    n_zeros = [0]

    def counting_zeros(*args, **kwargs):
        n_zeros[0] += 1
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", counting_zeros)

    def counts():
        """Counts since the last call."""
        out = {k: c.n for k, c in counted.items() if c.n}
        if n_zeros[0]:
            out["zeros"] = n_zeros[0]
        for c in counted.values():
            c.n = 0
        n_zeros[0] = 0
        return out

    return counts


def _q(x, f8, margin=0, p2=False, *, launches):
    """quantize_tensorwise's launcher, current scaling without a transpose: one launch of the small kernel,
    nothing else, outputs == reference."""
    launches()  # reset: the references call torch.zeros for an empty x
    got = quant_m.quantize_tensorwise_triton(x, f8, None, margin, p2)
    assert launches() == {"_quantize_small_kernel": 1}
    assert_outputs(got, quant_m.quantize_tensorwise_ref(x, f8, None, margin, p2), CAST)
    return got


def _qt(x, f8, margin=0, p2=False, *, launches):
    """The same for quantize_transpose_tensorwise."""
    launches()
    got = ct_m.quantize_transpose_tensorwise_triton(x, f8, margin, p2)
    assert launches() == {"_quantize_transpose_small_kernel": 1}
    assert_outputs(got, ct_m.quantize_transpose_tensorwise_ref(x, f8, margin, p2), CAST_T)
    return got


# ---- interpreter tier: small path == reference, bit for bit ------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("shape", [*SHAPES, (), (7,), (2, 3, 5), (0, 5), (4, 0)])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_quantize_small_shapes(shape, fp8_dtype, launches):
    _q(make_x(shape, torch.bfloat16, specials=True, scale=300.0), fp8_dtype, launches=launches)
    _q(make_x(shape, torch.bfloat16), fp8_dtype, launches=launches)  # finite: a scale other than 1


@needs_interpreter
@pytest.mark.parametrize("shape", [*SHAPES_T, (0, 5), (4, 0), (1, 0, 3)])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_quantize_transpose_small_shapes(shape, fp8_dtype, launches):
    _qt(make_x(shape, torch.bfloat16, specials=True, scale=300.0), fp8_dtype, launches=launches)
    _qt(make_x(shape, torch.bfloat16), fp8_dtype, launches=launches)


@needs_interpreter
@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("margin,power_of_2", SCALING)
def test_small_dtypes_layouts_scaling(dtype, layout, margin, power_of_2, launches):
    x = make_x((17, 33), dtype, layout, scale=1e-3 if dtype != torch.float16 else 1.0)
    for f8 in FP8:
        _q(x, f8, margin, power_of_2, launches=launches)
        _qt(x, f8, margin, power_of_2, launches=launches)


@needs_interpreter
@pytest.mark.parametrize("fill", [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-38, 3e38])
@pytest.mark.parametrize("margin,power_of_2", [(0, False), (0, True), (17, True)])
def test_small_degenerate_amax(fill, margin, power_of_2, launches, monkeypatch):
    # amax 0 -> scale 1; inf, NaN -> scale NaN (all outputs NaN); tiny -> the largest float32 scale; huge (with
    # a margin: the largest E4M3 takes) -> min_scale.
    x = torch.full((5, 7), fill)
    x[0, 0] = 0.0
    for f8 in FP8:
        small = _q(x, f8, margin, power_of_2, launches=launches), _qt(x, f8, margin, power_of_2, launches=launches)
        with monkeypatch.context() as m:  # the general path on the same inputs
            m.setattr(quant_m, "SMALL_NUMEL", -1)
            m.setattr(ct_m, "SMALL_NUMEL", -1)
            big = (
                quant_m.quantize_tensorwise_triton(x, f8, None, margin, power_of_2),
                ct_m.quantize_transpose_tensorwise_triton(x, f8, margin, power_of_2),
            )
        for s, b, names in zip(small, big, (CAST, CAST_T)):
            for o, r, n in zip(s, b, names):
                assert_bits(o, r, n)


@needs_interpreter
@pytest.mark.parametrize("at", [0, 77, 128 * 128 - 1])
def test_small_nan_anywhere_propagates(at, launches):
    x = make_x((128, 128), torch.float32)
    x.view(-1)[at] = float("nan")
    x.view(-1)[5] = float("inf")
    for f8 in FP8:
        data, _, scale_inv, amax = _q(x, f8, launches=launches)
        assert amax.isnan() and scale_inv.isnan() and data.float().isnan().all()
        assert _qt(x, f8, launches=launches)[3].isnan()
    x.view(-1)[at] = 1.0
    data, _, scale_inv, amax = _q(x, FP8[0], launches=launches)
    assert amax.item() == float("inf") and scale_inv.isnan() and data.float().isnan().all()


@needs_interpreter
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", HP)
def test_small_all_codes_and_midpoints(fp8_dtype, dtype, launches):
    # The grid holds inf/NaN codes: amax NaN, scale NaN, every output NaN.
    g = fp8_grid(fp8_dtype)
    x = g[: (g.numel() // 16) * 16].reshape(-1, 16).to(dtype)
    assert x.shape[0] <= common_m.SMALL_DIM
    assert _q(x, fp8_dtype, launches=launches)[0].float().isnan().all()
    assert _qt(x, fp8_dtype, launches=launches)[1].float().isnan().all()
    # amax = fp8 max: scale 1, computed, so x lands on every code, midpoint and midpoint +- 1 ulp.
    finite = g[g.abs() <= torch.finfo(fp8_dtype).max]
    x = finite[: (finite.numel() // 16) * 16].reshape(-1, 16).to(dtype)
    _q(x, fp8_dtype, launches=launches)
    _qt(x, fp8_dtype, launches=launches)


@needs_interpreter
@pytest.mark.parametrize("shape", [(3, 5), (128, 128), (1, 3, 70)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_small_equals_general_path(shape, layout, launches, monkeypatch):
    # Bit for bit, NaN payloads included: the same helpers on the same values.
    x = make_x(shape, torch.bfloat16, layout, specials=True, scale=300.0)
    for f8, margin, p2 in [(FP8[0], 0, False), (FP8[1], 2, True)]:
        small = (
            quant_m.quantize_tensorwise_triton(x, f8, None, margin, p2),
            ct_m.quantize_transpose_tensorwise_triton(x, f8, margin, p2),
        )
        assert launches() == {"_quantize_small_kernel": 1, "_quantize_transpose_small_kernel": 1}
        with monkeypatch.context() as m:
            m.setattr(quant_m, "SMALL_NUMEL", -1)
            m.setattr(ct_m, "SMALL_NUMEL", -1)
            big = (
                quant_m.quantize_tensorwise_triton(x, f8, None, margin, p2),
                ct_m.quantize_transpose_tensorwise_triton(x, f8, margin, p2),
            )
        assert launches() == {"_amax_kernel": 2, "_cast_kernel": 1, "_cast_transpose_kernel": 1, "zeros": 2}
        for s, b, names in zip(small, big, (CAST, CAST_T)):
            for o, r, n in zip(s, b, names):
                assert_bits(o, r, n)


# ---- which path runs ---------------------------------------------------------------------------------


@needs_interpreter
def test_quantize_threshold(launches):
    n = common_m.SMALL_NUMEL
    for shape in [(n,), (1, n), (n // 128, 128)]:
        _q(make_x(shape, torch.float32), FP8[0], launches=launches)
    x = make_x((n + 1,), torch.float32)
    got = quant_m.quantize_tensorwise_triton(x, FP8[0])
    assert launches() == {"_amax_kernel": 1, "_cast_kernel": 1, "zeros": 1}
    assert_outputs(got, quant_m.quantize_tensorwise_ref(x, FP8[0]), CAST)


@needs_interpreter
@pytest.mark.parametrize("shape", [(129, 64), (64, 129), (1, 8192), (2, 8, 8), (0, 4, 4), (1, 2, 8, 8)])
def test_quantize_transpose_above_threshold(shape, launches):
    # Too tall, too wide, or a batch of more than one matrix: amax pass + tiled cast-transpose.
    x = make_x(shape, torch.float32)
    got = ct_m.quantize_transpose_tensorwise_triton(x, FP8[0])
    counts = launches()
    assert counts.pop("_cast_transpose_kernel") == 1 and counts.pop("zeros") == 1
    assert counts == ({"_amax_kernel": 1} if x.numel() else {})
    assert_outputs(got, ct_m.quantize_transpose_tensorwise_ref(x, FP8[0]), CAST_T)


@needs_interpreter
def test_quantize_transpose_explicit_config_takes_tiled_kernel(launches):
    cfg = dict(BLOCK_M=16, BLOCK_K=32, num_warps=4, TRANS_INPUT=False)
    x = make_x((37, 45), torch.float32)
    got = ct_m.quantize_transpose_tensorwise_triton(x, FP8[0], config=cfg)
    assert launches() == {"_amax_kernel": 1, "_cast_transpose_kernel": 1, "zeros": 1}
    assert_outputs(got, ct_m.quantize_transpose_tensorwise_ref(x, FP8[0]), CAST_T)


@needs_interpreter
def test_comparison_catches_one_wrong_code(launches):
    # The comparisons above can fail: one code off in data_t is caught.
    x = make_x((16, 64), torch.bfloat16)
    got = list(_qt(x, FP8[0], launches=launches))
    got[1].view(torch.uint8)[3, 4] ^= 1
    with pytest.raises(AssertionError, match="data_t"):
        assert_outputs(got, ct_m.quantize_transpose_tensorwise_ref(x, FP8[0]), CAST_T)


# ---- GPU tier -----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1",
    reason="TRITON_INTERPRET=1 would run these on the interpreter, not the GPU",
)
@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_small_path_vs_ref(dtype, layout, launches, monkeypatch):
    for shape in [*SHAPES, (1, 3, 70), (0, 5)]:
        x = make_x(shape, dtype, layout, specials=True, scale=300.0, device="cuda")
        for f8 in FP8:
            for margin, p2 in SCALING:
                launches()  # reset: the references call torch.zeros for an empty x
                got = quant_m.quantize_tensorwise_triton(x, f8, None, margin, p2)
                assert launches() == {"_quantize_small_kernel": 1}
                ref = quant_m.quantize_tensorwise_ref(x, f8, None, margin, p2)
                for o, r, n in zip(got, ref, CAST):
                    assert o.device == r.device
                    assert_bits(o, r, n, nan_bits=False)  # the hardware's NaN sign is not part of the contract
                if max(x.shape) > common_m.SMALL_DIM:
                    continue
                launches()
                got = ct_m.quantize_transpose_tensorwise_triton(x, f8, margin, p2)
                assert launches() == {"_quantize_transpose_small_kernel": 1}
                ref = ct_m.quantize_transpose_tensorwise_ref(x, f8, margin, p2)
                for o, r, n in zip(got, ref, CAST_T):
                    assert_bits(o, r, n, nan_bits=False)
                with monkeypatch.context() as m:  # and the general path, bit for bit, NaN payloads included
                    m.setattr(ct_m, "SMALL_NUMEL", -1)
                    big = ct_m.quantize_transpose_tensorwise_triton(x, f8, margin, p2)
                for o, r, n in zip(got, big, CAST_T):
                    assert_bits(o, r, n)


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1",
    reason="TRITON_INTERPRET=1 would run these on the interpreter, not the GPU",
)
def test_gpu_small_path_cuda_graph():
    x = make_x((64, 128), torch.bfloat16, device="cuda")
    static_x = x.clone()

    def step():
        return (
            quant_m.quantize_tensorwise_triton(static_x, FP8[0]),
            ct_m.quantize_transpose_tensorwise_triton(static_x, FP8[1], 1, True),
        )

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    static_x.copy_(x * 3)
    graph.replay()
    torch.cuda.synchronize()
    refs = (
        quant_m.quantize_tensorwise_ref(x * 3, FP8[0]),
        ct_m.quantize_transpose_tensorwise_ref(x * 3, FP8[1], 1, True),
    )
    for o, r, names in zip(outs, refs, (CAST, CAST_T)):
        for a, b, n in zip(o, r, names):
            assert_bits(a, b, n, nan_bits=False)


def test_next_pow2_matches_triton_for_ints():
    """kernels.common.next_pow2 computes ints in Python (Triton's loop took 2.2 us a call); a traced size
    still goes to Triton's. The same values either way."""
    import triton

    from float8.kernels.common import next_pow2

    for n in [*range(-3, 4100), 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_pow2(n) == triton.next_power_of_2(max(1, n)), n
