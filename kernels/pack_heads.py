"""Attention's input gradient, packed back into tokens x features, optionally straight into FP8.

    pack_heads(parts, sequence_first) -> (T, N)                                 high precision, one copy
    pack_heads_fp8(parts, sequence_first, fp8_dtype, scale=None, margin=0, power_of_2=False,
                   with_transpose=True) -> (data (T, N), data_t (N, T) or (0,), scale_inv, amax)

`parts` are head-major tensors (B, H_i, S, D), any strides: SDPA's gradients of q, k and v. The packed
matrix has one row per token and the parts' heads side by side, [part 0 heads | part 1 heads | ...], each
head's D values together: the layout of a QKV Linear's output (ops/attention.py). Rows are (b, s) in
batch-major order, or (s, b) with sequence_first. As torch:
    torch.cat([p.permute(0, 2, 1, 3) for p in parts], dim=2).reshape(B * S, -1)   (batch-first)
    torch.cat([p.permute(2, 0, 1, 3) for p in parts], dim=2).reshape(S * B, -1)   (sequence-first)

Why: the QKV Linear's backward wants that matrix in FP8 (both layouts). Through autograd, SDPA's backward
of the split is a cat and the head transpose a second copy, both in bf16, before the amax and cast passes
read the result again: two full copies (0.54 + 0.34 ms per block of 16384 tokens x 6144 features on the
H100, docs/performance.md). pack_heads_fp8 reads each part in place twice (current scaling: amax,
then cast) and writes only FP8.

scale None: current scaling over all parts together (scale from max|all parts|, margin, power_of_2); a
one-element float32 scale: that scale, with the amax still folded (delayed scaling). Bits equal
quantize_tensorwise_ref of the torch expression above (the cast is per element, given the same scale).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import triton
import triton.language as tl

from .amax import launch_amax

# The cast-transpose tiles: a (64, 128) tile is one head of 128 values for 64 tokens.
from .cast_transpose import CONFIGS
from .common import (
    abs_bits,
    atomic_amax,
    cdiv,
    check_flag,
    check_hp_input,
    check_tensorwise_args,
    clamp_keep_nan,
    custom_op,
    fake_fp8_outputs,
    fp8_constants,
    margin_div,
    refuse_redefinition,
    scale_from_amax,
    use_triton,
)
from .launch import on_device_of
from .reference import quantize_tensorwise_ref

# Before any definition: run a second time (another name, a reload), this module redefines nothing.
refuse_redefinition("float8::pack_heads_fp8", __name__)


@triton.jit
def _pack_heads_kernel(
    src_ptr,  # (O, I, H, D) hp, any strides: one part, token-major (O * I tokens)
    scale_ptr,  # (1,) fp32: the scale (CURRENT=False) ...
    amax_ptr,  # () fp32: ... or the amax to take it from (CURRENT=True); else max|x| is folded in here
    data_ptr,  # (T, N) fp8, contiguous
    data_t_ptr,  # (N, T) fp8, contiguous (WITH_TRANSPOSE)
    scale_inv_ptr,  # () fp32
    T,  # tokens: O * I
    N,  # packed features: the sum of every part's H * D
    col0,  # this part's first packed feature
    I,
    D,
    HD,  # this part's features, H * D
    s_o,
    s_i,
    s_h,
    s_d,
    tiles_k,
    margin_div,  # 2.0**margin (CURRENT only)
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    CURRENT: tl.constexpr,
    POWER_OF_2: tl.constexpr,
    WITH_AMAX: tl.constexpr,
    WITH_TRANSPOSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TRANS_INPUT: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid // tiles_k) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < T) & (cols[None, :] < HD)
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    row_off = (rows64 // I) * s_o + (rows64 % I) * s_i
    col_off = (cols64 // D) * s_h + (cols64 % D) * s_d
    x_in = tl.load(src_ptr + row_off[:, None] + col_off[None, :], mask=mask, other=0.0)
    x = x_in.to(tl.float32)
    if CURRENT:
        scale = scale_from_amax(tl.load(amax_ptr), FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
    else:
        scale = tl.load(scale_ptr)
    y = clamp_keep_nan(x * scale, FP8_MAX).to(data_ptr.dtype.element_ty)
    out_cols = col0 + cols64
    tl.store(data_ptr + rows64[:, None] * N + out_cols[None, :], y, mask=mask)
    if WITH_TRANSPOSE:
        if TRANS_INPUT:
            y_t = clamp_keep_nan(tl.trans(x_in).to(tl.float32) * scale, FP8_MAX).to(data_ptr.dtype.element_ty)
        else:
            y_t = tl.trans(y)
        mask_t = (cols[:, None] < HD) & (rows[None, :] < T)
        tl.store(data_t_ptr + out_cols[:, None] * T + rows64[None, :], y_t, mask=mask_t)
    if WITH_AMAX:
        atomic_amax(amax_ptr, tl.max(tl.max(abs_bits(x), axis=1), axis=0))
    tl.store(scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=pid == 0)


def _token_major(part: torch.Tensor, sequence_first: bool) -> torch.Tensor:
    """(B, H, S, D) -> (B, S, H, D), or (S, B, H, D) with sequence_first: a view, rows = the first two dims."""
    return part.permute(2, 0, 1, 3) if sequence_first else part.permute(0, 2, 1, 3)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t's elements as a contiguous tensor, in memory order: a permuted view when t is dense in some order
    (SDPA's gradients are), else a copy. The amax does not care about the order."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    p = t.permute(order)
    return p if p.is_contiguous() else t.contiguous()


def _check(parts, sequence_first, op: str, plain_only: bool = True) -> None:
    if not isinstance(parts, (list, tuple)) or not parts:
        raise ValueError(f"{op}: parts must be a non-empty list of (B, H, S, D) tensors")
    B, _, S, D = _shape4(parts[0], op)
    for i, p in enumerate(parts):
        check_hp_input(p, op, f"parts[{i}]")
        if plain_only and type(p) not in (torch.Tensor, torch.nn.Parameter):
            # A subclass inside a list is not seen by the op dispatcher: its data pointer is not its values.
            raise TypeError(f"{op}: parts[{i}] is a {type(p).__name__}; pass plain tensors (dequantize first)")
        b, _, s, d = _shape4(p, op)
        if (b, s, d) != (B, S, D) or p.dtype != parts[0].dtype or p.device != parts[0].device:
            raise ValueError(
                f"{op}: every part needs the batch, sequence and head size, dtype and device of parts[0] "
                f"({(B, S, D)}, {parts[0].dtype}, {parts[0].device}); parts[{i}] has {(b, s, d)}, {p.dtype}, {p.device}"
            )
    check_flag(sequence_first, "sequence_first", op)


def _shape4(p, op):
    if not isinstance(p, torch.Tensor) or p.dim() != 4:
        raise ValueError(f"{op}: parts must be 4-D (B, H, S, D) tensors, got {getattr(p, 'shape', type(p).__name__)}")
    return tuple(p.shape)


def pack_heads(parts: List[torch.Tensor], sequence_first: bool = False) -> torch.Tensor:
    """The packed (tokens, features) matrix of head-major parts, in their dtype: one copy per part."""
    _check(parts, sequence_first, "pack_heads")
    views = [_token_major(p, sequence_first) for p in parts]
    O, I = views[0].shape[:2]
    N = sum(v.shape[2] * v.shape[3] for v in views)
    out = torch.empty((O, I, N), dtype=parts[0].dtype, device=parts[0].device)
    col = 0
    for v in views:
        hd = v.shape[2] * v.shape[3]
        out[:, :, col : col + hd].view(v.shape).copy_(v)
        col += hd
    return out.view(O * I, N)


def pack_heads_fp8_triton(
    parts: List[torch.Tensor],
    sequence_first: bool,
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed (tokens, features) matrix of head-major parts, quantized per tensor, by the Triton kernel
    (no checks)."""
    views = [_token_major(p, sequence_first) for p in parts]
    O, I = views[0].shape[:2]
    T, D = O * I, views[0].shape[3]
    N = sum(v.shape[2] * D for v in views)
    dev = parts[0].device
    data = torch.empty((T, N), dtype=fp8_dtype, device=dev)
    data_t = torch.empty((N, T) if with_transpose else (0,), dtype=fp8_dtype, device=dev)
    scale_inv = torch.empty((), dtype=torch.float32, device=dev)
    amax = torch.zeros((), dtype=torch.float32, device=dev)
    current = scale is None
    if current:
        for p in parts:
            launch_amax(_dense(p), amax)
    cfg = CONFIGS[parts[0].element_size()]
    col0 = 0
    for v in views:
        hd = v.shape[2] * D
        tiles_m, tiles_k = max(1, cdiv(T, cfg["BLOCK_M"])), max(1, cdiv(hd, cfg["BLOCK_K"]))
        with on_device_of(data):
            _pack_heads_kernel[(tiles_m * tiles_k,)](  # >= 1 program: program 0 writes scale_inv
                v,
                amax if current else scale,
                amax,
                data,
                data_t,
                scale_inv,
                T,
                N,
                col0,
                I,
                max(D, 1),
                hd,
                *v.stride(),
                tiles_k,
                margin_div(margin),
                **fp8_constants(fp8_dtype),
                CURRENT=current,
                POWER_OF_2=power_of_2,
                WITH_AMAX=not current,
                WITH_TRANSPOSE=with_transpose,
                **cfg,
            )
        col0 += hd
    return data, data_t, scale_inv, amax


