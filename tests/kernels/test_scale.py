"""The scale rule (reference.scale_from_amax) and its device twin (common.scale_from_amax), and what the
rule means for the kernels that quantize with it.

- Device == reference, bit for bit, for every float32 amax we try, with and without power_of_2.
- amax 0 -> scale 1; inf or NaN -> NaN. So current scaling turns a tensor (a row, a block) holding +-inf
  or NaN into NaN data with a NaN scale_inv, which dequantizes to NaN, never to finite values; the other
  rows and blocks are unaffected. With a given scale the cast saturates instead (+-inf -> +-fp8_max) and
  amax is inf: the caller sees it there.
- The scale is at least min_scale(fp8_dtype): finite values up to the float32 maximum dequantize to
  finite values (fp8_max * scale_inv <= fp8_max / min_scale <= float32 max).
- Margins up to max_margin(fp8_dtype) keep amax nonzero in FP8; check_scaling_args refuses larger ones.
"""

import importlib

import pytest
import torch

from float8.kernels.common import check_scaling_args
from float8.kernels.reference import cast_to_fp8_ref, fp8_max, max_margin, min_scale, scale_from_amax

from .helpers import FP8, amax_samples, assert_bits, assert_outputs, device_scale, exact_pow2_floor, needs_interpreter

pytestmark = needs_interpreter

E4M3, E5M2 = FP8
F32MAX = torch.finfo(torch.float32).max
_m = {
    m: importlib.import_module(f"float8.kernels.{m}")
    for m in ("quantize", "cast_transpose", "rowwise", "blockwise", "dequantize")
}
quant_m, ct_m, row_m, block_m, dq_m = _m.values()

CAST = ("data", "scale_inv", "amax")
CAST_T = ("data", "data_t", "scale_inv", "amax")
ROW = ("data", "scale_inv")


def margins(fp8_dtype):
    return [0, 1, 5, max_margin(fp8_dtype)]


# ---- the rule ---------------------------------------------------------------------------------------


def test_min_scale_and_max_margin():
    assert min_scale(E4M3) == 2.0**-119 and min_scale(E5M2) == 2.0**-112
    assert max_margin(E4M3) == 17 and max_margin(E5M2) == 31
    for f8 in FP8:
        s = torch.tensor(min_scale(f8))
        assert torch.isfinite(fp8_max(f8) / s) and not torch.isfinite(fp8_max(f8) / (s / 2))  # the smallest


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("power_of_2", [False, True])
def test_scale_matches_reference(fp8_dtype, power_of_2):
    amax = amax_samples()
    for margin in margins(fp8_dtype):
        ref = scale_from_amax(amax, fp8_dtype, margin, power_of_2)
        assert_bits(device_scale(amax, fp8_dtype, margin, power_of_2), ref, f"scale, margin {margin}")
        if power_of_2:  # an exact round-down of the plain scale (min_scale is a power of two)
            assert_bits(ref, exact_pow2_floor(scale_from_amax(amax, fp8_dtype, margin)), "power of 2 vs round-down")


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("power_of_2", [False, True])
def test_scale_edges(fp8_dtype, power_of_2):
    amax = amax_samples()
    for margin in margins(fp8_dtype):
        for scale in (
            scale_from_amax(amax, fp8_dtype, margin, power_of_2),
            device_scale(amax, fp8_dtype, margin, power_of_2),
        ):
            finite = torch.isfinite(amax)
            assert scale[~finite].isnan().all()  # inf, -inf, NaN -> NaN
            assert (scale[amax == 0] == 1).all()  # 0 and -0 -> 1
            s = scale[finite & (amax > 0)]
            assert (s >= min_scale(fp8_dtype)).all() and (s <= F32MAX).all()
    huge = torch.tensor([F32MAX, 3e38, 1.75 * 2.0**127])
    assert (scale_from_amax(huge, fp8_dtype, 0, power_of_2) == min_scale(fp8_dtype)).all()
    assert (device_scale(huge, fp8_dtype, 0, power_of_2) == min_scale(fp8_dtype)).all()
    tiny = torch.tensor([1e-37])  # fp8_max / amax overflows: the largest float32, or 2**127 rounded down
    want = 2.0**127 if power_of_2 else F32MAX
    assert (
        scale_from_amax(tiny, fp8_dtype, 0, power_of_2).item()
        == device_scale(tiny, fp8_dtype, 0, power_of_2).item()
        == want
    )


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_max_margin_keeps_amax_nonzero(fp8_dtype):
    g = torch.Generator().manual_seed(0)
    amax = torch.exp2(torch.rand(20000, generator=g, dtype=torch.float64) * 200 - 100).float()  # 2**-100 .. 2**100
    limit = max_margin(fp8_dtype)
    for p2 in (False, True):
        for margin in (limit, limit + 1):
            q = cast_to_fp8_ref(amax, scale_from_amax(amax, fp8_dtype, margin, p2), fp8_dtype).float()
            if margin == limit:
                assert (q > 0).all(), f"margin {margin}, power_of_2 {p2}: an amax went to 0"
            elif p2:
                assert (q == 0).any(), f"margin {margin} should lose some amax to 0 with power_of_2"


