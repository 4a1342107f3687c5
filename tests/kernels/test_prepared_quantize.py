"""kernels/prepared_quantize.py: a small per-tensor quantization prepared once and launched again by address
gives the bits of quantize_tensorwise on every later call, and declines (None) a call it was not made for."""

import pytest
import torch

from float8.kernels import quantize_tensorwise
from float8.kernels.prepared_quantize import prepare_quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _bits(t):
    return t.view(torch.uint8) if t.dtype in (E4M3, E5M2) else t


def _equal(out, ref, with_transpose):
    data, data_t, scale_inv, amax = out
    assert torch.equal(_bits(data), _bits(ref[0]))
    for a, b in ((scale_inv, ref[2]), (amax, ref[3])):  # bits: a NaN input makes both NaN
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    if with_transpose:
        assert torch.equal(_bits(data_t), _bits(ref[1]))
    else:
        assert data_t is None


@pytest.mark.parametrize("with_transpose", [True, False])
def test_cpu_tensors_are_quantized_the_checked_way_and_not_prepared(with_transpose):
    x = torch.randn(16, 64).to(torch.bfloat16)
    out, prepared = prepare_quantize(x, E4M3, 0, False, with_transpose)
    assert prepared is None
    _equal(out, quantize_tensorwise(x, E4M3, None, 0, False, with_transpose), with_transpose)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("with_transpose", [True, False])
@pytest.mark.parametrize("fp8_dtype,margin,power_of_2", [(E4M3, 0, False), (E5M2, 1, True)])
@pytest.mark.parametrize("shape", [(16, 64), (48, 128), (1, 8), (128, 128)])
def test_prepared_calls_give_the_checked_bits(with_transpose, fp8_dtype, margin, power_of_2, shape):
    x = torch.randn(shape, device="cuda").to(torch.bfloat16)
    out, prepared = prepare_quantize(x, fp8_dtype, margin, power_of_2, with_transpose)
    assert prepared is not None
    _equal(out, quantize_tensorwise(x, fp8_dtype, None, margin, power_of_2, with_transpose), with_transpose)
    for scale in (1.0, 1e-3, 300.0):  # new values each call: nothing of the first call is reused
        y = (torch.randn(shape, device="cuda") * scale).to(torch.bfloat16)
        y[0, 0] = float("nan") if scale == 300.0 else y[0, 0]
        _equal(prepared(y), quantize_tensorwise(y, fp8_dtype, None, margin, power_of_2, with_transpose), with_transpose)


@cuda
@pytest.mark.gpu
def test_prepared_call_declines_what_it_was_not_made_for():
    x = torch.randn(16, 64, device="cuda").to(torch.bfloat16)
    _, prepared = prepare_quantize(x, E4M3, 0, False, True)
    assert prepared(torch.randn(16, 32, device="cuda").to(torch.bfloat16)) is None  # another shape
    assert prepared(x.half()) is None  # another dtype
    assert prepared(torch.randn(64, 16, device="cuda").to(torch.bfloat16).t()) is None  # other strides
    buf = torch.randn(16 * 64 + 1, device="cuda").to(torch.bfloat16)
    assert prepared(buf[1:].view(16, 64)) is None  # off a 16-byte boundary
    assert prepared(x) is not None


@cuda
@pytest.mark.gpu
def test_tensors_too_large_for_one_program_are_not_prepared():
    x = torch.randn(256, 256, device="cuda").to(torch.bfloat16)
    out, prepared = prepare_quantize(x, E4M3, 0, False, True)
    assert prepared is None
    _equal(out, quantize_tensorwise(x, E4M3, None, 0, False, True), True)
