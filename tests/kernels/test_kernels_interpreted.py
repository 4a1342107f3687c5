"""Every Triton launcher, run by the interpreter on CPU tensors, against its *_ref twin, bit for bit.

The interpreter's float conversions are made hardware-faithful by tests/kernels/conftest.py; the GPU tier
(test_gpu_kernels.py) repeats the comparisons on the hardware. FP8 outputs, scale_inv and amax are compared
as bits, NaNs where helpers.assert_outputs says (an amax's NaN; data under a NaN scale) as NaN-ness.
"""

import importlib

import pytest
import torch

from .helpers import FP8, HP, assert_bits, assert_outputs, fp8_grid, make_x, needs_interpreter

pytestmark = needs_interpreter

_mod = {
    m: importlib.import_module(f"float8.kernels.{m}")
    for m in ("amax", "cast", "quantize", "cast_transpose", "rowwise", "blockwise", "dequantize")
}
amax_m, cast_m, quant_m, ct_m, row_m, block_m, dq_m = _mod.values()

SHAPES = [(), (1,), (1, 1), (17, 33), (3, 4097), (128, 256), (2, 3, 128), (0, 5), (4, 0)]
SHAPES_2D = [s for s in SHAPES if len(s) >= 2]
LAYOUTS = ["transposed", "offset", "strided"]
SCALE = torch.tensor([0.37])  # not a power of two: x * scale rounds
CAST = ("data", "scale_inv", "amax")
CAST_T = ("data", "data_t", "scale_inv", "amax")


# ---- amax -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_amax(shape):
    x = make_x(shape, torch.bfloat16, specials=False)
    assert_outputs([amax_m.amax_triton(x)], [amax_m.amax_ref(x)], ["amax"])


@pytest.mark.parametrize("nan_at", [0, 5000, 12287])
def test_amax_nan_anywhere_propagates(nan_at):
    # Several programs: the NaN may sit in any of them, the others must not overwrite it.
    x = make_x((12288,), torch.float32)
    x[nan_at] = float("nan")
    x[100] = float("inf")
    assert amax_m.amax_triton(x).isnan()
    x[nan_at] = 0
    assert amax_m.amax_triton(x).item() == float("inf")


# ---- cast (given scale) -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_cast_shapes(shape, fp8_dtype):
    x = make_x(shape, torch.bfloat16, specials=True, scale=300.0)
    assert_outputs(cast_m.cast_triton(x, SCALE, fp8_dtype), cast_m.cast_ref(x, SCALE, fp8_dtype), CAST)


@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("layout", ["contiguous", *LAYOUTS])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_cast_dtypes_layouts(dtype, layout, fp8_dtype):
    x = make_x((17, 33), dtype, layout, specials=True, scale=300.0)
    scale = SCALE.reshape(())  # a 0-d scale works too
    assert_outputs(cast_m.cast_triton(x, scale, fp8_dtype), cast_m.cast_ref(x, scale, fp8_dtype), CAST)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", HP)
def test_cast_all_codes_and_midpoints(fp8_dtype, dtype):
    # x * scale lands exactly on every code, midpoint and midpoint +- 1 ulp (scale a power of two). In
    # bfloat16/float16 the nudged midpoints round to something else first: still a fine input.
    scale = torch.tensor([2.0**-3])
    x = (fp8_grid(fp8_dtype) / scale).to(dtype)
    assert_outputs(cast_m.cast_triton(x, scale, fp8_dtype), cast_m.cast_ref(x, scale, fp8_dtype), CAST)


# ---- quantize_tensorwise (current scaling) ----------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_quantize_shapes(shape, fp8_dtype):
    x = make_x(shape, torch.bfloat16)
    got = quant_m.quantize_tensorwise_triton(x, fp8_dtype)
    assert_outputs(got, quant_m.quantize_tensorwise_ref(x, fp8_dtype), CAST_T)


@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("layout", ["contiguous", *LAYOUTS])
@pytest.mark.parametrize("margin,power_of_2", [(0, False), (0, True), (3, False), (2, True)])
def test_quantize_dtypes_layouts_scaling(dtype, layout, margin, power_of_2):
    x = make_x((17, 33), dtype, layout, scale=1e-3 if dtype != torch.float16 else 1.0)
    for fp8_dtype in FP8:
        got = quant_m.quantize_tensorwise_triton(x, fp8_dtype, None, margin, power_of_2)
        assert_outputs(got, quant_m.quantize_tensorwise_ref(x, fp8_dtype, None, margin, power_of_2), CAST_T)


@pytest.mark.parametrize("fill", [0.0, float("inf"), float("nan"), 1e-38])
def test_quantize_degenerate_amax(fill):
    # amax 0 -> scale 1; inf, NaN -> scale NaN (NaN data); a tiny amax -> the largest float32 scale.
    x = torch.full((5, 7), fill)
    x[0, 0] = 0.0
    for fp8_dtype in FP8:
        got = quant_m.quantize_tensorwise_triton(x, fp8_dtype)
        assert_outputs(got, quant_m.quantize_tensorwise_ref(x, fp8_dtype), CAST_T)


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_quantize_specials(fp8_dtype):
    x = make_x((9, 31), torch.float32, specials=True)
    got = quant_m.quantize_tensorwise_triton(x, fp8_dtype)
    assert_outputs(got, quant_m.quantize_tensorwise_ref(x, fp8_dtype), CAST_T)


