"""Scaling semantics (docs/design.md §3) through the public API, and hypothesis properties."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from float8 import BlockwiseScaling, Float8Tensor, RowwiseScaling, TensorwiseScaling
from float8.kernels.reference import cast_to_fp8_ref, fp8_max, scale_from_amax
from tests.tolerances import SQNR_DB, assert_same_bits, sqnr_db

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8 = [E4M3, E5M2]


def t32(*values):
    return torch.tensor(values, dtype=torch.float32)


# ---- the reference, pinned to hand-checked numbers ------------------------------------------------
def test_cast_rounds_to_nearest_even_and_saturates():
    one = torch.ones(())
    out = cast_to_fp8_ref(t32(500.0, -500.0, math.inf, -math.inf, 7.93, 448.0, 464.0, 0.0), one, E4M3).float()
    assert out[:6].tolist() == [448.0, -448.0, 448.0, -448.0, 8.0, 448.0]
    # 464 is the midpoint of 448 and (non-existent) 480: it saturates rather than becoming NaN.
    assert out[6].item() == 448.0 and out[7].item() == 0.0
    assert torch.isnan(cast_to_fp8_ref(t32(math.nan), one, E4M3).float()).all()
    # Ties go to the even code: in [8, 16) codes are 1 apart; 8.5 lies between 8 (even) and 9, 9.5 between
    # 9 and 10 (even).
    assert cast_to_fp8_ref(t32(8.5, 9.5), one, E4M3).float().tolist() == [8.0, 10.0]
    assert cast_to_fp8_ref(t32(1e6, -math.inf), one, E5M2).float().tolist() == [57344.0, -57344.0]


def test_scale_from_amax_rules():
    s = scale_from_amax(t32(448.0, 0.0, math.inf, math.nan, 1.0, 1e-45), E4M3)
    assert s[:2].tolist() == [1.0, 1.0] and s[4].item() == 448.0
    assert s[2:4].isnan().all()  # a non-finite amax gives a NaN scale: the tensor never comes out finite
    # A subnormal amax would give an infinite scale: clamped to the largest float32.
    assert s[5].item() == torch.finfo(torch.float32).max
    assert scale_from_amax(t32(448.0), E4M3, margin=2).item() == 0.25
    p2 = scale_from_amax(t32(3.0), E4M3, power_of_2=True).item()
    assert p2 == 128.0  # 448/3 = 149.3 rounds down to 128
    assert fp8_max(E4M3) == 448.0 and fp8_max(E5M2) == 57344.0


def test_quantize_is_the_reference():
    x = torch.randn(64, 48) * 3
    q = Float8Tensor.quantize(x)
    scale = fp8_max(E4M3) / x.abs().amax()
    assert_same_bits(q.fp8_data, cast_to_fp8_ref(x, scale, E4M3))
    assert q.scale_inv.dtype == torch.float32 and q.scale_inv.dim() == 0
    assert_same_bits(q.scale_inv, (1 / scale.float()).reshape(()))
    assert_same_bits(q.dequantize(), (q.fp8_data.float() * q.scale_inv).to(x.dtype))


def test_zero_and_nonfinite_inputs():
    z = Float8Tensor.quantize(torch.zeros(4, 4))
    assert z.scale_inv.item() == 1.0 and (z.dequantize() == 0).all()
    x = t32(1.0, math.inf, -2.0, math.nan)
    q = Float8Tensor.quantize(x)
    # A non-finite input never comes out finite (docs/design.md §2): the whole tensor reads as NaN, so an
    # overflow stays visible to GradScaler and anomaly checks (the earlier rule made inf 448).
    assert q.scale_inv.isnan()
    assert q.dequantize().isnan().all()


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cast_sqnr(fp8, dtype):
    x = torch.randn(256, 256, dtype=dtype)
    q = Float8Tensor.quantize(x, fp8)
    assert q.dtype == dtype and q.fp8_dtype == fp8 and q.dequantize().dtype == dtype
    floor = SQNR_DB["cast"] if fp8 == E4M3 else SQNR_DB["cast"] - 6  # E5M2 has one mantissa bit less
    assert sqnr_db(x, q.dequantize()) >= floor


def test_sqnr_check_can_fail():
    x = torch.randn(256, 256)
    wrong = Float8Tensor.quantize(x * 1.5).dequantize()
    assert sqnr_db(x, wrong) < SQNR_DB["cast"]


# ---- hypothesis properties ------------------------------------------------------------------------
# Zero or a normal magnitude in [2**-20, 1e4]: keeps every scale finite (a subnormal amax would be clamped,
# which is tested above) so that the algebraic properties below hold exactly.
magnitude = st.floats(2.0**-20, 1e4, allow_nan=False, allow_infinity=False, allow_subnormal=False, width=32)
finite = st.one_of(st.just(0.0), magnitude, magnitude.map(lambda v: -v))


@st.composite
def tensors(draw, min_dims=1, max_dims=3):
    ndim = draw(st.integers(min_dims, max_dims))
    shape = draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim))
    n = math.prod(shape)
    values = draw(st.lists(finite, min_size=n, max_size=n))
    return torch.tensor(values, dtype=torch.float32).reshape(shape)


SCALINGS = [TensorwiseScaling(), TensorwiseScaling(power_of_2=True), RowwiseScaling()]


@settings(max_examples=60, deadline=None)
@given(x=tensors(), fp8=st.sampled_from(FP8), power_of_2=st.booleans())
def test_requantizing_a_dequantized_tensor_changes_no_bit(x, fp8, power_of_2):
    q = Float8Tensor.quantize(x, fp8, scaling=TensorwiseScaling(power_of_2=power_of_2))
    # With the tensor's own scale: the same bits, whatever the scaling.
    again = Float8Tensor.quantize(q.dequantize(), fp8, scale=1 / q.scale_inv)
    assert_same_bits(again.fp8_data, q.fp8_data)
    if not power_of_2:
        # Current scaling from scratch maps the amax to fp8_max again: the same bits, and a scale_inv within
        # one float32 ulp (fp8_max / (fp8_max * scale_inv) need not round back to 1 / scale_inv). A
        # power-of-two scale can differ: rounding may lower the amax across a power of two.
        fresh = Float8Tensor.quantize(q.dequantize(), fp8)
        assert_same_bits(fresh.fp8_data, q.fp8_data)
        assert torch.allclose(fresh.scale_inv, q.scale_inv, rtol=2**-22, atol=0)


@settings(max_examples=40, deadline=None)
@given(x=tensors(), fp8=st.sampled_from(FP8))
def test_rowwise_requantization_keeps_the_bits(x, fp8):
    q = Float8Tensor.quantize(x, fp8, scaling=RowwiseScaling())
    again = Float8Tensor.quantize(q.dequantize(), fp8, scaling=RowwiseScaling())
    assert_same_bits(again.fp8_data, q.fp8_data)


@settings(max_examples=60, deadline=None)
@given(x=tensors(), fp8=st.sampled_from(FP8), scaling=st.sampled_from(SCALINGS))
def test_negation_commutes_with_quantize(x, fp8, scaling):
    q, qn = Float8Tensor.quantize(x, fp8, scaling=scaling), Float8Tensor.quantize(-x, fp8, scaling=scaling)
    negated = (q.fp8_data.view(torch.uint8) ^ 0x80).view(fp8)  # flip the sign bit (torch has no FP8 neg)
    assert_same_bits(qn.fp8_data, negated)
    assert_same_bits(qn.scale_inv, q.scale_inv)


@settings(max_examples=60, deadline=None)
@given(x=tensors(), k=st.integers(-8, 8), fp8=st.sampled_from(FP8))
def test_power_of_two_scale_invariance(x, k, fp8):
    # With power-of-two scales, x * 2**k quantizes to the same bits and a scale_inv 2**k times larger.
    scaling = TensorwiseScaling(power_of_2=True)
    q = Float8Tensor.quantize(x, fp8, scaling=scaling)
    qk = Float8Tensor.quantize(x * 2.0**k, fp8, scaling=scaling)
    if q.scale_inv.item() == 1.0 and x.abs().amax() == 0:
        return  # all zeros: scale 1 either way
    assert_same_bits(qk.fp8_data, q.fp8_data)
    assert qk.scale_inv.item() == q.scale_inv.item() * 2.0**k


def _half_ulp(v: torch.Tensor, fp8) -> torch.Tensor:
    """Half the spacing of FP8 codes around |v| (in the scaled domain)."""
    mant = 3 if fp8 == E4M3 else 2
    min_exp = -6 if fp8 == E4M3 else -14
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0**min_exp)))
    return 2.0 ** (e - mant) / 2


@settings(max_examples=60, deadline=None)
@given(x=tensors(), fp8=st.sampled_from(FP8))
def test_error_is_at_most_half_an_ulp(x, fp8):
    q = Float8Tensor.quantize(x, fp8)
    scale = 1 / q.scale_inv.double()
    scaled = x.double() * scale
    err = (q.fp8_data.double() - scaled).abs()
    assert (err <= _half_ulp(scaled, fp8).double() * (1 + 1e-6)).all()


@settings(max_examples=40, deadline=None)
@given(x=tensors(min_dims=2), fp8=st.sampled_from(FP8))
def test_transpose_cache_is_the_transposed_data(x, fp8):
    q = Float8Tensor.quantize(x, fp8, with_transpose=True)
    assert q.transpose_cache is not None and q.transpose_cache.is_contiguous()
    assert_same_bits(q.transpose_cache, q.fp8_data.transpose(-2, -1))


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_blockwise_scales_each_block_by_its_own_amax(block):
    x = torch.randn(256, 384)
    x[:128, :128] *= 1000  # one loud block must not crush the others
    q = Float8Tensor.quantize(x, scaling=BlockwiseScaling(block))
    rows, cols = block
    assert tuple(q.scale_inv.shape) == (256 // rows, 384 // cols)
    amax = x.abs().reshape(256 // rows, rows, 384 // cols, cols).amax(dim=(1, 3))
    assert_same_bits(q.scale_inv, 1 / scale_from_amax(amax, E4M3))
    assert sqnr_db(x[128:, 128:], q.dequantize()[128:, 128:]) >= SQNR_DB["cast"]


def test_rowwise_scale_layout():
    x = torch.randn(2, 5, 64)
    q = Float8Tensor.quantize(x, scaling=RowwiseScaling())
    assert tuple(q.scale_inv.shape) == (2, 5, 1)
    assert_same_bits(q.scale_inv, 1 / scale_from_amax(x.abs().amax(-1, keepdim=True), E4M3))
