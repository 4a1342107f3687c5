"""Per-tensor current-scaling FP8 quantization of many tensors in two launches, not two or three each; and
their amaxes alone in one (amax_multi).

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
- _multi_cast_flat_kernel (no transpose, every input 16-byte aligned): each program casts CAST_BLOCK
  consecutive elements of one tensor with the scale of common.scale_from_amax(amaxes[t]);
- _multi_cast_kernel (otherwise): the same on one (BLOCK_M, BLOCK_K) tile, and its transpose.
Each tensor's first program of the cast writes scale_invs[t]. The amax and the flat cast read aligned
tensors with 16-byte vector loads (`_aligned_pointer`); the table goes to the GPU without a stream sync
(`device_table`). Both launchers run on their tensors' device, whichever device is current.
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
from .launch import on_device_of
from .reference import amax_ref, quantize_tensorwise_ref

AMAX_BLOCK = 8192  # elements per program of the amax pass (as kernels/amax.py)
BLOCK_M, BLOCK_K = 64, 128  # the tile of kernels/cast_transpose.py
CAST_BLOCK = 4096  # elements per program of the cast without a transpose
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
def _aligned_pointer(table_ptr, t, DTYPE: tl.constexpr):
    """The pointer table_ptr[t] as a DTYPE pointer that the compiler knows to be 16-byte aligned (the
    launchers check every pointer they promise so), so that loads and stores go 16 bytes at a time. A bare pointer from the
    table has no known alignment: every element was its own load and store in the PTX of the 2-D cast,
    which ran at a third of the copy bandwidth on the H100 (5.4 ms for 1.75G bf16 weights, 2026-11-27)."""
    return tl.multiple_of(tl.load(table_ptr + t).to(tl.pointer_type(DTYPE)), 16)


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
    ALIGNED: tl.constexpr,  # every input 16-byte aligned: vector loads
):
    pid = tl.program_id(0).to(tl.int64)
    t = _owner(starts_ptr, pid, T, STEPS)
    if ALIGNED:
        x_ptr = _aligned_pointer(src_ptrs, t, IN_DTYPE)
    else:
        x_ptr = tl.load(src_ptrs + t).to(tl.pointer_type(IN_DTYPE))
    local = pid - tl.load(starts_ptr + t)
    numel = tl.load(numels_ptr + t)
    offs = local * BLOCK + tl.arange(0, BLOCK)
    if (local + 1) * BLOCK <= numel:
        x = tl.load(x_ptr + offs)  # a whole block: no mask, so the loads can be vectors
    else:
        x = tl.load(x_ptr + offs, mask=offs < numel, other=0.0)
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


@triton.jit
def _multi_cast_flat_kernel(
    src_ptrs,  # (T,) int64: inputs, contiguous, 16-byte aligned
    dst_ptrs,  # (T,) int64: data, contiguous, 16-byte aligned
    numels_ptr,  # (T,) int64
    starts_ptr,  # (T + 1,) int64: first program of each tensor (BLOCK elements each)
    amax_ptr,  # (T,) fp32: max|x| of each tensor
    scale_inv_ptr,  # (T, SCALE_ROW) fp32: column 0 written
    T,
    margin_div,
    IN_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    POWER_OF_2: tl.constexpr,
    STEPS: tl.constexpr,
    SCALE_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The cast without a transpose: each program casts BLOCK consecutive elements of one tensor, unmasked
    (vector loads and stores) except in a tensor's last block."""
    pid = tl.program_id(0).to(tl.int64)
    t = _owner(starts_ptr, pid, T, STEPS)
    local = pid - tl.load(starts_ptr + t)
    numel = tl.load(numels_ptr + t)
    x_ptr = _aligned_pointer(src_ptrs, t, IN_DTYPE)
    data_ptr = _aligned_pointer(dst_ptrs, t, OUT_DTYPE)
    scale = scale_from_amax(tl.load(amax_ptr + t), FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2)
    offs = local * BLOCK + tl.arange(0, BLOCK)
    if (local + 1) * BLOCK <= numel:
        x = tl.load(x_ptr + offs).to(tl.float32)
        tl.store(data_ptr + offs, clamp_keep_nan(x * scale, FP8_MAX).to(OUT_DTYPE))
    else:
        mask = offs < numel
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(data_ptr + offs, clamp_keep_nan(x * scale, FP8_MAX).to(OUT_DTYPE), mask=mask)
    tl.store(
        scale_inv_ptr + SCALE_ROW * t, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=local == 0
    )


