"""GPU tier: every kernel on the hardware, bit for bit against its reference run on the same CUDA tensors.

Inputs: all 256 FP8 codes, every midpoint between adjacent codes and each midpoint one float32 ulp either
side (scaled by a power of two so that x * scale lands on them exactly), for both formats; odd sizes (1, 17,
4097 columns); transposed, offset and strided views; bfloat16/float16/float32; inf and NaN. FP8 NaNs are
compared as NaN-ness (the hardware's satfinite cast may drop a NaN's sign; torch keeps it), everything else
as bits. Also: the device-side scale rule against reference.scale_from_amax, CUDA-graph capture (no host
sync anywhere), torch.compile with inductor, and the public ops' CUDA dispatch.
"""

import importlib
import os

import pytest
import torch

import float8.kernels as K
from float8.kernels.reference import max_margin, min_scale, scale_from_amax

from .helpers import FP8, HP, amax_samples, assert_bits, device_scale, exact_pow2_floor, fp8_grid, make_x

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1",
        reason="TRITON_INTERPRET=1 would run these on the interpreter, not the GPU",
    ),
]

DEVICE = "cuda"
_m = {
    m: importlib.import_module(f"float8.kernels.{m}")
    for m in ("amax", "cast", "quantize", "cast_transpose", "rowwise", "blockwise", "dequantize")
}
amax_m, cast_m, quant_m, ct_m, row_m, block_m, dq_m = _m.values()

CAST = ("data", "scale_inv", "amax")
CAST_T = ("data", "data_t", "scale_inv", "amax")
ROW = ("data", "scale_inv")
LAYOUTS = ["contiguous", "transposed", "offset", "strided"]


def check(ours, ref, names):
    ours = ours if isinstance(ours, (tuple, list)) else [ours]
    ref = ref if isinstance(ref, (tuple, list)) else [ref]
    for o, r, n in zip(ours, ref, names):
        assert o.device == r.device
        assert_bits(o, r, n, nan_bits=False)


