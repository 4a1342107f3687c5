"""silu(g) and silu(g) * u for h = [g | u], in one pass, with torch's own bits.

A Llama MLP written in plain torch runs `g, u = h.chunk(2, -1); F.silu(g) * u`: two elementwise kernels over
strided halves, which torch runs unvectorized (0.85 and 0.71 ms per block of 16384 tokens x 14336 features
on the H100: benchmarks/results/profile_step_converted_eager.txt). ops/swiglu_fusion.py computes both at
the silu, from h read once, and hands the product out when the model asks for it.

The bits are torch's: its CUDA silu is x / (1 + exp(-x)) in float32 (IEEE division, CUDA's expf, which is
libdevice's) rounded to the dtype, and its product of two tensors of one dtype rounds their float32 product
once. The GPU tests compare every bf16 and fp16 value of g with torch's F.silu and product, bit for bit.

`silu_and_product(h, with_amax=False) -> (s, p[, max|p|])`: h (..., 2F) contiguous, float32, bfloat16 or
float16; s, p (..., F) in h's dtype. with_amax: also max|p| of the values written, a () float32 tensor, folded
in by the same pass, for the down projection's FP8 cast that reads p next (ops/known_amax.py: one read of p
fewer, 448 MiB per block at 16384 tokens x 14336 features). `silu_and_product_ref`: torch's own two calls
(and amax_ref of the product), which the CPU and every non-CUDA tensor take.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .common import abs_bits, atomic_amax, cdiv, use_triton
from .launch import FastLauncher
from .reference import amax_ref

BLOCK = 2048  # columns per program


@triton.jit
def _silu_product_kernel(
    h_ptr, s_ptr, p_ptr, amax_ptr, F, BLOCK: tl.constexpr, CUDA_EXP: tl.constexpr, WITH_AMAX: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(h_ptr + row * 2 * F + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * 2 * F + F + cols, mask=mask, other=0.0).to(tl.float32)
    if CUDA_EXP:
        e = libdevice.exp(-g)  # CUDA's expf, as torch's silu calls it
    else:
        e = tl.exp(-g)  # the interpreter has no libdevice
    s = tl.math.div_rn(g, 1.0 + e).to(s_ptr.dtype.element_ty)
    p = (s.to(tl.float32) * u).to(p_ptr.dtype.element_ty)
    tl.store(s_ptr + row * F + cols, s, mask=mask)
    tl.store(p_ptr + row * F + cols, p, mask=mask)
    if WITH_AMAX:  # of the rounded products (masked lanes hold silu(0) * 0 = 0): the tensor's own amax
        atomic_amax(amax_ptr, tl.max(abs_bits(p), axis=0))


_launch = FastLauncher(_silu_product_kernel)


def silu_and_product_ref(h: torch.Tensor, with_amax: bool = False) -> tuple:
    """(F.silu(g), F.silu(g) * u) for g, u = h.chunk(2, -1), by torch; with_amax: and max|product|."""
    g, u = h.chunk(2, dim=-1)
    s = torch.nn.functional.silu(g)
    p = s * u
    return (s, p, amax_ref(p)) if with_amax else (s, p)


def takes_kernel(h: torch.Tensor) -> bool:
    """Whether silu_and_product(h) runs the kernel: an eager contiguous CUDA tensor of a float dtype, no
    dispatch mode (a mode sees torch's calls)."""
    return (
        use_triton(h, writes_fp8=False)
        and h.is_contiguous()
        and h.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and not torch.compiler.is_compiling()
        and not torch._C._len_torch_dispatch_stack()
    )


def silu_and_product(h: torch.Tensor, with_amax: bool = False) -> tuple:
    """silu_and_product_ref's bits in one kernel on CUDA (h contiguous); elsewhere the reference."""
    if not takes_kernel(h):
        return silu_and_product_ref(h, with_amax)
    return silu_and_product_triton(h, with_amax)


def silu_and_product_triton(h: torch.Tensor, with_amax: bool = False) -> tuple:
    """The kernel's (s, p[, amax]) for a contiguous h of an even last dim (on CPU tensors under
    TRITON_INTERPRET=1)."""
    f = h.shape[-1] // 2
    rows = h.numel() // max(1, h.shape[-1])
    s = torch.empty((*h.shape[:-1], f), dtype=h.dtype, device=h.device)
    p = torch.empty_like(s)
    amax = torch.zeros((), dtype=torch.float32, device=h.device) if with_amax else s  # s: an unused pointer
    if rows and f:
        _launch(
            (rows, cdiv(f, BLOCK)), h, s, p, amax, f, BLOCK=BLOCK, CUDA_EXP=h.is_cuda, WITH_AMAX=with_amax, num_warps=8
        )
    return (s, p, amax) if with_amax else (s, p)
