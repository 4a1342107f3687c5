"""amax(x) = max|x| as a () float32: NaN if x holds a NaN, 0 for an empty x.

One read of x; each program reduces its block and folds it into the output with one atomic max.
The reduction runs on the int32 bits of |x| (see common.abs_bits): an integer max is a float max that
keeps NaN, which Triton's float max and float atomic_max do not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import abs_bits, atomic_amax, cdiv, check_hp_input, refuse_redefinition, triton_op, use_triton
from .launch import FastLauncher
from .reference import amax_ref as _amax_ref

# Before any definition: run a second time (another name, a reload), this module redefines nothing.
refuse_redefinition("float8::amax", __name__)

BLOCK = 8192  # elements per program: 16 B accesses, few atomics (one per program)
NUM_WARPS = 8


@triton.jit
def _amax_kernel(
    x_ptr,  # (N,) hp, contiguous
    amax_ptr,  # () fp32, zero-initialised; receives max|x|
    n,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    atomic_amax(amax_ptr, tl.max(abs_bits(x), axis=0))


_launch_amax = FastLauncher(_amax_kernel)


def launch_amax(x: torch.Tensor, out: torch.Tensor) -> None:
    """Fold max|x| into `out` (() fp32, zeroed by the caller). x: contiguous."""
    n = x.numel()
    if n:
        _launch_amax((cdiv(n, BLOCK),), x, out, n, BLOCK, num_warps=NUM_WARPS)


def amax_triton(x: torch.Tensor) -> torch.Tensor:
    """max|x| as a () float32 tensor, by the Triton kernel (no checks: `amax` checks)."""
    out = torch.zeros((), dtype=torch.float32, device=x.device)
    launch_amax(x.contiguous(), out)
    return out


@triton_op("float8::amax")
def amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| as a () float32 tensor; NaN if any NaN, 0 if x is empty."""
    check_hp_input(x, "amax")
    if use_triton(x):
        return amax_triton(x)
    return amax_ref(x)


def amax_ref(x: torch.Tensor) -> torch.Tensor:
    """max|x| as a () float32 tensor, in torch: the semantics of `amax`."""
    return _amax_ref(x)
