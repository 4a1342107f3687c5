"""The SwiGLU backward of two separate tensors, one pass: (dg, du) of y = silu(g) * u from dy, g and u.

A Llama MLP with separate gate and up projections (Hugging Face's Llama, torchtitan) computes
`F.silu(gate(x)) * up(x)`. Eager torch saves g, silu(g) and u and runs three backward passes (the product's
two gradients, then silu's): reads of dy twice, u, silu(g), the intermediate gradient and g, writes of three
gradients. This kernel reads dy, g and u once and writes dg and du: 5 tensor passes instead of 9, and
silu(g) need not be kept (ops/swiglu_fusion.py).

The math is kernels/activation_bwd_kernel.py's SwiGLU, op for op (`_silu_dsilu` of
kernels/activation_math.py, float32, one rounding per gradient element): dg = (dy * u) * silu'(g),
du = dy * silu(g). So `swiglu_pair_bwd(dy, g, u)` gives the bits of `act_bwd(dy, cat([g, u], -1),
"swiglu")` split in two, which the tests check.

`swiglu_pair_bwd(dy, g, u, with_amax=False) -> (dg, du[, max|dg|, max|du|])`: three tensors of one shape and
one float dtype (float32, bfloat16, float16); dg, du contiguous in that dtype. with_amax: the maxima of the
values written, folded in by the same pass (the Linears' FP8 casts of dg and du then skip their amax passes,
one read of each fewer: ops/known_amax.py). `swiglu_pair_bwd_ref`: the same formulas in torch (float32), which
the CPU and every non-CUDA tensor take.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activation_math import _silu_dsilu
from .activation_ref import _silu_dsilu_ref
from .common import abs_bits, atomic_amax, cdiv, use_triton
from .launch import FastLauncher
from .reference import amax_ref

BLOCK = 2048  # elements per program
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _swiglu_pair_bwd_kernel(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, amax_ptr, n, BLOCK: tl.constexpr, WITH_AMAX: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    silu_g, dsilu_g = _silu_dsilu(g)
    dg = ((dy * u) * dsilu_g).to(dg_ptr.dtype.element_ty)
    du = (dy * silu_g).to(du_ptr.dtype.element_ty)
    tl.store(dg_ptr + offs, dg, mask=mask)
    tl.store(du_ptr + offs, du, mask=mask)
    if WITH_AMAX:  # max|dg| and max|du| of the rounded values (masked lanes hold 0): amax_ptr[0], amax_ptr[1]
        atomic_amax(amax_ptr, tl.max(abs_bits(dg), axis=0))
        atomic_amax(amax_ptr + 1, tl.max(abs_bits(du), axis=0))


_launch = FastLauncher(_swiglu_pair_bwd_kernel)


def _check(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> None:
    if not (dy.shape == g.shape == u.shape):
        raise ValueError(
            f"swiglu_pair_bwd: dy, g and u need one shape, got {tuple(dy.shape)}, {tuple(g.shape)}, {tuple(u.shape)}"
        )
    if not (dy.dtype == g.dtype == u.dtype) or g.dtype not in _DTYPES:
        raise ValueError(
            f"swiglu_pair_bwd: dy, g and u need one dtype of {_DTYPES}, got {dy.dtype}, {g.dtype}, {u.dtype}"
        )


def swiglu_pair_bwd_ref(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor, with_amax: bool = False) -> tuple:
    """(dg, du) of silu(g) * u, in float32 rounded once to g's dtype: the kernel's formulas in torch; with_amax:
    (dg, du, max|dg|, max|du|), the maxima () float32."""
    _check(dy, g, u)
    dy32, g32, u32 = dy.float(), g.float(), u.float()
    silu_g, dsilu_g = _silu_dsilu_ref(g32)
    dg, du = ((dy32 * u32) * dsilu_g).to(g.dtype), (dy32 * silu_g).to(g.dtype)
    return (dg, du, amax_ref(dg), amax_ref(du)) if with_amax else (dg, du)


def takes_kernel(g: torch.Tensor) -> bool:
    """Whether swiglu_pair_bwd runs the kernel for g: a CUDA tensor (the others take the reference)."""
    return use_triton(g, writes_fp8=False)


def swiglu_pair_bwd(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor, with_amax: bool = False) -> tuple:
    """(dg, du) of y = silu(g) * u, and with_amax their maxima (max|dg|, max|du|: () float32, for the FP8
    casts that read dg and du next, ops/known_amax.py): one kernel on CUDA, swiglu_pair_bwd_ref elsewhere."""
    if not takes_kernel(g):
        return swiglu_pair_bwd_ref(dy, g, u, with_amax)
    return swiglu_pair_bwd_triton(dy, g, u, with_amax)


def swiglu_pair_bwd_triton(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor, with_amax: bool = False) -> tuple:
    """The kernel's outputs (on CPU tensors under TRITON_INTERPRET=1); non-contiguous inputs are copied."""
    _check(dy, g, u)
    dy, g, u = dy.contiguous(), g.contiguous(), u.contiguous()
    dg = torch.empty_like(g, memory_format=torch.contiguous_format)
    du = torch.empty_like(dg)
    amax = torch.zeros((2,), dtype=torch.float32, device=g.device) if with_amax else dg  # dg: unused pointer
    n = g.numel()
    if n:
        _launch((cdiv(n, BLOCK),), dy, g, u, dg, du, amax, n, BLOCK=BLOCK, WITH_AMAX=with_amax, num_warps=8)
    return (dg, du, amax[0], amax[1]) if with_amax else (dg, du)
