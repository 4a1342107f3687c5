"""dequantize(data, scale_inv, dtype) -> data.float() * scale_inv (broadcast over its blocks), in dtype.

scale_inv layout (reference.expand_blocks): 0-d = one per tensor; otherwise scale_inv.ndim == data.ndim
and each dim divides: the block along dim d is data.shape[d] // scale_inv.shape[d] long.

The kernel works on the flattened (R, K) view of data (R = prod of the leading dims) with a (SR, SK)
scale grid: element (r, k) takes scale_inv[r // (R // SR), k // (K // SK)]. That covers per-tensor,
per-row, (1, C) and (R, C) blocks, and any layout whose leading dims flatten the same way. A layout that
does not flatten (block > 1 along a leading dim that is followed by a blocked/unit dim, say
scale_inv (2, M, 1) for data (4, M, K)) goes through the reference, on CUDA too.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from .common import cdiv, next_pow2, refuse_redefinition, triton_op, use_triton
from .launch import FastLauncher
from .reference import FP8_DTYPES, HIGH_PRECISION_DTYPES
from .reference import dequantize_ref as _dequantize_ref

# Before any definition: run a second time (another name, a reload), this module redefines nothing.
refuse_redefinition("float8::dequantize", __name__)

TILE = 4096  # elements per program


@triton.jit
def _dequantize_kernel(
    data_ptr,  # (R, K) fp8, contiguous
    scale_inv_ptr,  # (SR, SK) fp32, contiguous; (1, 1) per tensor
    out_ptr,  # (R, K) hp, contiguous
    R,
    K,
    SK,
    row_block,  # R // SR
    col_block,  # K // SK
    PER_TENSOR: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < R) & (cols[None, :] < K)
    offs = rows[:, None] * K + cols[None, :]
    d = tl.load(data_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PER_TENSOR:
        s = tl.load(scale_inv_ptr)
    else:
        s_offs = (rows // row_block)[:, None] * SK + (cols // col_block)[None, :]
        s = tl.load(scale_inv_ptr + s_offs, mask=mask, other=1.0)
    tl.store(out_ptr + offs, (d * s).to(out_ptr.dtype.element_ty), mask=mask)


_launch_dequantize = FastLauncher(_dequantize_kernel)


def flat_row_block(data_shape: Sequence[int], scale_shape: Sequence[int]) -> int | None:
    """Row block of the (R, K) view for a scale layout (leading dims only), or None if it does not flatten.

    Leading dims (all but the last) flatten when they read, left to right: dims with block 1, then at
    most one dim with any block, then dims of scale size 1 (the block spans them whole).
    """
    lead_d, lead_s = tuple(data_shape[:-1]), tuple(scale_shape[:-1])
    i = 0
    while i < len(lead_d) and lead_s[i] == lead_d[i]:
        i += 1
    if i < len(lead_d):
        i += 1  # the one blocked dim
    if any(s != 1 for s in lead_s[i:]):
        return None
    R, SR = math.prod(lead_d), math.prod(lead_s)
    return R // SR if SR else 1


def dequantize_triton(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data * scale_inv (broadcast over its blocks) in dtype, by the Triton kernel (no checks)."""
    per_tensor = scale_inv.numel() == 1
    if per_tensor:
        row_block = 1
    else:
        row_block = flat_row_block(data.shape, scale_inv.shape)
        if row_block is None:
            return dequantize_ref(data, scale_inv, dtype)
    data = data.contiguous()
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    if data.numel() == 0:
        return out
    K = data.shape[-1] if data.dim() else 1
    R = data.numel() // K
    SK = 1 if per_tensor else scale_inv.shape[-1]
    block_k = min(next_pow2(K), TILE)
    rows = max(1, TILE // block_k)
    _launch_dequantize(
        (cdiv(R, rows), cdiv(K, block_k)),
        data,
        scale_inv.contiguous(),
        out,
        R,
        K,
        SK,
        row_block,
        K // SK,
        PER_TENSOR=per_tensor,
        ROWS=rows,
        BLOCK_K=block_k,
        num_warps=8 if rows * block_k >= 4096 else 4,
    )
    return out


def _check(data, scale_inv, dtype):
    if not isinstance(data, torch.Tensor) or data.dtype not in FP8_DTYPES:
        got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise TypeError(f"dequantize: data must be torch.float8_e4m3fn or torch.float8_e5m2, got {got}")
    if not isinstance(scale_inv, torch.Tensor) or scale_inv.dtype != torch.float32:
        got = scale_inv.dtype if isinstance(scale_inv, torch.Tensor) else type(scale_inv).__name__
        raise TypeError(f"dequantize: scale_inv must be float32, got {got}")
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"dequantize: dtype must be float32, bfloat16 or float16, got {dtype}")
    if scale_inv.device != data.device:
        raise ValueError(f"dequantize: scale_inv is on {scale_inv.device} but data is on {data.device}")
    if scale_inv.dim() == 0:
        return
    ok = scale_inv.dim() == data.dim() and all(
        s == n or (s >= 1 and n % s == 0) for n, s in zip(data.shape, scale_inv.shape)
    )
    if not ok:
        raise ValueError(
            f"dequantize: scale_inv of shape {tuple(scale_inv.shape)} does not block data of shape "
            f"{tuple(data.shape)}: it must be 0-d or have data's dims, each dividing data's"
        )


@triton_op("float8::dequantize")
def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data.float() * scale_inv (broadcast over its blocks), cast to dtype; data's shape, contiguous."""
    _check(data, scale_inv, dtype)
    if use_triton(data):
        return dequantize_triton(data, scale_inv, dtype)
    return dequantize_ref(data, scale_inv, dtype)


def dequantize_ref(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data.float() * scale_inv (broadcast over its blocks), in dtype: the semantics of dequantize."""
    return _dequantize_ref(data.contiguous(), scale_inv, dtype)
