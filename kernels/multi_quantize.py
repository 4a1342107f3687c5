"""Per-tensor current-scaling FP8 quantization of many tensors in two launches, not two or three each.

quantize_tensorwise_multi(xs, fp8_dtype, margin=0, power_of_2=False, with_transpose=False)
    -> (datas, datas_t, scale_invs, amaxes)

For every x in xs (2-D, contiguous, all of one dtype on one device) the same outputs as
quantize_tensorwise(x, fp8_dtype, None, margin, power_of_2, with_transpose) (kernels/quantize.py), bit
for bit: data (M, K), data_t (K, M) contiguous or an empty (0,) tensor, scale_inv and amax as () float32
views into one (T,) tensor each. This is the re-quantize of every FP8 weight after an optimizer step
(ops/requantize.py): a model of 56 Linears takes 2 launches instead of about 170.

The two kernels find their tensor through a table of data pointers (int64) and the first program of each
tensor (a binary search over the prefix sums), then do what the single-tensor kernels do:
- _multi_amax_kernel: each program folds max|x| of one block of one tensor into amaxes[t] (the integer
  max of common.abs_bits, which keeps NaN);
- _multi_cast_kernel: each program casts one (BLOCK_M, BLOCK_K) tile of one tensor with the scale of
  common.scale_from_amax(amaxes[t]) and stores it, and its transpose; each tensor's first tile writes
  scale_invs[t].
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import triton
import triton.language as tl

from .common import (
    abs_bits,
    atomic_amax,
    cdiv,
    check_flag,
    check_scaling_args,
    clamp_keep_nan,
    fp8_constants,
    margin_div,
    scale_from_amax,
    use_triton,
)
from .reference import quantize_tensorwise_ref

AMAX_BLOCK = 8192  # elements per program of the amax pass (as kernels/amax.py)
BLOCK_M, BLOCK_K = 64, 128  # the tile of kernels/cast_transpose.py
SCALE_ROW = 4  # float32s per scale-inverse slot: 16 bytes, the alignment cuBLASLt needs of a scale pointer

_TL_DTYPE = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float8_e4m3fn: tl.float8e4nv,
    torch.float8_e5m2: tl.float8e5,
}


@triton.jit
def _owner(starts_ptr, pid, T, STEPS: tl.constexpr):
    """The t with starts[t] <= pid < starts[t + 1] (starts: (T + 1,) int64 prefix sums of programs)."""
    lo = tl.zeros((), tl.int64)
    hi = tl.zeros((), tl.int64) + T
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        go = tl.load(starts_ptr + mid) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _multi_amax_kernel(
    src_ptrs,  # (T,) int64: data pointers of the inputs (contiguous)
    numels_ptr,  # (T,) int64
    starts_ptr,  # (T + 1,) int64: first program of each tensor
    amax_ptr,  # (T,) fp32, zero-initialised
    T,
    IN_DTYPE: tl.constexpr,
    STEPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    t = _owner(starts_ptr, pid, T, STEPS)
    x_ptr = tl.load(src_ptrs + t).to(tl.pointer_type(IN_DTYPE))
    offs = (pid - tl.load(starts_ptr + t)) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < tl.load(numels_ptr + t), other=0.0)
    atomic_amax(amax_ptr + t, tl.max(abs_bits(x), axis=0))


@triton.jit
def _multi_cast_kernel(
    src_ptrs,  # (T,) int64: inputs (M, K), contiguous
    dst_ptrs,  # (T,) int64: data (M, K) fp8
    dst_t_ptrs,  # (T,) int64: data_t (K, M) fp8 (unused without WITH_T)
    shapes_ptr,  # (T, 2) int64: M, K
    starts_ptr,  # (T + 1,) int64: first program of each tensor
    amax_ptr,  # (T,) fp32: max|x| of each tensor
    scale_inv_ptr,  # (T, SCALE_ROW) fp32: column 0 written
    T,
    margin_div,
    IN_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    POWER_OF_2: tl.constexpr,
    WITH_T: tl.constexpr,
    STEPS: tl.constexpr,
    SCALE_ROW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    t = _owner(starts_ptr, pid, T, STEPS)
    local = pid - tl.load(starts_ptr + t)
    M = tl.load(shapes_ptr + 2 * t)
    K = tl.load(shapes_ptr + 2 * t + 1)
    tiles_k = (K + BLOCK_K - 1) // BLOCK_K
    rows = (local // tiles_k) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (local % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x_ptr = tl.load(src_ptrs + t).to(tl.pointer_type(IN_DTYPE))
    x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = scale_from_amax(tl.load(amax_ptr + t), FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
    y = clamp_keep_nan(x * scale, FP8_MAX).to(OUT_DTYPE)
    data_ptr = tl.load(dst_ptrs + t).to(tl.pointer_type(OUT_DTYPE))
    tl.store(data_ptr + rows[:, None] * K + cols[None, :], y, mask=mask)
    if WITH_T:
        data_t_ptr = tl.load(dst_t_ptrs + t).to(tl.pointer_type(OUT_DTYPE))
        mask_t = (cols[:, None] < K) & (rows[None, :] < M)
        tl.store(data_t_ptr + cols[:, None] * M + rows[None, :], tl.trans(y), mask=mask_t)
    tl.store(
        scale_inv_ptr + SCALE_ROW * t, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=local == 0
    )


def _check(xs, fp8_dtype, margin, power_of_2, with_transpose) -> None:
    op = "quantize_tensorwise_multi"
    check_scaling_args(fp8_dtype, margin, power_of_2, op)
    check_flag(with_transpose, "with_transpose", op)
    if not isinstance(xs, (list, tuple)) or not xs:
        raise ValueError(f"{op}: xs must be a non-empty list of tensors, got {type(xs).__name__}")
    first = xs[0]
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor) or type(x) is not torch.Tensor:
            raise TypeError(f"{op}: xs[{i}] must be a plain torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or not x.is_contiguous():
            raise ValueError(
                f"{op}: xs[{i}] must be 2-D and contiguous, got shape {tuple(x.shape)} strides {x.stride()}"
            )
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{op}: xs[{i}] must be float32, bfloat16 or float16, got {x.dtype}")
        if x.dtype != first.dtype or x.device != first.device:
            raise ValueError(
                f"{op}: every tensor must share xs[0]'s dtype and device ({first.dtype}, {first.device}); "
                f"xs[{i}] is {x.dtype} on {x.device}"
            )


def quantize_tensorwise_multi_triton(
    xs: Sequence[torch.Tensor],
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
    """Current-scaling quantization of several 2-D tensors, each with its own scale, in few launches (no
    checks)."""
    dev = xs[0].device
    T = len(xs)
    steps = max(1, (T - 1).bit_length()) + 1  # halvings of [0, T) down to one tensor
    amax_starts, cast_starts, shapes = [0], [0], []
    for x in xs:
        M, K = x.shape
        amax_starts.append(amax_starts[-1] + cdiv(x.numel(), AMAX_BLOCK))
        cast_starts.append(cast_starts[-1] + (cdiv(M, BLOCK_M) * cdiv(K, BLOCK_K) if x.numel() else 1))
        shapes += [M, K]
    datas = [torch.empty(x.shape, dtype=fp8_dtype, device=dev) for x in xs]
    if with_transpose:
        datas_t = [torch.empty((x.shape[1], x.shape[0]), dtype=fp8_dtype, device=dev) for x in xs]
    else:
        datas_t = [torch.empty((0,), dtype=fp8_dtype, device=dev) for _ in xs]
    # One host-to-device copy for the whole table: pointers, numels, shapes and both prefix sums.
    table = torch.tensor(
        [x.data_ptr() for x in xs]
        + [d.data_ptr() for d in datas]
        + [d.data_ptr() for d in datas_t]
        + [x.numel() for x in xs]
        + shapes
        + amax_starts
        + cast_starts,
        dtype=torch.int64,
    ).to(dev)
    src, dst, dst_t, numels, shapes_t, a_starts, c_starts = table.split([T, T, T, T, 2 * T, T + 1, T + 1])
    amaxes = torch.zeros(T, dtype=torch.float32, device=dev)
    # One 16-byte row per tensor: cuBLASLt refuses scale pointers that are not 16-byte aligned
    # (CUBLAS_STATUS_NOT_SUPPORTED from _scaled_mm on the H100 when they were 4 bytes apart).
    scale_invs = torch.empty(T, SCALE_ROW, dtype=torch.float32, device=dev)
    in_dtype = _TL_DTYPE[xs[0].dtype]
    if amax_starts[-1]:
        _multi_amax_kernel[(amax_starts[-1],)](
            src, numels, a_starts, amaxes, T, IN_DTYPE=in_dtype, STEPS=steps, BLOCK=AMAX_BLOCK, num_warps=8
        )
    _multi_cast_kernel[(cast_starts[-1],)](
        src,
        dst,
        dst_t,
        shapes_t,
        c_starts,
        amaxes,
        scale_invs,
        T,
        margin_div(margin),
        IN_DTYPE=in_dtype,
        OUT_DTYPE=_TL_DTYPE[fp8_dtype],
        **fp8_constants(fp8_dtype),
        POWER_OF_2=power_of_2,
        WITH_T=with_transpose,
        STEPS=steps,
        SCALE_ROW=SCALE_ROW,
        BLOCK_M=BLOCK_M,
        BLOCK_K=BLOCK_K,
        num_warps=8,
    )
    return datas, datas_t, list(scale_invs[:, 0].unbind()), list(amaxes.unbind())


def quantize_tensorwise_multi_ref(
    xs: Sequence[torch.Tensor],
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
    """quantize_tensorwise_ref applied to each tensor (the semantics the Triton launcher follows)."""
    outs = [quantize_tensorwise_ref(x, fp8_dtype, None, margin, power_of_2, with_transpose) for x in xs]
    return tuple(list(col) for col in zip(*outs))


def quantize_tensorwise_multi(
    xs: Sequence[torch.Tensor],
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
    """Current-scaling per-tensor quantization of every tensor of xs: lists (datas, datas_t, scale_invs,
    amaxes), each entry what quantize_tensorwise(x, fp8_dtype, None, margin, power_of_2, with_transpose)
    gives for that x. On a CUDA GPU with FP8 conversions: two launches for all of them."""
    _check(xs, fp8_dtype, margin, power_of_2, with_transpose)
    if use_triton(xs[0]):
        return quantize_tensorwise_multi_triton(xs, fp8_dtype, margin, power_of_2, with_transpose)
    return quantize_tensorwise_multi_ref(xs, fp8_dtype, margin, power_of_2, with_transpose)


__all__ = ["quantize_tensorwise_multi", "quantize_tensorwise_multi_ref", "quantize_tensorwise_multi_triton"]
