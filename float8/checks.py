"""Checks and scale arithmetic that need no Float8Tensor class: the scale layout enum, input and group
checks, a Float8Tensor's parts and block shapes, storage addresses, and the amax reduction over a process
group. Below float8/tensor.py in the import order."""

from __future__ import annotations

import enum
import math
import numbers
from typing import Optional, Sequence, Union

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from float8.kernels import amax as amax_kernel
from float8.kernels.reference import FLOAT32_MAX, FP8_DTYPES, HIGH_PRECISION_DTYPES, max_margin, min_scale


def _describe_scale(s: torch.Tensor) -> str:
    # Only a CPU scalar is printed by value: reading a CUDA one would sync the host.
    # Not a fake or functional tensor while torch.compile traces (their values are symbols): plain only.
    if s.dim() == 0 and s.device.type == "cpu" and type(s) is torch.Tensor and not torch.compiler.is_compiling():
        return f"{s.item():.6g}"
    return f"shape {tuple(s.shape)}"


def layout_of_scale(data_shape: Sequence[int], scale_shape: Sequence[int]) -> tuple:
    """(layout, block) that a scale of `scale_shape` for data of `data_shape` stands for, where no quantizer
    says so (a Float8Tensor built from its parts): (TENSOR, None), (ROW, None), (BLOCK, (1, 128)) or
    (BLOCK, (128, 128)). ValueError for scales running along the columns (a transposed per-row tensor) and
    for any other shape."""
    if len(scale_shape) == 0:
        return ScaleLayout.TENSOR, None
    blocks = block_shape(data_shape, scale_shape)
    if scale_shape[-1] == 1 and all(b == 1 for b in blocks[:-1]):
        return ScaleLayout.ROW, None
    if blocks[-1] == 128 and all(b == 1 for b in blocks[:-1]):
        return ScaleLayout.BLOCK, (1, 128)
    if blocks == (128, 128):
        return ScaleLayout.BLOCK, (128, 128)
    shapes = f"scale_inv {tuple(scale_shape)} for data {tuple(data_shape)}"
    if len(data_shape) >= 2 and blocks[-1] == 1 and (len(blocks) < 2 or blocks[-2] > 1):
        raise ValueError(
            f"in-place op on a transposed row-wise or block-scaled Float8Tensor ({shapes}): its scales run along "
            "the columns, and re-quantizing would change its layout. Write the untransposed tensor, or work on "
            "t.dequantize()"
        )
    raise ValueError(f"no quantizer writes a {shapes}")


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


def static_scale(
    scale: Union[torch.Tensor, float], fp8_dtype: torch.dtype, device: Optional[torch.device]
) -> torch.Tensor:
    """A static scale checked (see StaticQuantizer, float8/tensor.py), as the quantizer's own float32 0-d tensor."""
    lo = min_scale(fp8_dtype)
    valid = f"a finite positive float32 value in [{lo:.3g}, {FLOAT32_MAX:.3g}] for {fp8_dtype}"
    if isinstance(scale, torch.Tensor):
        if is_traceable_wrapper_subclass(scale) or scale.numel() != 1:  # e.g. a Float8Tensor
            raise ValueError(f"scale must hold one value (per-tensor scaling), got shape {tuple(scale.shape)}")
        if scale.dtype != torch.float32:
            raise TypeError(f"scale must be float32, got {scale.dtype}")
        s = scale.detach().reshape(())
        if s.device.type == "cpu" and not torch.compiler.is_compiling():
            if not lo <= float(s) <= FLOAT32_MAX:  # NaN fails too
                raise ValueError(f"scale must be {valid}, got {float(s)!r}")
            return s.clone()  # the quantizer's own: a later write into the caller's tensor cannot unvalidate it
        # Not read on the host (a CUDA tensor: no sync; under torch.compile: no guard on its value): an
        # invalid value turns the output NaN, never finite, never silent.
        ok = (s >= lo) & (s <= FLOAT32_MAX)
        return torch.where(ok, s, torch.full_like(s, float("nan")))
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        try:
            value = float(scale)
        except OverflowError:
            value = math.inf
        f32 = torch.tensor(value, dtype=torch.float32)  # 1e-45 -> a subnormal, 1e39 -> inf
        if not (math.isfinite(value) and value > 0 and lo <= float(f32) <= FLOAT32_MAX):
            raise ValueError(f"scale must be {valid}, got {scale!r} (float32: {float(f32)!r})")
        return f32.to(device) if device is not None else f32
    raise TypeError(f"scale must be a float32 tensor or a number, got {type(scale).__name__}")
