"""Float8Tensor: FP8 bits that carry their own scale-inverse.

The contract
------------
- Meaning: ``hp ≈ fp8_data.float() * scale_inv`` (scale_inv broadcast over its blocks), where ``fp8_data``
  holds ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` values of the tensor's logical shape and
  ``scale_inv`` is float32. ``.dtype`` reports the nominal dtype: the high-precision dtype the tensor
  stands for (float32, bfloat16 or float16). ``dequantize()`` returns ``fp8.float() * scale_inv`` cast
  to the nominal dtype.
- Scale layout: ``scale_inv`` is 0-d (one scale for the tensor) or has the data's number of dims, each
  dividing the data's: the block along dim d is ``shape[d] // scale_inv.shape[d]`` long. Per-row scaling
  is ``(..., 1)``; 1x128 blocks ``(..., K/128)``; 128x128 blocks ``(M/128, K/128)``. Views and
  transposes move the scale with the data, so the meaning never changes.
- The scale-inverse belongs to the data: the kernel that writes the FP8 bits writes their scale_inv in
  the same launch. A recipe may pick a different *next* scale at any time; tensors that exist keep
  theirs. Nothing clones scales to protect them.
- Transpose cache: optionally, a contiguous FP8 tensor equal to ``fp8_data.transpose(-2, -1)`` (the
  other memory layout an FP8 GEMM needs in the backward pass). It exists only when something will read
  it: ``quantize(..., with_transpose=True)`` with grad mode on. Under ``torch.no_grad()`` or
  ``torch.inference_mode()`` no transpose is ever allocated. Each op keeps, derives or drops it through
  one helper, `float8.native_ops.transpose_cache_after`.
- Ops: `float8/native_ops.py` and `float8/gemm.py` implement views, transposes, copies, cat/split and
  FP8 GEMMs natively; every other op goes to the one fallback of `float8/dispatch.py` (high precision,
  a warning naming the op; in-place ops re-quantize and keep the type). A view that the scale layout
  cannot follow raises (a view must alias, never copy), and so does an in-place write into part of a
  tensor, which shares its scale and transpose with the rest.
- ``.to(dtype)`` with a high-precision dtype changes the nominal dtype and keeps the FP8 bits (no
  memory blow-up when a model holding FP8 weights is cast); ``.dequantize()`` gives a plain tensor.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from float8 import dispatch
from float8.kernels import (
    cast,
    dequantize as dequantize_kernel,
    quantize_blockwise,
    quantize_rowwise,
    quantize_tensorwise,
    quantize_transpose_tensorwise,
    cast_transpose,
)
from float8.kernels.reference import FP8_DTYPES, HIGH_PRECISION_DTYPES, check_fp8_dtype
from float8.recipe import (
    BlockwiseScaling,
    DelayedScaling,
    DelayedScalingState,
    RowwiseScaling,
    TensorwiseScaling,
)

Float8FallbackWarning = dispatch.Float8FallbackWarning


def _transpose_wanted(with_transpose: bool, x: torch.Tensor) -> bool:
    # No backward pass can read a transpose made under no_grad / inference_mode: never allocate one there.
    return bool(with_transpose) and torch.is_grad_enabled() and x.dim() >= 2


def _check_quantize_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"Float8Tensor.quantize needs a torch.Tensor, got {type(x).__name__}")
    if isinstance(x, Float8Tensor):
        raise TypeError(
            "Float8Tensor.quantize got a Float8Tensor; it is already FP8. Use .dequantize() first to "
            "re-quantize with another scaling."
        )
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"Float8Tensor.quantize needs a float32, bfloat16 or float16 tensor, got {x.dtype}"
        )


def _scale_tensor(scale, device) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must hold one value (per-tensor scaling), got shape {tuple(scale.shape)}")
        if scale.dtype != torch.float32:
            raise TypeError(f"scale must be float32, got {scale.dtype}")
        if scale.device != device:
            raise ValueError(f"scale is on {scale.device} but the input is on {device}")
        return scale.reshape(())
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        if not (scale > 0 and scale != float("inf")):
            raise ValueError(f"scale must be a finite positive number, got {scale!r}")
        return torch.tensor(float(scale), dtype=torch.float32, device=device)
    raise TypeError(f"scale must be a float32 tensor or a number, got {type(scale).__name__}")


class Float8Tensor(torch.Tensor):
    """FP8 data + float32 scale-inverse (+ optional FP8 transpose), posing as a tensor of `dtype`."""

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _transpose: Optional[torch.Tensor]

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        nominal_dtype: torch.dtype,
        transpose: Optional[torch.Tensor] = None,
        requires_grad: bool = False,
    ):
        _check_parts(data, scale_inv, nominal_dtype, transpose)
        if torch.is_inference_mode_enabled() and not data.is_inference():
            # Under inference_mode, a view of a normal tensor must itself be a normal tensor (autograd
            # shares the base's version counter with it). Only entered when needed: entering and leaving
            # it was the largest item in a cProfile of a tiny Linear step on the GPU machine.
            with torch.inference_mode(False):
                self = cls._wrapper(data, nominal_dtype, requires_grad)
        else:
            self = cls._wrapper(data, nominal_dtype, requires_grad)
        self._data = data
        self._scale_inv = scale_inv
        self._transpose = transpose
        return self

    @classmethod
    def _wrapper(cls, data, nominal_dtype, requires_grad):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=nominal_dtype, device=data.device, requires_grad=requires_grad
        )

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def quantize(
        cls,
        x: torch.Tensor,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        *,
        scale: Union[torch.Tensor, float, None] = None,
        scaling=None,
        with_transpose: bool = False,
    ) -> "Float8Tensor":
        """Quantize a float32/bfloat16/float16 tensor to FP8.

        scale: an explicit per-tensor float32 scale (static scaling); the cast kernel writes scale_inv.
        scaling: TensorwiseScaling() (default: current per-tensor scaling), RowwiseScaling(),
            BlockwiseScaling(block), or a DelayedScalingState (whose history is updated on the device).
        with_transpose: also write the transposed FP8 layout in the same kernel, for a backward pass.
            Ignored under no_grad/inference_mode, where no backward pass can read it.
        """
        return cls._quantize(x, fp8_dtype, scale, scaling, _transpose_wanted(with_transpose, x))

    @classmethod
    def _quantize(cls, x, fp8_dtype=torch.float8_e4m3fn, scale=None, scaling=None, with_transpose=False):
        """`quantize` without the grad-mode rule for the transpose: for callers that know a backward pass
        will read it (ops run their forward inside an autograd Function, where grad mode is off)."""
        _check_quantize_input(x)
        check_fp8_dtype(fp8_dtype)
        want_t = bool(with_transpose) and x.dim() >= 2
        transpose = None
        if scale is not None:
            if scaling is not None:
                raise ValueError("pass either scale= (static scaling) or scaling=, not both")
            s = _scale_tensor(scale, x.device)
            if want_t:
                data, transpose, scale_inv, _ = cast_transpose(x, s, fp8_dtype)
            else:
                data, scale_inv, _ = cast(x, s, fp8_dtype)
        else:
            data, scale_inv, transpose = _quantize_with(x, fp8_dtype, scaling or TensorwiseScaling(), want_t)
        return cls(data, scale_inv, x.dtype, transpose)

    # ---- the public face ----------------------------------------------------------------------
    @property
    def fp8_data(self) -> torch.Tensor:
        """The FP8 bits (torch.float8_*), logical shape."""
        return self._data

    @property
    def scale_inv(self) -> torch.Tensor:
        """float32 scale-inverse: 0-d, or one value per block (see the module docstring)."""
        return self._scale_inv

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self._data.dtype

    @property
    def transpose_cache(self) -> Optional[torch.Tensor]:
        """The cached FP8 transpose (contiguous, (..., K, M)), or None."""
        return self._transpose

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"dequantize returns float32, bfloat16 or float16, not {dtype}")
        return dequantize_kernel(self._data, self._scale_inv, dtype)

    def __repr__(self, *, tensor_contents=None) -> str:
        t = "" if self._transpose is None else ", with transpose"
        return (
            f"Float8Tensor(shape={tuple(self.shape)}, fp8_dtype={self.fp8_dtype}, nominal_dtype={self.dtype}, "
            f"scale_inv={_describe_scale(self._scale_inv)}, device={self.device}{t})"
        )

    # ---- dispatch ----------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = dispatch.lookup(func)
        if handler is not None:
            return handler(func, args, kwargs)
        return dispatch.fallback(func, args, kwargs, _is_float8, requantize_into)

    # ---- torch.compile / FSDP / serialization -------------------------------------------------
    def __tensor_flatten__(self):
        inner = ["_data", "_scale_inv"]
        if self._transpose is not None:
            inner.append("_transpose")
        return inner, (self.dtype,)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        (nominal_dtype,) = ctx
        return Float8Tensor(
            inner_tensors["_data"], inner_tensors["_scale_inv"], nominal_dtype, inner_tensors.get("_transpose")
        )

    def __reduce_ex__(self, protocol):
        # The FP8 bits travel as uint8: plain pickle of a float8 tensor fails in torch 2.13
        # ("UntypedStorage has no attribute dtype"); torch.save is fine either way.
        t = None if self._transpose is None else self._transpose.view(torch.uint8)
        return (
            _rebuild_float8_tensor,
            (self._data.view(torch.uint8), self.fp8_dtype, self._scale_inv, self.dtype, t, self.requires_grad),
        )


def _rebuild_float8_tensor(bits, fp8_dtype, scale_inv, nominal_dtype, transpose_bits, requires_grad):
    check_fp8_dtype(fp8_dtype)
    t = None if transpose_bits is None else transpose_bits.view(fp8_dtype)
    return Float8Tensor(bits.view(fp8_dtype), scale_inv, nominal_dtype, t, requires_grad)


# torch.load(weights_only=True) refuses unknown callables; this one only builds from tensors and dtypes.
torch.serialization.add_safe_globals([_rebuild_float8_tensor, Float8Tensor])


def _is_float8(t) -> bool:
    return isinstance(t, Float8Tensor)


def _describe_scale(s: torch.Tensor) -> str:
    # Only a CPU scalar is printed by value: reading a CUDA one would sync the host.
    if s.dim() == 0 and s.device.type == "cpu" and not torch.compiler.is_compiling():
        return f"{s.item():.6g}"
    return f"shape {tuple(s.shape)}"


def _check_parts(data, scale_inv, nominal_dtype, transpose) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype not in FP8_DTYPES:
        raise TypeError(f"Float8Tensor data must be a torch.float8_e4m3fn/e5m2 tensor, got {getattr(data, 'dtype', data)}")
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


def block_shape(data_shape, scale_shape) -> tuple:
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


def scaling_of(t: Float8Tensor):
    """The granularity a Float8Tensor was quantized with, read off its scale layout."""
    s, shape = t._scale_inv, t._data.shape
    if s.dim() == 0:
        return TensorwiseScaling()
    blocks = block_shape(shape, s.shape)
    if all(b == 1 for b in blocks[:-1]) and s.shape[-1] == 1:
        return RowwiseScaling()
    if blocks[-1] == 128 and all(b == 1 for b in blocks[:-1]):
        return BlockwiseScaling((1, 128))
    if len(blocks) == 2 and blocks == (128, 128):
        return BlockwiseScaling((128, 128))
    raise ValueError(f"no scaling recipe matches a scale_inv of shape {tuple(s.shape)} for data {tuple(shape)}")


def _quantize_with(x, fp8_dtype, scaling, want_t):
    """(data, scale_inv, transpose or None) for one of the scaling recipes."""
    if isinstance(scaling, TensorwiseScaling):
        if want_t:
            data, t, scale_inv, _ = quantize_transpose_tensorwise(x, fp8_dtype, scaling.margin, scaling.power_of_2)
            return data, scale_inv, t
        data, scale_inv, _ = quantize_tensorwise(x, fp8_dtype, scaling.margin, scaling.power_of_2)
        return data, scale_inv, None
    if isinstance(scaling, DelayedScalingState):
        if scaling.scale.device != x.device:
            raise ValueError(f"DelayedScalingState lives on {scaling.scale.device} but the input is on {x.device}")
        if want_t:
            data, t, scale_inv, amax = cast_transpose(x, scaling.scale, fp8_dtype)
            scaling.update(amax, fp8_dtype)
            return data, scale_inv, t
        data, scale_inv = scaling.cast(x, fp8_dtype)
        return data, scale_inv, None
    if isinstance(scaling, RowwiseScaling):
        data, scale_inv = quantize_rowwise(x, fp8_dtype, scaling.margin, scaling.power_of_2)
    elif isinstance(scaling, BlockwiseScaling):
        rows, cols = scaling.block
        data, scale_inv = quantize_blockwise(x, rows, cols, fp8_dtype, scaling.margin, scaling.power_of_2)
    elif isinstance(scaling, DelayedScaling):
        raise TypeError(
            "DelayedScaling is a recipe without state; quantize with scaling=DelayedScalingState(recipe), "
            "which keeps the amax history"
        )
    else:
        raise TypeError(f"scaling must be a float8 scaling recipe or DelayedScalingState, got {type(scaling).__name__}")
    # Per-row and block layouts have no fused transposing kernel yet: the copy is made here, once.
    t = data.transpose(-2, -1).clone(memory_format=torch.contiguous_format) if want_t else None
    return data, scale_inv, t


def _check_whole(dst: Float8Tensor) -> None:
    """In-place writes must cover the whole FP8 storage: a part of a tensor shares its scale (and the
    base's transpose) with the rest, which a write through the part would silently corrupt."""
    d = dst._data
    if d.numel() * d.element_size() != d.untyped_storage().nbytes():
        raise ValueError(
            f"in-place write into a view of a Float8Tensor (shape {tuple(dst.shape)} of a larger tensor): the "
            "view shares its scale and transpose with the whole tensor. Write the whole tensor (e.g. "
            "t.copy_(new_values)), or work on t.dequantize()"
        )


def requantize_into(dst: Float8Tensor, src: torch.Tensor) -> None:
    """Write high-precision `src` into FP8 `dst` in place: same FP8 dtype and granularity, fresh scale.

    dst's buffers are written, not replaced, so views and optimizer references stay valid. A cached
    transpose is re-derived from the new bits. dst must be a whole tensor, not a slice of one.
    """
    _check_whole(dst)
    if tuple(src.shape) != tuple(dst.shape):
        src = src.expand(dst.shape)
    fresh = Float8Tensor.quantize(src.to(dst.dtype), dst.fp8_dtype, scaling=scaling_of(dst))
    with torch.no_grad():
        dst._data.copy_(fresh._data)
        dst._scale_inv.copy_(fresh._scale_inv)
        if dst._transpose is not None:
            dst._transpose.copy_(fresh._data.transpose(-2, -1))
