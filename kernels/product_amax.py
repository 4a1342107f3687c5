"""a * b and max|a * b| in one pass: the product with its amax, for the FP8 cast that reads the product next.

A Llama MLP with separate gate and up projections computes `F.silu(gate(x)) * up(x)`, and the down projection
quantizes that product at per-tensor current scaling: an amax pass over it, then the cast. At 16384 tokens x
14336 features the product is 448 MiB of bf16, so the amax pass is one read of 448 MiB per block. Here the
product's kernel folds max|p| in as it writes p (ops/swiglu_fusion.py hands it to the down projection through
ops/known_amax.py), so the cast runs alone, with the same scale: the amax of the values written, exactly.

The product's bits are torch's: the product of two tensors of one dtype is their float32 product rounded
once to the dtype (exact in float32 for bfloat16 and float16 operands), which the tests check bit for bit.
The amax is the int32-bits max of kernels/common.py `abs_bits` (NaN propagates), as kernels/amax.py's.

`product_with_amax(a, b) -> (p, amax)`: a, b of one shape and float dtype; p contiguous in that dtype, amax a
() float32 tensor. `product_with_amax_ref`: torch's product and amax, which the CPU takes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import abs_bits, atomic_amax, cdiv, use_triton
from .launch import FastLauncher
from .reference import amax_ref

BLOCK = 4096  # elements per program: one atomic per program
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _product_amax_kernel(a_ptr, b_ptr, p_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = (a * b).to(p_ptr.dtype.element_ty)
    tl.store(p_ptr + offs, p, mask=mask)
    atomic_amax(amax_ptr, tl.max(abs_bits(p), axis=0))  # of the rounded values: the tensor's own amax


_launch = FastLauncher(_product_amax_kernel)


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape or a.dtype != b.dtype or a.dtype not in _DTYPES:
        raise ValueError(
            f"product_with_amax: a and b need one shape and one dtype of {_DTYPES}, got {tuple(a.shape)} "
            f"{a.dtype} and {tuple(b.shape)} {b.dtype}"
        )


def product_with_amax_ref(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * b, max|a * b| as () float32) by torch."""
    _check(a, b)
    p = a * b
    return p, amax_ref(p)


def takes_kernel(a: torch.Tensor) -> bool:
    """Whether product_with_amax runs the kernel for a: a CUDA tensor (the others take the reference)."""
    return use_triton(a, writes_fp8=False)


def product_with_amax(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * b, max|a * b|): one kernel on CUDA, product_with_amax_ref elsewhere."""
    if not takes_kernel(a):
        return product_with_amax_ref(a, b)
    return product_with_amax_triton(a, b)


def product_with_amax_triton(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's (p, amax) (on CPU tensors under TRITON_INTERPRET=1); non-contiguous inputs are copied."""
    _check(a, b)
    a, b = a.contiguous(), b.contiguous()
    p = torch.empty_like(a, memory_format=torch.contiguous_format)
    amax = torch.zeros((), dtype=torch.float32, device=a.device)
    n = a.numel()
    if n:
        _launch((cdiv(n, BLOCK),), a, b, p, amax, n, BLOCK=BLOCK, num_warps=8)
    return p, amax
