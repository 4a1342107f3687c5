"""The harness itself: the interpreter's float conversion defect exists, and the fixture fixes it.

If test_unpatched_interpreter_is_wrong starts failing, Triton fixed its interpreter: the fixture in
tests/kernels/conftest.py can go.
"""

import math

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as interp

from .conftest import ORIGINAL_CONVERT_FLOAT, hardware_convert_float
from .helpers import FP8, fp8_grid, needs_interpreter

pytestmark = needs_interpreter


@triton.jit
def _convert_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n).to(y_ptr.dtype.element_ty), mask=offs < n)


def convert(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=dtype)
    _convert_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(max(x.numel(), 1)))
    return y


CASES = torch.tensor([7.93, 500.0, 465.0, float("inf"), float("-inf"), float("nan")])
HARDWARE_E4M3 = [8.0, 448.0, 448.0, 448.0, -448.0, math.nan]  # measured on an H100


def test_unpatched_interpreter_is_wrong(monkeypatch):
    monkeypatch.setattr(interp, "_convert_float", ORIGINAL_CONVERT_FLOAT)
    got = convert(CASES, torch.float8_e4m3fn).float().tolist()
    assert got[0] == 4.0  # lost carry: 7.93 rounds up to 8 = 2**3, the interpreter keeps exponent 2
    assert got[1] == 256.0  # no saturation
    assert math.isnan(got[2])  # 465 -> NaN, not 448
    assert not math.isnan(got[5])  # NaN becomes a number
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert convert(codes.view(torch.float8_e4m3fn), torch.float32)[127].item() == 480.0  # 0x7F is NaN
    assert convert(torch.tensor([1.01171875]), torch.bfloat16).item() == 1.0078125  # truncates (RTNE: 1.015625)


def test_patched_interpreter_matches_hardware():
    got = convert(CASES, torch.float8_e4m3fn).float()
    for g, want in zip(got.tolist(), HARDWARE_E4M3):
        assert (math.isnan(g) and math.isnan(want)) or g == want, (got, HARDWARE_E4M3)
    e5 = convert(torch.tensor([61440.0, 61441.0, float("inf")]), torch.float8_e5m2).float().tolist()
    assert e5 == [57344.0, 57344.0, 57344.0]  # 61440 is the midpoint to 65536 (=inf): RTNE + satfinite


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_patched_conversions_are_exact(fp8_dtype):
    # Every code and midpoint, to FP8 and back, against torch's own conversion of the same values.
    grid = fp8_grid(fp8_dtype)
    limit = torch.finfo(fp8_dtype).max
    want = torch.clamp(grid, -limit, limit).to(fp8_dtype)
    assert torch.equal(convert(grid, fp8_dtype).view(torch.uint8), want.view(torch.uint8))
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype)
    for hp, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16), (torch.float16, torch.int16)):
        assert torch.equal(convert(codes, hp).view(bits), codes.to(hp).view(bits))
    x = torch.tensor([1.01171875, 1e-39, -1e-40, 3.0e38])
    assert torch.equal(convert(x, torch.bfloat16).view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_other_conversions_delegate():
    # int -> float and float64 never reach the replacement's torch path.
    import numpy as np

    a = np.array([1.5, -2.25], dtype=np.float64)
    out = hardware_convert_float(a, tl.float64, tl.float32, None)
    assert out.view(np.float32).tolist() == [1.5, -2.25]
