"""Checks and scale arithmetic that need no Float8Tensor class: the scale layout enum, input and group
checks, a Float8Tensor's parts and block shapes, storage addresses, and the amax reduction over a process
group. Below float8/tensor.py in the import order."""

from __future__ import annotations

import enum
from typing import Optional, Sequence

import torch

from float8.kernels import amax as amax_kernel
from float8.kernels.reference import FP8_DTYPES, HIGH_PRECISION_DTYPES, max_margin


def _describe_scale(s: torch.Tensor) -> str:
    # Only a CPU scalar is printed by value: reading a CUDA one would sync the host.
    # Not a fake or functional tensor while torch.compile traces (their values are symbols): plain only.
    if s.dim() == 0 and s.device.type == "cpu" and type(s) is torch.Tensor and not torch.compiler.is_compiling():
        return f"{s.item():.6g}"
    return f"shape {tuple(s.shape)}"


def block_shape(data_shape: Sequence[int], scale_shape: Sequence[int]) -> tuple:
    """Block length along each dim of a scale layout; () for one scale per tensor."""
    if len(scale_shape) == 0:
        return ()
    if len(scale_shape) != len(data_shape):
        raise ValueError(
            f"scale_inv must be 0-d or have the data's {len(data_shape)} dims, got shape {tuple(scale_shape)} "
            f"for data {tuple(data_shape)}"
        )
    blocks = []
    for n, s in zip(data_shape, scale_shape):
        if s == 0 or n == 0:
            blocks.append(1)
        elif n % s:
            raise ValueError(f"scale_inv shape {tuple(scale_shape)} does not tile data shape {tuple(data_shape)}")
        else:
            blocks.append(n // s)
    return tuple(blocks)


def storage_address(t: torch.Tensor) -> Optional[int]:
    """The address of t's storage, or None where storages have none: fake and functional tensors while
    torch.compile traces."""
    if torch.compiler.is_compiling():
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # "Cannot access data pointer of Tensor (e.g. FakeTensor, FunctionalTensor)"
        return None


class ScaleLayout(enum.Enum):
    """The GEMM operand layout a quantizer produces.

    TENSOR: one scale; the transposed operand is the same bits (the cached transpose), so every GEMM of
        a Linear runs in FP8 and norms/activations can write it in their own kernels.
    ROW: one scale per row; the transposed operand needs its own quantization along its rows.
    BLOCK: one scale per 1x128 or 128x128 block; GEMMs run on dequantized operands (numerics, not speed).
    OTHER: any other granularity, from a quantizer written outside the library (tests/float8/
        test_new_granularity.py defines one): GEMMs run on dequantized operands, as for BLOCK.
    """

    TENSOR = "tensor"
    ROW = "row"
    BLOCK = "block"
    OTHER = "other"


def dequantized_gemms(layout: ScaleLayout) -> bool:
    """Whether a Linear's GEMMs take this layout's operands dequantized (no FP8 GEMM reads its scales). Plain
    identity tests, which torch.compile traces in every version (an Enum property may not be)."""
    return layout is ScaleLayout.BLOCK or layout is ScaleLayout.OTHER


def check_dense(x: torch.Tensor, what: str) -> None:
    """TypeError naming the problem for a sparse or nested tensor (which would otherwise fail deep inside
    torch, e.g. "NestedTensorImpl doesn't support sizes"): FP8 kernels and GEMMs read dense strided memory."""
    if x.is_nested:
        raise TypeError(
            f"{what} takes a dense tensor, got a nested tensor: pad it (torch.nested.to_padded_tensor) first"
        )
    if x.layout is not torch.strided:
        raise TypeError(f"{what} takes a dense tensor, got layout {x.layout}: call .to_dense() first")


def check_amax_group(group: object) -> Optional[torch.distributed.ProcessGroup]:
    """None, or a torch.distributed process group (the amax reduction group of a per-tensor quantizer)."""
    if group is None:
        return None
    if not torch.distributed.is_available() or not isinstance(group, torch.distributed.ProcessGroup):
        raise TypeError(f"amax_group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return group


def _check_margin_for(fp8_dtype, margin: int) -> None:
    limit = max_margin(fp8_dtype)
    if margin > limit:
        raise ValueError(
            f"margin {margin} is too large for {fp8_dtype}: the scale would be divided by 2**{margin} and "
            f"every value would round to 0; the largest margin for this format is {limit}"
        )


def _poison_if_non_finite(scale_inv: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    # A cast with a given scale saturates +-inf to +-fp8_max; the tensor must still read as non-finite.
    # scale_inv + 0 * amax: scale_inv itself for a finite amax (>= 0), NaN for inf or NaN. One op, where
    # isfinite + full_like + where were three (with an allocation): ~25 us of host time per static-scale
    # quantize on the H100 machine. tests/float8/test_quantizer.py pins the NaN for inf and NaN inputs.
    return torch.add(scale_inv, amax, alpha=0)


def all_reduce_amax(amax: torch.Tensor, group: Optional[torch.distributed.ProcessGroup]) -> torch.Tensor:
    """MAX of `amax` over `group`, in place. A NaN becomes inf first: a MAX reduction may drop a NaN
    (whether it does depends on the rank order), an inf it keeps, and both give a non-finite scale."""
    amax.copy_(torch.where(amax.isnan(), torch.full_like(amax, float("inf")), amax))
    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


def _reduced_amax(x: torch.Tensor, group) -> torch.Tensor:
    return all_reduce_amax(amax_kernel(x), group)


def _check_parts(data, scale_inv, nominal_dtype, transpose) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype not in FP8_DTYPES:
        raise TypeError(
            f"Float8Tensor data must be a torch.float8_e4m3fn/e5m2 tensor, got {getattr(data, 'dtype', data)}"
        )
    if not isinstance(scale_inv, torch.Tensor) or scale_inv.dtype != torch.float32:
        raise TypeError(f"scale_inv must be a float32 tensor, got {getattr(scale_inv, 'dtype', scale_inv)}")
    if nominal_dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"nominal dtype must be float32, bfloat16 or float16, got {nominal_dtype}")
    if scale_inv.device != data.device:
        raise ValueError(f"scale_inv is on {scale_inv.device} but the data is on {data.device}")
    block_shape(data.shape, scale_inv.shape)  # raises if the layout is not a block tiling
    if transpose is not None:
        expected = tuple(data.shape[:-2]) + (data.shape[-1], data.shape[-2]) if data.dim() >= 2 else None
        if expected is None or tuple(transpose.shape) != expected or transpose.dtype != data.dtype:
            raise ValueError(
                f"transpose cache must be {data.dtype} of shape {expected}, got "
                f"{transpose.dtype} {tuple(transpose.shape)}"
            )


def is_whole(t: torch.Tensor) -> bool:
    """Whether t's bits fill their storage: not a part of a larger tensor (whose scale and transpose the
    part would share)."""
    d = t._data
    return d.numel() * d.element_size() == d.untyped_storage().nbytes()