def test_check_scaling_args_refuses_a_margin_above_the_limit():
    for f8, limit in ((E4M3, 17), (E5M2, 31)):
        check_scaling_args(f8, limit, True, "op")
        with pytest.raises(ValueError, match=rf"op: margin {limit + 1} is too large for {f8}: at most {limit}"):
            check_scaling_args(f8, limit + 1, False, "op")
    with pytest.raises(ValueError, match=r"op: margin must be an int >= 0, got -1"):
        check_scaling_args(E4M3, -1, False, "op")


# ---- through the kernels: inf and NaN under current scaling ------------------------------------------


def _with_value(shape, at, value, dtype=torch.bfloat16):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    x[at] = value
    return x


NONFINITE = [float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("value", NONFINITE, ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("small", [True, False], ids=["one-launch", "amax-pass"])
def test_tensorwise_nonfinite_gives_nan(value, fp8_dtype, small, monkeypatch):
    if not small:
        monkeypatch.setattr(quant_m, "SMALL_NUMEL", -1)
        monkeypatch.setattr(ct_m, "SMALL_NUMEL", -1)
    x = _with_value((17, 40), (3, 5), value)
    for got, ref, names in [
        (
            quant_m.quantize_tensorwise_triton(x, fp8_dtype, None, 1, True),
            quant_m.quantize_tensorwise_ref(x, fp8_dtype, None, 1, True),
            CAST_T,
        ),
        (
            ct_m.quantize_transpose_tensorwise_triton(x, fp8_dtype),
            ct_m.quantize_transpose_tensorwise_ref(x, fp8_dtype),
            CAST_T,
        ),
    ]:
        assert_outputs(got, ref, names)
        data, scale_inv, amax = got[0], got[-2], got[-1]
        assert scale_inv.isnan() and data.float().isnan().all() and got[1].float().isnan().all()
        assert amax.isnan() if value != value else amax.item() == float("inf")
        assert dq_m.dequantize_triton(data, scale_inv, torch.bfloat16).isnan().all()


@pytest.mark.parametrize("value", NONFINITE, ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("max_single_k", [8192, 16], ids=["registers", "two-pass"])
def test_rowwise_nonfinite_gives_nan_rows(value, max_single_k):
    x = _with_value((6, 33), (2, 7), value)
    for f8 in FP8:
        data, scale_inv = row_m.quantize_rowwise_triton(x, f8, 0, False, max_single_k)
        assert_outputs((data, scale_inv), row_m.quantize_rowwise_ref(x, f8), ROW)
        assert scale_inv[2].isnan() and data[2].float().isnan().all()
        others = torch.arange(6) != 2
        assert torch.isfinite(scale_inv[others]).all() and not data[others].float().isnan().any()
        assert_bits(data[others], row_m.quantize_rowwise_ref(x[others], f8)[0], "the other rows, as if alone")
        out = dq_m.dequantize_triton(data, scale_inv, torch.float32)
        assert out[2].isnan().all() and torch.isfinite(out[others]).all()


@pytest.mark.parametrize("value", NONFINITE, ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("block", [(1, 32), (32, 32)])
def test_blockwise_nonfinite_gives_nan_blocks(value, block):
    x = _with_value((64, 96), (40, 70), value)
    for f8 in FP8:
        data, scale_inv = block_m.quantize_blockwise_triton(x, *block, f8)
        assert_outputs((data, scale_inv), block_m.quantize_blockwise_ref(x, *block, f8), ROW)
        bad = torch.zeros(64, 96, dtype=torch.bool)
        bad[40 // block[0] * block[0] :][: block[0], 64:96] = True  # the block holding x[40, 70]
        assert data.float()[bad].isnan().all() and not data.float()[~bad].isnan().any()
        assert scale_inv.isnan().sum() == 1
        out = dq_m.dequantize_triton(data, scale_inv, torch.float32)
        assert out[bad].isnan().all() and torch.isfinite(out[~bad]).all()


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_given_scale_saturates_inf(fp8_dtype):
    # A given scale (delayed or static scaling) keeps its contract: +-inf -> +-fp8_max, NaN stays NaN
    # elementwise, amax = inf (NaN with a NaN); scale_inv = 1 / scale.
    cast_m = importlib.import_module("float8.kernels.cast")
    x = _with_value((9, 40), (1, 2), float("inf"))
    x[4, 4] = float("-inf")
    scale = torch.tensor([0.5])
    for got, ref, names in [
        (cast_m.cast_triton(x, scale, fp8_dtype), cast_m.cast_ref(x, scale, fp8_dtype), CAST),
        (ct_m.cast_transpose_triton(x, scale, fp8_dtype), ct_m.cast_transpose_ref(x, scale, fp8_dtype), CAST_T),
    ]:
        assert_outputs(got, ref, names)
        data = got[0].float()
        assert data[1, 2] == fp8_max(fp8_dtype) and data[4, 4] == -fp8_max(fp8_dtype)
        assert got[-2].item() == 2.0 and got[-1].item() == float("inf")
        x_nan = x.clone()
        x_nan[0, 0] = float("nan")
        got = cast_m.cast_triton(x_nan, scale, fp8_dtype)
        assert got[0].float().isnan().sum() == 1 and got[2].isnan()


# ---- through the kernels: finite values near the float32 maximum --------------------------------------


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("margin,power_of_2", [(0, False), (0, True), (3, True)])
def test_huge_finite_values_dequantize_finite(fp8_dtype, margin, power_of_2):
    # amax near 3.4e38: fp8_max / amax would make scale_inv = amax / fp8_max and fp8_max * scale_inv = amax
    # rounded up, inf; min_scale keeps scale_inv <= 2**119 (E4M3) / 2**112 (E5M2).
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 1e37
    x[5, 7], x[40, 100], x[63, 0] = F32MAX, -F32MAX, 3.3e38
    dq = dq_m.dequantize_triton
    cases = [
        (quant_m.quantize_tensorwise_triton(x, fp8_dtype, None, margin, power_of_2), CAST_T),
        (ct_m.quantize_transpose_tensorwise_triton(x, fp8_dtype, margin, power_of_2), CAST_T),
        (row_m.quantize_rowwise_triton(x, fp8_dtype, margin, power_of_2), ROW),
        (block_m.quantize_blockwise_triton(x, 1, 32, fp8_dtype, margin, power_of_2), ROW),
        (block_m.quantize_blockwise_triton(x, 32, 32, fp8_dtype, margin, power_of_2), ROW),
    ]
    refs = [
        quant_m.quantize_tensorwise_ref(x, fp8_dtype, None, margin, power_of_2),
        ct_m.quantize_transpose_tensorwise_ref(x, fp8_dtype, margin, power_of_2),
        row_m.quantize_rowwise_ref(x, fp8_dtype, margin, power_of_2),
        block_m.quantize_blockwise_ref(x, 1, 32, fp8_dtype, margin, power_of_2),
        block_m.quantize_blockwise_ref(x, 32, 32, fp8_dtype, margin, power_of_2),
    ]
    for (got, names), ref in zip(cases, refs):
        assert_outputs(got, ref, names)
        data, scale_inv = got[0], got[names.index("scale_inv")]
        assert (scale_inv == 1 / min_scale(fp8_dtype)).any()  # the clamp was exercised
        for out in (dq(data, scale_inv, torch.float32), dq_m.dequantize_ref(data, scale_inv, torch.float32)):
            assert torch.isfinite(out).all(), names
        big = dq(data, scale_inv, torch.float32)[5, 7]
        assert big > F32MAX / 2 ** (margin + 2)  # still the largest value, not flushed
