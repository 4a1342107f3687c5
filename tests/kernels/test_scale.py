"""The scale the kernels compute on the device (common.scale_from_amax) against reference.scale_from_amax.

Without power_of_2: bit for bit, for every float32 amax we try. With power_of_2 the kernels clear the mantissa
(an exact round-down); the reference's exp2(floor(log2(s))) agrees except where float32 log2 rounds up to an
integer (s a few ulp below 2**k, |k| >= 15) and at s = FLT_MAX (log2 -> 128.0, exp2 -> inf, a scale the
reference itself promises never to return). test_power_of_2_reference_divergence pins those cases.
"""

import pytest
import torch

from float8.kernels.reference import scale_from_amax

from .helpers import FP8, amax_samples, assert_bits, device_scale, exact_pow2_floor, needs_interpreter

pytestmark = needs_interpreter


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("margin", [0, 1, 5, 32])
def test_scale_matches_reference(fp8_dtype, margin):
    amax = amax_samples()
    assert_bits(device_scale(amax, fp8_dtype, margin), scale_from_amax(amax, fp8_dtype, margin), "scale")


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("margin", [0, 3, 32])
def test_scale_power_of_2(fp8_dtype, margin):
    amax = amax_samples()
    ours = device_scale(amax, fp8_dtype, margin, power_of_2=True)
    plain = scale_from_amax(amax, fp8_dtype, margin)
    assert_bits(ours, exact_pow2_floor(plain), "scale (power of 2) vs exact round-down")
    ref = scale_from_amax(amax, fp8_dtype, margin, power_of_2=True)
    agree = torch.isfinite(ref) & (ref <= plain)  # where the reference rounded down, as it means to
    assert agree.float().mean() > 0.95
    assert_bits(ours[agree], ref[agree], "scale (power of 2) vs reference")


def test_power_of_2_reference_divergence():
    f32max = torch.finfo(torch.float32).max
    s = torch.tensor([2.0**20 * (2 - 2**-23)])  # log2 in float32 is 21.0: the reference returns 2**21 > s
    amax = (1.0 / s) * 448.0  # not exact; only the scale it produces matters
    plain = scale_from_amax(amax, torch.float8_e4m3fn)
    ref = scale_from_amax(amax, torch.float8_e4m3fn, power_of_2=True)
    ours = device_scale(amax, torch.float8_e4m3fn, power_of_2=True)
    assert ours.item() <= plain.item() and ours.item() * 2 > plain.item()  # the power of two just below
    if ref.item() > plain.item():
        assert ours.item() * 2 == ref.item()  # the reference rounded up instead
    tiny = torch.tensor([1e-37])  # scale clamps to FLT_MAX
    assert scale_from_amax(tiny, torch.float8_e4m3fn).item() == f32max
    assert device_scale(tiny, torch.float8_e4m3fn, power_of_2=True).item() == 2.0**127
