"""kernels/silu_product.py: silu(g) and silu(g) * u of h = [g | u] in one kernel, with torch's bits.

On the GPU: every bf16 and fp16 value of g (and random float32 ones with the special values), against
torch's F.silu and product, bit for bit. On the CPU, under the interpreter (numpy's exp, not CUDA's), the
silu within an ulp or two of torch's and the product exactly the kernel's silu times u rounded once."""

from __future__ import annotations

import pytest
import torch

from float8.kernels.silu_product import silu_and_product, silu_and_product_ref, silu_and_product_triton
from tests.kernels.helpers import assert_bits, needs_interpreter

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_BITS = {2: torch.int16, 4: torch.int32}


def _every_value(dtype, device):
    """h (rows, 2F): g runs through every bit pattern of a 16-bit dtype (random float32 values with
    the special ones otherwise), u random."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    if dtype == torch.float32:
        g = torch.randn(1 << 16, generator=gen) * torch.logspace(-40, 30, 1 << 16, base=2.0)
        g[:8] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 88.8, -88.8, 1e-40])
    else:
        g = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    g = g.reshape(256, 256)
    u = torch.randn(256, 256, generator=gen).to(dtype)
    return torch.cat([g, u], dim=-1).to(device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_torchs_bits_for_every_value(dtype):
    h = _every_value(dtype, "cuda")
    s, p = silu_and_product(h)
    s_ref, p_ref = silu_and_product_ref(h)
    assert_bits(s, s_ref, "silu", nan_bits=False)
    assert_bits(p, p_ref, "product", nan_bits=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_odd_widths_and_leading_dims():
    for shape in [(3, 5, 2 * 2049), (1, 2), (7, 2 * 4096)]:
        h = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        for ours, ref in zip(silu_and_product(h), silu_and_product_ref(h)):
            assert_bits(ours, ref)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_interpreted_kernel_within_an_ulp_and_its_product_exact(dtype):
    h = _every_value(dtype, "cpu")[:64]
    h = torch.cat([h[:, :256:4], h[:, 256::4]], dim=-1).contiguous()  # fewer values: the interpreter is slow
    s, p = silu_and_product_triton(h)
    s_ref, _ = silu_and_product_ref(h)
    finite = torch.isfinite(s_ref)
    assert torch.equal(torch.isnan(s), torch.isnan(s_ref))
    ulps = (s[finite].view(_BITS[s.element_size()]).long() - s_ref[finite].view(_BITS[s.element_size()]).long()).abs()
    # numpy's float32 exp, not CUDA's: measured 2 ulps at most in float32, 1 in the 16-bit dtypes
    assert int(ulps.max()) <= (2 if dtype == torch.float32 else 1)
    u = h[:, h.shape[-1] // 2 :]
    assert_bits(p, (s.float() * u.float()).to(dtype), "product of the kernel's silu", nan_bits=False)


def test_cpu_tensors_take_torchs_own_calls():
    h = torch.randn(4, 6, 2 * 8, dtype=torch.bfloat16)
    for ours, ref in zip(silu_and_product(h), silu_and_product_ref(h)):
        assert torch.equal(ours, ref)