@pytest.mark.parametrize("given", [False, True], ids=["current", "given-scale"])
@pytest.mark.parametrize("with_transpose", [False, True])
@pytest.mark.parametrize("shape", [(17, 33), (2, 3, 70), (128, 256)])
def test_quantize_tensorwise_paths(given, with_transpose, shape):
    # The op's launcher takes the path its arguments name, and writes that path's bits (data_t empty
    # without a transpose); margin and power_of_2 are ignored with a given scale.
    x = make_x(shape, torch.bfloat16, "transposed", specials=given, scale=300.0)
    scale = SCALE if given else None
    for f8 in FP8:
        got = quant_m.quantize_tensorwise_triton(x, f8, scale, 2, True, with_transpose)
        assert_outputs(got, quant_m.quantize_tensorwise_ref(x, f8, scale, 2, True, with_transpose), CAST_T)
        if with_transpose:
            path = (
                ct_m.cast_transpose_triton(x, scale, f8)
                if given
                else ct_m.quantize_transpose_tensorwise_triton(x, f8, 2, True)
            )
        else:
            path = cast_m.cast_triton(x, scale, f8) if given else None
            assert got[1].shape == (0,) and got[1].dtype == f8
            got = got[:1] + got[2:]
        if path is not None:
            for o, p, n in zip(got, path, CAST_T if with_transpose else CAST):
                assert_bits(o, p, n)


# ---- cast_transpose / quantize_transpose_tensorwise -------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES_2D)
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_cast_transpose_shapes(shape, fp8_dtype):
    x = make_x(shape, torch.bfloat16, specials=True, scale=300.0)
    got = ct_m.cast_transpose_triton(x, SCALE, fp8_dtype)
    assert_outputs(got, ct_m.cast_transpose_ref(x, SCALE, fp8_dtype), CAST_T)


@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("layout", ["contiguous", *LAYOUTS])
@pytest.mark.parametrize("shape", [(17, 33), (2, 3, 70)])
def test_cast_transpose_dtypes_layouts(dtype, layout, shape):
    x = make_x(shape, dtype, layout, specials=True, scale=300.0)
    for fp8_dtype in FP8:
        got = ct_m.cast_transpose_triton(x, SCALE, fp8_dtype)
        assert_outputs(got, ct_m.cast_transpose_ref(x, SCALE, fp8_dtype), CAST_T)