def grid_matrix(fp8_dtype, cols, dtype=torch.float32, finite_only=False, scale=2.0**-3):
    """The code/midpoint grid / scale, repeated to fill (rows, cols) with at least 3 rows."""
    g = fp8_grid(fp8_dtype)
    if finite_only:
        g = g[g.abs() <= torch.finfo(fp8_dtype).max]
    rows = max(3, -(-g.numel() // cols))
    flat = g.repeat(-(-rows * cols // g.numel()))[: rows * cols]
    return (flat.reshape(rows, cols) / scale).to(dtype).to(DEVICE)


# ---- cast and cast_transpose over every code and midpoint --------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("cols", [1, 17, 4097])
def test_cast_codes_midpoints(fp8_dtype, dtype, cols):
    scale = torch.tensor([2.0**-3], device=DEVICE)
    x = grid_matrix(fp8_dtype, cols, dtype)
    check(cast_m.cast_triton(x, scale, fp8_dtype), cast_m.cast_ref(x, scale, fp8_dtype), CAST)
    for with_t in (False, True):  # the op's CUDA dispatch
        check(
            K.quantize_tensorwise(x, fp8_dtype, scale, 0, False, with_t),
            K.quantize_tensorwise_ref(x, fp8_dtype, scale, 0, False, with_t),
            CAST_T,
        )
    check(ct_m.cast_transpose_triton(x, scale, fp8_dtype), ct_m.cast_transpose_ref(x, scale, fp8_dtype), CAST_T)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_cast_codes_midpoints_views(fp8_dtype, layout):
    scale = torch.tensor([2.0**-3], device=DEVICE)
    base = grid_matrix(fp8_dtype, 64)
    x = {"transposed": base.t(), "offset": base[1:, 2:], "strided": base[:, ::2]}[layout]
    check(cast_m.cast_triton(x, scale, fp8_dtype), cast_m.cast_ref(x, scale, fp8_dtype), CAST)
    check(ct_m.cast_transpose_triton(x, scale, fp8_dtype), ct_m.cast_transpose_ref(x, scale, fp8_dtype), CAST_T)


@pytest.mark.parametrize("trans_input", [False, True])
@pytest.mark.parametrize("tile", [(64, 128, 8), (128, 128, 8), (64, 64, 4), (32, 128, 4)])
def test_cast_transpose_configs(trans_input, tile):
    cfg = dict(BLOCK_M=tile[0], BLOCK_K=tile[1], num_warps=tile[2], TRANS_INPUT=trans_input)
    scale = torch.tensor([0.37], device=DEVICE)
    for dtype in HP:
        x = make_x((3, 130, 4097), dtype, specials=True, scale=300.0, device=DEVICE)
        ours = ct_m.cast_transpose_triton(x, scale, FP8[0], config=cfg)
        check(ours, ct_m.cast_transpose_ref(x, scale, FP8[0]), CAST_T)


# ---- current scaling: tensorwise, transposed, rowwise, blockwise -------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("finite_only", [True, False])
@pytest.mark.parametrize("margin,power_of_2", [(0, False), (0, True), (2, True)])
def test_quantize_codes_midpoints(fp8_dtype, dtype, finite_only, margin, power_of_2):
    for cols in (1, 17, 4097):
        x = grid_matrix(fp8_dtype, cols, dtype, finite_only)
        check(
            quant_m.quantize_tensorwise_triton(x, fp8_dtype, None, margin, power_of_2),
            quant_m.quantize_tensorwise_ref(x, fp8_dtype, None, margin, power_of_2),
            CAST_T,
        )
        check(
            ct_m.quantize_transpose_tensorwise_triton(x, fp8_dtype, margin, power_of_2),
            ct_m.quantize_transpose_tensorwise_ref(x, fp8_dtype, margin, power_of_2),
            CAST_T,
        )
        check(
            row_m.quantize_rowwise_triton(x, fp8_dtype, margin, power_of_2),
            row_m.quantize_rowwise_ref(x, fp8_dtype, margin, power_of_2),
            ROW,
        )


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_blockwise_codes_midpoints(fp8_dtype, dtype, block):
    x = grid_matrix(fp8_dtype, 384, dtype, finite_only=True)
    x = x.repeat(-(-256 // x.shape[0]), 1)[:256]  # (256, 384)
    x[:128] *= 2.0**-7  # blocks of different magnitudes
    for margin, p2 in [(0, False), (1, True)]:
        check(
            block_m.quantize_blockwise_triton(x, *block, fp8_dtype, margin, p2),
            block_m.quantize_blockwise_ref(x, *block, fp8_dtype, margin, p2),
            ROW,
        )


SHAPES = [(1,), (1, 1), (17, 33), (3, 4097), (5, 9000), (2, 3, 128), (0, 5), (4, 0), (4096, 4097)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", HP)
def test_all_kernels_shapes(shape, dtype):
    x = make_x(shape, dtype, specials=len(shape) > 1 and shape[0] < 100, scale=50.0, device=DEVICE)
    scale = torch.tensor([0.37], device=DEVICE)
    for f8 in FP8:
        check(cast_m.cast_triton(x, scale, f8), cast_m.cast_ref(x, scale, f8), CAST)
        check(quant_m.quantize_tensorwise_triton(x, f8), quant_m.quantize_tensorwise_ref(x, f8), CAST_T)
        check(row_m.quantize_rowwise_triton(x, f8), row_m.quantize_rowwise_ref(x, f8), ROW)
        if len(shape) >= 2:
            check(ct_m.cast_transpose_triton(x, scale, f8), ct_m.cast_transpose_ref(x, scale, f8), CAST_T)
            check(
                ct_m.quantize_transpose_tensorwise_triton(x, f8), ct_m.quantize_transpose_tensorwise_ref(x, f8), CAST_T
            )


@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("dtype", HP)
def test_all_kernels_views(layout, dtype):
    x = make_x((256, 384), dtype, layout, specials=True, scale=50.0, device=DEVICE)
    assert not x.is_contiguous()
    scale = torch.tensor([0.37], device=DEVICE)
    for f8 in FP8:
        check(cast_m.cast_triton(x, scale, f8), cast_m.cast_ref(x, scale, f8), CAST)
        check(quant_m.quantize_tensorwise_triton(x, f8), quant_m.quantize_tensorwise_ref(x, f8), CAST_T)
        check(ct_m.cast_transpose_triton(x, scale, f8), ct_m.cast_transpose_ref(x, scale, f8), CAST_T)
        check(ct_m.quantize_transpose_tensorwise_triton(x, f8), ct_m.quantize_transpose_tensorwise_ref(x, f8), CAST_T)
        check(row_m.quantize_rowwise_triton(x, f8), row_m.quantize_rowwise_ref(x, f8), ROW)
        for block in [(1, 128), (128, 128)]:
            check(block_m.quantize_blockwise_triton(x, *block, f8), block_m.quantize_blockwise_ref(x, *block, f8), ROW)


def test_rowwise_long_rows_two_pass():
    x = make_x((7, 20000), torch.bfloat16, specials=True, device=DEVICE)
    for f8 in FP8:
        check(row_m.quantize_rowwise_triton(x, f8), row_m.quantize_rowwise_ref(x, f8), ROW)
        check(row_m.quantize_rowwise_triton(x, f8, 0, False, max_single_k=64), row_m.quantize_rowwise_ref(x, f8), ROW)


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_nonfinite_and_huge_amax(fp8_dtype):
    # The scale rule's edges on the hardware (max.f32 drops NaN; the NaN must still come out): an inf or NaN
    # makes its tensor, row or block NaN under current scaling; finite values near the float32 maximum
    # clamp the scale at min_scale and dequantize finite.
    f32max = torch.finfo(torch.float32).max
    base = make_x((256, 384), torch.float32, scale=1e36, device=DEVICE)
    base[5, 7], base[200, 300] = f32max, -f32max
    for bad in (None, float("inf"), float("nan")):
        x = base.clone()
        if bad is not None:
            x[100, 100] = bad
        for got, ref, names in [
            (quant_m.quantize_tensorwise_triton(x, fp8_dtype), quant_m.quantize_tensorwise_ref(x, fp8_dtype), CAST_T),
            (
                ct_m.quantize_transpose_tensorwise_triton(x, fp8_dtype, 1, True),
                ct_m.quantize_transpose_tensorwise_ref(x, fp8_dtype, 1, True),
                CAST_T,
            ),
            (row_m.quantize_rowwise_triton(x, fp8_dtype), row_m.quantize_rowwise_ref(x, fp8_dtype), ROW),
            (
                block_m.quantize_blockwise_triton(x, 1, 128, fp8_dtype),
                block_m.quantize_blockwise_ref(x, 1, 128, fp8_dtype),
                ROW,
            ),
            (
                block_m.quantize_blockwise_triton(x, 128, 128, fp8_dtype, 0, True),
                block_m.quantize_blockwise_ref(x, 128, 128, fp8_dtype, 0, True),
                ROW,
            ),
        ]:
            check(got, ref, names)
            data, scale_inv = got[0], got[names.index("scale_inv")]
            out = dq_m.dequantize_triton(data, scale_inv, torch.float32)
            if bad is None:
                assert torch.isfinite(out).all() and (scale_inv == 1 / min_scale(fp8_dtype)).any()
            else:
                assert out.isnan().any() and not torch.isinf(out).any()


# ---- amax --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", [0, 1 << 20, (1 << 22) - 1])
def test_amax_nan_and_inf_in_any_program(where):
    x = make_x((1 << 22,), torch.bfloat16, device=DEVICE)
    x[where] = float("inf")
    assert amax_m.amax_triton(x).item() == float("inf")
    x[(where + 12345) % x.numel()] = float("nan")
    assert amax_m.amax_triton(x).isnan()
    x = make_x((1 << 22,), torch.float32, device=DEVICE)
    check(amax_m.amax_triton(x), amax_m.amax_ref(x), ["amax"])


# ---- dequantize --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize(
    "shape,scale_shape",
    [
        ((16, 4097), ()),
        ((16, 4097), (16, 1)),
        ((2, 3, 256), (2, 3, 2)),
        ((256, 384), (2, 3)),
        ((4, 6, 8), (2, 1, 4)),
        ((4, 6, 8), (2, 6, 1)),
        ((1,), ()),
    ],
)
def test_dequantize_all_codes(fp8_dtype, shape, scale_shape):
    n = torch.Size(shape).numel()
    codes = torch.arange(n, dtype=torch.int32).remainder(256).to(torch.uint8).view(fp8_dtype).reshape(shape)
    g = torch.Generator().manual_seed(0)
    scale_inv = torch.exp2(torch.randn(scale_shape, generator=g) * 8) * (1 + torch.rand(scale_shape, generator=g))
    data, scale_inv = codes.to(DEVICE), scale_inv.to(DEVICE)
    data_t = data.transpose(0, -1)
    scale_inv_t = scale_inv.transpose(0, -1) if scale_inv.dim() else scale_inv
    for dtype in HP:
        check(dq_m.dequantize_triton(data, scale_inv, dtype), dq_m.dequantize_ref(data, scale_inv, dtype), ["out"])
        check(
            dq_m.dequantize_triton(data_t, scale_inv_t, dtype),
            dq_m.dequantize_ref(data_t, scale_inv_t, dtype),
            ["out (non-contiguous)"],
        )


# ---- the scale rule on the device --------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("margin", [0, 1, 7, "max"])
def test_device_scale_matches_reference(fp8_dtype, margin):
    margin = max_margin(fp8_dtype) if margin == "max" else margin
    amax = amax_samples(DEVICE, n=200_000)
    for p2 in (False, True):
        ref = scale_from_amax(amax, fp8_dtype, margin, p2)
        ours = device_scale(amax, fp8_dtype, margin, p2)
        # NaN (a non-finite amax) compared as NaN-ness: payloads are not part of the contract
        assert_bits(ours, ref, f"scale vs reference (CUDA), power_of_2={p2}", nan_bits=False)
        assert_bits(
            ours.cpu(),
            scale_from_amax(amax.cpu(), fp8_dtype, margin, p2),
            f"scale vs reference (CPU), power_of_2={p2}",
            nan_bits=False,
        )
    assert_bits(
        ours,
        exact_pow2_floor(scale_from_amax(amax, fp8_dtype, margin)),
        "power-of-2 scale vs exact round-down",
        nan_bits=False,
    )


# ---- no host sync: CUDA graphs; torch.compile with inductor ------------------------------------------


def test_cuda_graph_capture_and_replay():
    x = make_x((1000, 1024), torch.bfloat16, device=DEVICE)
    static_x = x.clone()
    scale = torch.tensor([0.37], device=DEVICE)

    def step():
        return (
            quant_m.quantize_tensorwise_triton(static_x, FP8[0]),
            ct_m.quantize_transpose_tensorwise_triton(static_x, FP8[1], 1, True),
            cast_m.cast_triton(static_x, scale, FP8[0]),
            row_m.quantize_rowwise_triton(static_x, FP8[0]),
            block_m.quantize_blockwise_triton(static_x, 1, 128, FP8[0]),
        )

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    static_x.copy_(x * 3)  # new values, same buffers: the graph must recompute amax and scales
    graph.replay()
    torch.cuda.synchronize()
    refs = (
        quant_m.quantize_tensorwise_ref(x * 3, FP8[0]),
        ct_m.quantize_transpose_tensorwise_ref(x * 3, FP8[1], 1, True),
        cast_m.cast_ref(x * 3, scale, FP8[0]),
        row_m.quantize_rowwise_ref(x * 3, FP8[0]),
        block_m.quantize_blockwise_ref(x * 3, 1, 128, FP8[0]),
    )
    for o, r, names in zip(outs, refs, [CAST_T, CAST_T, CAST, ROW, ROW]):
        check(o, r, names)


def test_torch_compile_inductor_fullgraph():
    def f(x):
        data, _, scale_inv, _ = K.quantize_tensorwise(x, FP8[0])
        d_r, s_r = K.quantize_rowwise(x * 2, FP8[1])
        d_t, t_t, s_t, _ = K.quantize_tensorwise(x, FP8[1], torch.reciprocal(scale_inv), with_transpose=True)
        return (
            K.dequantize(data, scale_inv, torch.float32)
            + K.dequantize(d_r, s_r, torch.float32)
            + K.dequantize(t_t, s_t, torch.float32).t()
        )

    x = make_x((256, 512), torch.bfloat16, device=DEVICE)
    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))