def pack_heads_fp8_ref(
    parts: List[torch.Tensor],
    sequence_first: bool,
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_heads, then quantize_tensorwise_ref: the semantics of pack_heads_fp8."""
    return quantize_tensorwise_ref(
        pack_heads(parts, sequence_first), fp8_dtype, scale, margin, power_of_2, with_transpose
    )


@custom_op("float8::pack_heads_fp8")
def pack_heads_fp8(
    parts: List[torch.Tensor],
    sequence_first: bool,
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed (tokens, features) matrix of head-major parts (module docstring), quantized per tensor.

    Returns (data (T, N) fp8, data_t (N, T) fp8 or (0,) without with_transpose, scale_inv () fp32,
    amax () fp32 = max|every part|). scale None: current scaling (margin, power_of_2); else a one-element
    fp32 scale (delayed scaling; margin and power_of_2 ignored)."""
    _check(parts, sequence_first, "pack_heads_fp8")
    check_tensorwise_args(parts[0], fp8_dtype, scale, margin, power_of_2, "pack_heads_fp8")
    check_flag(with_transpose, "with_transpose", "pack_heads_fp8")
    if use_triton(parts[0]):
        return pack_heads_fp8_triton(parts, sequence_first, fp8_dtype, scale, margin, power_of_2, with_transpose)
    return pack_heads_fp8_ref(parts, sequence_first, fp8_dtype, scale, margin, power_of_2, with_transpose)


@pack_heads_fp8.register_fake
def _(parts, sequence_first, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=True):
    _check(parts, sequence_first, "pack_heads_fp8", plain_only=False)  # fake tensors are subclasses
    check_tensorwise_args(parts[0], fp8_dtype, scale, margin, power_of_2, "pack_heads_fp8")
    check_flag(with_transpose, "with_transpose", "pack_heads_fp8")
    B, _, S, D = parts[0].shape
    T, N = B * S, sum(p.shape[1] for p in parts) * D
    return fake_fp8_outputs(parts[0], (T, N), (N, T) if with_transpose else None, fp8_dtype)