@pytest.mark.parametrize("trans_input", [False, True])
@pytest.mark.parametrize("dtype", HP)
def test_cast_transpose_configs(trans_input, dtype):
    # Both ways of transposing, and a tile shape other than the default, over odd sizes.
    cfg = dict(BLOCK_M=16, BLOCK_K=32, num_warps=4, TRANS_INPUT=trans_input)
    x = make_x((37, 45), dtype, specials=True, scale=300.0)
    for fp8_dtype in FP8:
        got = ct_m.cast_transpose_triton(x, SCALE, fp8_dtype, config=cfg)
        assert_outputs(got, ct_m.cast_transpose_ref(x, SCALE, fp8_dtype), CAST_T)
        got = ct_m.quantize_transpose_tensorwise_triton(x.clamp(-1e4, 1e4), fp8_dtype, 1, True, config=cfg)
        assert_outputs(got, ct_m.quantize_transpose_tensorwise_ref(x.clamp(-1e4, 1e4), fp8_dtype, 1, True), CAST_T)


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_cast_transpose_all_codes_and_midpoints(fp8_dtype):
    scale = torch.tensor([2.0**-3])
    g = fp8_grid(fp8_dtype)
    x = (g[: (g.numel() // 16) * 16] / scale).reshape(-1, 16)
    got = ct_m.cast_transpose_triton(x, scale, fp8_dtype)
    assert_outputs(got, ct_m.cast_transpose_ref(x, scale, fp8_dtype), CAST_T)


@pytest.mark.parametrize("shape", SHAPES_2D)
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_quantize_transpose_shapes(shape, fp8_dtype):
    x = make_x(shape, torch.bfloat16)
    got = ct_m.quantize_transpose_tensorwise_triton(x, fp8_dtype)
    assert_outputs(got, ct_m.quantize_transpose_tensorwise_ref(x, fp8_dtype), CAST_T)


@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_transpose_dtypes_layouts(dtype, layout):
    x = make_x((2, 17, 33), dtype, layout)
    for fp8_dtype in FP8:
        got = ct_m.quantize_transpose_tensorwise_triton(x, fp8_dtype, 2, True)
        assert_outputs(got, ct_m.quantize_transpose_tensorwise_ref(x, fp8_dtype, 2, True), CAST_T)


# ---- rowwise ----------------------------------------------------------------------------------------

ROW = ("data", "scale_inv")


@pytest.mark.parametrize("shape", [s for s in SHAPES if s])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_rowwise_shapes(shape, fp8_dtype):
    x = make_x(shape, torch.bfloat16, specials=True)
    got = row_m.quantize_rowwise_triton(x, fp8_dtype)
    assert_outputs(got, row_m.quantize_rowwise_ref(x, fp8_dtype), ROW)


@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("layout", ["contiguous", *LAYOUTS])
@pytest.mark.parametrize("margin,power_of_2", [(0, False), (1, True)])
def test_rowwise_dtypes_layouts(dtype, layout, margin, power_of_2):
    x = make_x((6, 33), dtype, layout)
    x[2] = 0.0  # an all-zero row: scale 1
    x[3, 1] = float("nan")  # a NaN row and an inf row: scale NaN, the row NaN (test_scale.py)
    x[4, 2] = float("inf")
    for fp8_dtype in FP8:
        got = row_m.quantize_rowwise_triton(x, fp8_dtype, margin, power_of_2)
        assert_outputs(got, row_m.quantize_rowwise_ref(x, fp8_dtype, margin, power_of_2), ROW)


@pytest.mark.parametrize("K", [1, 63, 64, 200])
def test_rowwise_two_pass_loop(K):
    # Rows longer than the single-pass limit (lowered to 64 here) go through the amax loop + cast loop.
    x = make_x((5, K), torch.float32, specials=K > 60)
    for fp8_dtype in FP8:
        got = row_m.quantize_rowwise_triton(x, fp8_dtype, 0, False, max_single_k=64)
        assert_outputs(got, row_m.quantize_rowwise_ref(x, fp8_dtype), ROW)


# ---- blockwise --------------------------------------------------------------------------------------

BLOCK_CASES = [
    ((1, 128), (1, 128)),
    ((3, 256), (1, 128)),
    ((2, 3, 384), (1, 128)),
    ((256,), (1, 128)),
    ((0, 128), (1, 128)),
    ((4, 0), (1, 128)),
    ((128, 128), (128, 128)),
    ((256, 384), (128, 128)),
    ((0, 256), (128, 128)),
    ((64, 48), (32, 16)),
    ((5, 6), (1, 3)),
]


@pytest.mark.parametrize("shape,block", BLOCK_CASES)
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_blockwise_shapes(shape, block, fp8_dtype):
    x = make_x(shape, torch.bfloat16, specials=True)
    got = block_m.quantize_blockwise_triton(x, *block, fp8_dtype)
    assert_outputs(got, block_m.quantize_blockwise_ref(x, *block, fp8_dtype), ROW)


@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_blockwise_dtypes_layouts(dtype, layout, block):
    x = make_x((128, 256), dtype, layout)
    x[:, :128] *= 1e-3  # blocks of different magnitudes get different scales
    for fp8_dtype in FP8:
        got = block_m.quantize_blockwise_triton(x, *block, fp8_dtype, 1, True)
        assert_outputs(got, block_m.quantize_blockwise_ref(x, *block, fp8_dtype, 1, True), ROW)


# ---- dequantize -------------------------------------------------------------------------------------


def _fp8_data(shape, fp8_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8).view(fp8_dtype)


DQ_CASES = [
    ((17, 33), ()),  # per tensor
    ((), ()),
    ((1, 1), (1, 1)),
    ((17, 33), (17, 1)),  # per row
    ((2, 3, 33), (2, 3, 1)),
    ((3, 256), (3, 2)),  # (1, 128) blocks
    ((256, 256), (2, 2)),  # (128, 128) blocks
    ((4, 6, 8), (4, 3, 2)),  # other blocks that flatten
    ((4, 6, 8), (2, 1, 4)),
    ((4, 6, 8), (2, 6, 1)),  # does not flatten: the reference path
    ((0, 5), (0, 1)),
]


@pytest.mark.parametrize("shape,scale_shape", DQ_CASES)
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_dequantize(shape, scale_shape, fp8_dtype):
    data = _fp8_data(shape, fp8_dtype)  # every code appears, NaN and inf codes included
    g = torch.Generator().manual_seed(1)
    scale_inv = torch.exp2(torch.randn(scale_shape, generator=g) * 8) * (1 + torch.rand(scale_shape, generator=g))
    for dtype in HP:
        got = dq_m.dequantize_triton(data, scale_inv, dtype)
        assert_outputs([got], [dq_m.dequantize_ref(data, scale_inv, dtype)], ["out"])


def test_dequantize_all_codes_non_contiguous():
    for fp8_dtype in FP8:
        data = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).reshape(16, 16).t()
        scale_inv = torch.tensor([[0.37], [3.0e3]])  # (8, 16) blocks
        for dtype in HP:
            got = dq_m.dequantize_triton(data, scale_inv, dtype)
            assert_outputs([got], [dq_m.dequantize_ref(data, scale_inv, dtype)], ["out"])