def device_table(values: List[int], device: torch.device, op: str) -> torch.Tensor:
    """values as an int64 tensor on `device`, copied without waiting for the GPU.

    A copy from pageable host memory (`torch.tensor(values).to(device)`) synchronizes the stream: the host
    waits until every kernel queued before it has run. After an optimizer step that is the whole step's
    queue, and the next step's first kernels start only once the host has queued them again.
    From pinned memory the copy is queued like a kernel; torch's pinned allocator keeps the host buffer
    until the copy has run. A CUDA graph would capture the copy from a host buffer that is reused after
    the capture, so a capture raises."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64, device=device)  # the interpreter: a CPU table
    if torch.cuda.is_current_stream_capturing():  # the callers made `device` current
        raise RuntimeError(
            f"{op}: not capturable in a CUDA graph (it copies a table of this call's pointers from the host); "
            "call it outside the capture"
        )
    return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


def _check(xs, fp8_dtype, margin, power_of_2, with_transpose) -> None:
    op = "quantize_tensorwise_multi"
    check_scaling_args(fp8_dtype, margin, power_of_2, op)
    check_flag(with_transpose, "with_transpose", op)
    _check_tensors(xs, op, two_d=True)


def _check_tensors(xs, op: str, two_d: bool) -> None:
    """xs: a non-empty list of plain contiguous tensors (2-D where two_d) of one float dtype on one device."""
    if not isinstance(xs, (list, tuple)) or not xs:
        raise ValueError(f"{op}: xs must be a non-empty list of tensors, got {type(xs).__name__}")
    first = xs[0]
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor) or type(x) is not torch.Tensor:
            raise TypeError(f"{op}: xs[{i}] must be a plain torch.Tensor, got {type(x).__name__}")
        if (two_d and x.dim() != 2) or not x.is_contiguous():
            raise ValueError(
                f"{op}: xs[{i}] must be {'2-D and ' if two_d else ''}contiguous, got shape {tuple(x.shape)} "
                f"strides {x.stride()}"
            )
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"{op}: xs[{i}] must be float32, bfloat16 or float16, got {x.dtype}")
        if x.dtype != first.dtype or x.device != first.device:
            raise ValueError(
                f"{op}: every tensor must share xs[0]'s dtype and device ({first.dtype}, {first.device}); "
                f"xs[{i}] is {x.dtype} on {x.device}"
            )


def _launch_amax(programs, src, numels, starts, amaxes, in_dtype, steps: int, aligned: bool) -> None:
    """Fold max|x| of every tensor of the table into amaxes (zeroed), `programs` blocks of AMAX_BLOCK."""
    if programs:
        _multi_amax_kernel[(programs,)](
            src,
            numels,
            starts,
            amaxes,
            amaxes.numel(),
            IN_DTYPE=in_dtype,
            STEPS=steps,
            BLOCK=AMAX_BLOCK,
            ALIGNED=aligned,
            num_warps=8,
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
    # Aligned inputs take the amax's vector loads. Without a transpose, and with the outputs aligned too
    # (torch's caching allocator gives 512-byte blocks; a pluggable one may not), the cast runs on flat
    # blocks of CAST_BLOCK elements with vector loads and stores, else on (BLOCK_M, BLOCK_K) tiles.
    aligned = all(x.data_ptr() % 16 == 0 for x in xs)
    amax_starts, cast_starts, shapes = [0], [0], []
    datas = [torch.empty(x.shape, dtype=fp8_dtype, device=dev) for x in xs]
    flat = aligned and not with_transpose and all(d.data_ptr() % 16 == 0 for d in datas)
    for x in xs:
        M, K = x.shape
        amax_starts.append(amax_starts[-1] + cdiv(x.numel(), AMAX_BLOCK))
        # An empty tensor still gets one program: it writes the scale-inverse.
        tiles = cdiv(x.numel(), CAST_BLOCK) if flat else cdiv(M, BLOCK_M) * cdiv(K, BLOCK_K)
        cast_starts.append(cast_starts[-1] + max(tiles, 1))
        shapes += [M, K]
    if with_transpose:
        datas_t = [torch.empty((x.shape[1], x.shape[0]), dtype=fp8_dtype, device=dev) for x in xs]
    else:
        datas_t = [torch.empty((0,), dtype=fp8_dtype, device=dev) for _ in xs]
    # One host-to-device copy for the whole table: pointers, numels, shapes and both prefix sums.
    table = device_table(
        [x.data_ptr() for x in xs]
        + [d.data_ptr() for d in datas]
        + [d.data_ptr() for d in datas_t]
        + [x.numel() for x in xs]
        + shapes
        + amax_starts
        + cast_starts,
        dev,
        "quantize_tensorwise_multi",
    )
    src, dst, dst_t, numels, shapes_t, a_starts, c_starts = table.split([T, T, T, T, 2 * T, T + 1, T + 1])
    amaxes = torch.zeros(T, dtype=torch.float32, device=dev)
    # One 16-byte row per tensor: cuBLASLt refuses scale pointers that are not 16-byte aligned
    # (CUBLAS_STATUS_NOT_SUPPORTED from _scaled_mm on the H100 when they were 4 bytes apart).
    scale_invs = torch.empty(T, SCALE_ROW, dtype=torch.float32, device=dev)
    in_dtype = _TL_DTYPE[xs[0].dtype]
    _launch_amax(amax_starts[-1], src, numels, a_starts, amaxes, in_dtype, steps, aligned)
    # The arguments both casts take: each tensor's scale from its amax, the scale-inverse in its row.
    common = (amaxes, scale_invs, T, margin_div(margin))
    options = dict(
        IN_DTYPE=in_dtype,
        OUT_DTYPE=_TL_DTYPE[fp8_dtype],
        **fp8_constants(fp8_dtype),
        POWER_OF_2=power_of_2,
        STEPS=steps,
        SCALE_ROW=SCALE_ROW,
        num_warps=8,
    )
    if flat:
        _multi_cast_flat_kernel[(cast_starts[-1],)](src, dst, numels, c_starts, *common, BLOCK=CAST_BLOCK, **options)
    else:
        _multi_cast_kernel[(cast_starts[-1],)](
            src,
            dst,
            dst_t,
            shapes_t,
            c_starts,
            *common,
            WITH_T=with_transpose,
            BLOCK_M=BLOCK_M,
            BLOCK_K=BLOCK_K,
            **options,
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
        # The table, the zeroed amaxes and the kernels on one stream: that of the tensors' device (Triton
        # launches on the current device's, torch's factories queue on the tensors').
        with on_device_of(xs[0]):
            return quantize_tensorwise_multi_triton(xs, fp8_dtype, margin, power_of_2, with_transpose)
    return quantize_tensorwise_multi_ref(xs, fp8_dtype, margin, power_of_2, with_transpose)


def amax_multi_triton(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """max|x| of every contiguous tensor of xs as one (T,) float32 tensor, in one launch of
    _multi_amax_kernel (no checks)."""
    dev = xs[0].device
    T = len(xs)
    steps = max(1, (T - 1).bit_length()) + 1
    starts = [0]
    for x in xs:
        starts.append(starts[-1] + cdiv(x.numel(), AMAX_BLOCK))
    table = device_table([x.data_ptr() for x in xs] + [x.numel() for x in xs] + starts, dev, "amax_multi")
    src, numels, a_starts = table.split([T, T, T + 1])
    amaxes = torch.zeros(T, dtype=torch.float32, device=dev)
    aligned = all(x.data_ptr() % 16 == 0 for x in xs)
    _launch_amax(starts[-1], src, numels, a_starts, amaxes, _TL_DTYPE[xs[0].dtype], steps, aligned)
    return amaxes


def amax_multi_ref(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch.stack of amax_ref(x) for each x: the semantics amax_multi_triton follows."""
    return torch.stack([amax_ref(x) for x in xs])


def amax_multi(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """(T,) float32: max|x| of each tensor of xs (NaN if it holds one, 0 if empty), as kernels/amax.py's
    amax gives for each. xs: contiguous, of one float dtype on one device. On a CUDA GPU one launch for
    all of them (float8/fsdp.py precompute_scales: the masters of every FP8-gathered weight after an
    optimizer step, 32 launches and 32 zero fills before in the 8-block benchmark model)."""
    _check_tensors(xs, "amax_multi", two_d=False)
    if use_triton(xs[0], writes_fp8=False):
        with on_device_of(xs[0]):  # as quantize_tensorwise_multi
            return amax_multi_triton(xs)
    return amax_multi_ref(xs)


__all__ = [
    "amax_multi",
    "amax_multi_ref",
    "amax_multi_triton",
    "device_table",
    "quantize_tensorwise_multi",
    "quantize_tensorwise_multi_ref",
    "quantize_tensorwise_multi_triton",
]
