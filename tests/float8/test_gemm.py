"""FP8 GEMM between Float8Tensors: mm, addmm, @, matmul, F.linear, against the dequantized product."""

import pytest
import torch
import torch.nn.functional as F

from float8 import BlockwiseScaling, Float8FallbackWarning, Float8Tensor, RowwiseScaling
from tests.tolerances import SQNR_DB, sqnr_db

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def exact_product(a: Float8Tensor, b: Float8Tensor) -> torch.Tensor:
    """The FP8 GEMM's exact value: products of FP8 values, scaled, summed in float64."""
    return a.dequantize(torch.float32).double() @ b.dequantize(torch.float32).double()


def assert_gemm(out, a, b, dtype):
    assert type(out) is torch.Tensor and out.dtype == dtype
    ref = exact_product(a, b)
    # float32 accumulation, then rounding to the output dtype: relative error within that dtype's eps.
    eps = torch.finfo(dtype).eps
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err <= 4 * eps, err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, RowwiseScaling()], ids=["tensorwise", "rowwise"])
def test_mm_and_operator(dtype, scaling):
    x, w = torch.randn(40, 64, dtype=dtype), torch.randn(32, 64, dtype=dtype)
    a = Float8Tensor.quantize(x, scaling=scaling)
    wq = Float8Tensor.quantize(w, scaling=scaling)
    out = torch.mm(a, wq.t())
    assert_gemm(out, a, wq.t(), dtype)
    assert_gemm(a @ wq.t(), a, wq.t(), dtype)
    assert sqnr_db(x.double() @ w.double().t(), out) >= SQNR_DB["linear"]


def test_linear_matmul_addmm_on_nd_inputs():
    x, w, bias = torch.randn(2, 5, 64), torch.randn(48, 64), torch.randn(48)
    a, wq = Float8Tensor.quantize(x), Float8Tensor.quantize(w)
    out = F.linear(a, wq, bias)
    assert out.shape == (2, 5, 48)
    ref = (exact_product(a.reshape(10, 64), wq.t()) + bias.double()).reshape(2, 5, 48)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    out2 = torch.matmul(a, wq.t())
    assert (out2.double() - ref + bias.double()).abs().max() <= 1e-5 * ref.abs().max()
    out3 = torch.addmm(bias, a.reshape(10, 64), wq.t(), beta=0.5, alpha=2.0)
    ref3 = 2 * exact_product(a.reshape(10, 64), wq.t()) + 0.5 * bias.double()
    assert (out3.double() - ref3).abs().max() <= 1e-5 * ref3.abs().max()


def test_gemm_uses_the_cached_transpose_for_the_backward_layouts():
    # dgrad: dy @ W needs W column-major: the weight's cached transpose provides it without a copy.
    dy = Float8Tensor.quantize(torch.randn(16, 32), E5M2, with_transpose=True)
    w = Float8Tensor.quantize(torch.randn(32, 48), with_transpose=True)
    assert_gemm(dy @ w, dy, w, torch.float32)
    # wgrad: dy.t() @ x needs dy.t() row-major: the cache of dy again.
    x = Float8Tensor.quantize(torch.randn(16, 48), with_transpose=True)
    assert dy.t().fp8_data.is_contiguous()
    assert_gemm(dy.t() @ x, dy.t(), x, torch.float32)


def test_gemm_check_can_fail():
    a, b = Float8Tensor.quantize(torch.randn(16, 32)), Float8Tensor.quantize(torch.randn(32, 16))
    with pytest.raises(AssertionError):
        assert_gemm((a @ b) * 1.01, a, b, torch.float32)


def test_gemm_rejects_what_cublas_cannot_take():
    a = Float8Tensor.quantize(torch.randn(16, 24))
    b = Float8Tensor.quantize(torch.randn(24, 16))
    with pytest.raises(ValueError, match="multiples of 16"):
        a @ b
    c = Float8Tensor.quantize(torch.randn(16, 32), E5M2)
    d = Float8Tensor.quantize(torch.randn(32, 16), E5M2)
    with pytest.raises(ValueError, match="E5M2"):
        c @ d
    e = Float8Tensor.quantize(torch.randn(16, 32))
    with pytest.raises(ValueError, match="do not chain"):
        e @ e


def test_block_scaled_gemm_falls_back_with_a_warning():
    a = Float8Tensor.quantize(torch.randn(128, 128), scaling=BlockwiseScaling((1, 128)))
    b = Float8Tensor.quantize(torch.randn(128, 128), scaling=BlockwiseScaling((128, 128)))
    with pytest.warns(Float8FallbackWarning, match="aten.mm"):
        out = a @ b.t()
    ref = a.dequantize() @ b.dequantize().t()
    assert torch.allclose(out, ref)


def test_mixed_fp8_and_plain_runs_in_high_precision_on_the_dequantized_operand():
    # What the backward of an FP8 GEMM between tensors that require grad computes (grad @ b8.t()): native,
    # no fallback warning (the suite turns Float8FallbackWarning into an error).
    a = Float8Tensor.quantize(torch.randn(16, 32))
    p = torch.randn(32, 16)
    out = a @ p
    assert type(out) is torch.Tensor
    assert torch.equal(out, a.dequantize() @ p)
    bias = torch.randn(16)
    assert torch.equal(torch.addmm(bias, p.t(), a.t()), torch.addmm(bias, p.t(), a.dequantize().t()))


@pytest.mark.gpu
def test_gpu_scale_view_at_any_offset():
    # A per-tensor scale-inverse that is one element of a shared buffer (4 bytes past an aligned address)
    # must give the GEMM of its own copy: cuBLASLt refuses unaligned scale pointers.
    a = Float8Tensor.quantize(torch.randn(64, 128, device="cuda", dtype=torch.bfloat16))
    b = Float8Tensor.quantize(torch.randn(32, 128, device="cuda", dtype=torch.bfloat16))
    shared = torch.stack([a.scale_inv, a.scale_inv])
    a_view = Float8Tensor(a.fp8_data, shared[1], torch.bfloat16)
    assert a_view.scale_inv.storage_offset() == 1
    assert torch.equal(a_view @ b.t(), a @ b.t())
