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
  one helper, `float8.native_ops.transpose_cache_after`; a write into the bits by any route (a view, an
  in-place op, ``fp8_data`` itself) leaves it in step or drops it: `transpose_in_step` below.
- Non-finite values never come out finite: a tensor quantized from values holding NaN or inf
  dequantizes to non-finite values, and so does every GEMM that reads it (docs/design.md §2, §3).
- Quantizing goes through a quantizer (float8/quantizer.py); a tensor quantized from one that requires
  grad requires grad, and gradients pass through quantize and dequantize unchanged.
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
from float8.kernels import dequantize as dequantize_kernel
from float8.kernels.reference import FP8_DTYPES, HIGH_PRECISION_DTYPES, check_fp8_dtype

Float8FallbackWarning = dispatch.Float8FallbackWarning


class Float8Tensor(torch.Tensor):
    """FP8 data + float32 scale-inverse (+ optional FP8 transpose), posing as a tensor of `dtype`."""

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    _transpose_raw: Optional[torch.Tensor]  # read through `_transpose`, which drops it once stale

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
        self._transpose_raw = transpose
        self._writes = [0]  # shared by the Float8Tensors that alias these bits (share_writes); see below
        # An FSDP2 all-gather of a trainable high-precision master (float8/fsdp.py): a Linear computes its
        # weight gradient, which FSDP reduce-scatters into the master's.
        self._gathered_master = False
        self._t_stamp = _stamp(self)
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
        fp8_dtype: Optional[torch.dtype] = None,
        *,
        scale: Union[torch.Tensor, float, None] = None,
        scaling=None,
        with_transpose: bool = False,
    ) -> "Float8Tensor":
        """Quantize a float32/bfloat16/float16 tensor to FP8 (E4M3 unless fp8_dtype says otherwise).

        scale: a per-tensor float32 scale (static scaling); the cast kernel writes scale_inv = 1 / scale.
        scaling: TensorwiseScaling() (default: current per-tensor scaling), RowwiseScaling(),
            BlockwiseScaling(block), a DelayedScalingState (whose history is updated on the device), or any
            quantizer of float8.quantizer. Every form goes through one quantizer (float8/quantizer.py).
        with_transpose: also write the transposed FP8 layout in the same kernel, for a backward pass.
            Ignored under no_grad/inference_mode, where no backward pass can read it.
        If x requires grad, the result does too: gradients pass through the quantization as the identity
        (straight-through estimator), and through dequantize() and FP8 GEMMs as their high-precision ones.
        """
        return _quantizer.quantizer_from_args(fp8_dtype, scale, scaling).quantize(x, with_transpose=with_transpose)

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
        """The FP8 format of the bits: torch.float8_e4m3fn or torch.float8_e5m2."""
        return self._data.dtype

    @property
    def transpose_cache(self) -> Optional[torch.Tensor]:
        """The cached FP8 transpose (contiguous, (..., K, M)), or None (also once a write made it stale)."""
        return self._transpose

    @property
    def _transpose(self) -> Optional[torch.Tensor]:
        """The transpose cache if it still matches the data; a stale one is dropped here (`transpose_in_step`)."""
        return transpose_in_step(self)

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """fp8_data.float() * scale_inv (broadcast over its blocks), as a plain tensor of `dtype` (default:
        the nominal dtype). Differentiable when this tensor requires grad (the gradient passes unchanged)."""
        dtype = dtype or self.dtype
        if dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"dequantize returns float32, bfloat16 or float16, not {dtype}")
        if self.requires_grad and torch.is_grad_enabled():
            return _DequantizeSTE.apply(self, dtype)
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
        return dispatch.fallback(func, args, kwargs, _is_float8, _quantizer.requantize_into)

    # ---- torch.compile / FSDP / serialization -------------------------------------------------
    def __tensor_flatten__(self):
        # Called twice per Float8Tensor parameter on every call of a compiled graph (guards, then the
        # unwrapping of its inputs): no cache, the common case, answers without the staleness check.
        if self._transpose_raw is None:
            return ["_data", "_scale_inv"], (self.dtype,)
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

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        cache = self._transpose
        out = Float8Tensor(
            self._data.clone(), self._scale_inv.clone(), self.dtype, None if cache is None else cache.clone(),
            self.requires_grad,
        )
        memo[id(self)] = out
        return out

    def __reduce_ex__(self, protocol):
        # The FP8 bits travel as uint8: plain pickle of a float8 tensor fails in torch 2.13
        # ("UntypedStorage has no attribute dtype"); torch.save is fine either way.
        cache = self._transpose
        t = None if cache is None else cache.view(torch.uint8)
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
    # Not a fake or functional tensor while torch.compile traces (their values are symbols): plain only.
    if s.dim() == 0 and s.device.type == "cpu" and type(s) is torch.Tensor and not torch.compiler.is_compiling():
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


def is_whole(t: Float8Tensor) -> bool:
    """Whether t's bits fill their storage: not a part of a larger tensor (whose scale and transpose the
    part would share)."""
    d = t._data
    return d.numel() * d.element_size() == d.untyped_storage().nbytes()


def storage_address(t: torch.Tensor):
    """The address of t's storage, or None where storages have none: fake and functional tensors while
    torch.compile traces."""
    if torch.compiler.is_compiling():
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # "Cannot access data pointer of Tensor (e.g. FakeTensor, FunctionalTensor)"
        return None


def check_whole(dst: Float8Tensor) -> None:
    """In-place writes must cover the whole FP8 storage: a part of a tensor shares its scale (and the
    base's transpose) with the rest, which a write through the part would silently corrupt."""
    if not is_whole(dst):
        raise ValueError(
            f"in-place write into a view of a Float8Tensor (shape {tuple(dst.shape)} of a larger tensor): the "
            "view shares its scale and transpose with the whole tensor. Write the whole tensor (e.g. "
            "t.copy_(new_values)), or work on t.dequantize()"
        )


# ---- the transpose cache stays in step with the data, or is dropped ---------------------------------
# The cache is stamped, when it is made or re-derived, with (writes, version of the bits, version of the
# cache); a read that finds any of them moved drops it, and the GEMM that needs the other layout makes it
# again from the bits. Two kinds of write are caught:
# - raw writes into `t.fp8_data` or into the cache (`t.t().fp8_data` *is* it): they move the tensors'
#   version counters;
# - writes through the library (in-place ops, copy_) into any Float8Tensor that aliases the bits (a view:
#   `t.view(-1).add_(1)`): they bump `_writes`, a counter shared by all Float8Tensors made as views of one
#   another (share_writes). Counters are needed here because views made inside __torch_dispatch__ run
#   below autograd and do not share the base's version counter.


def _stamp(t: "Float8Tensor"):
    data, cache = t._data, t._transpose_raw
    if cache is None or data.is_inference() or cache.is_inference() or torch.compiler.is_compiling():
        return None  # inference tensors keep no version counter; a traced graph has no counters to read
    return (t._writes[0], data._version, cache._version)


def transpose_in_step(t: Float8Tensor) -> Optional[torch.Tensor]:
    """t's transpose cache, or None after dropping it if a write moved the bits or the cache since it was
    made. The one place that decides whether a cache is still valid."""
    cache = t._transpose_raw
    if cache is None or t._t_stamp is None or torch.compiler.is_compiling():
        return cache
    if (t._writes[0], t._data._version, cache._version) != t._t_stamp:
        t._transpose_raw = t._t_stamp = None
        return None
    return cache


def share_writes(view: Float8Tensor, src: Float8Tensor) -> Float8Tensor:
    """Make `view`, which aliases src's bits, count its writes with src's (and the other way round)."""
    view._writes = src._writes
    view._t_stamp = _stamp(view)
    return view


def mark_written(t: Float8Tensor) -> None:
    """After the library wrote t's bits (and re-derived t's own cache): every alias's cache is now stale,
    t's own is in step."""
    t._writes[0] += 1
    t._t_stamp = _stamp(t)


class _DequantizeSTE(torch.autograd.Function):
    """dequantize() of a Float8Tensor that requires grad: the gradient passes unchanged (as its dtype)."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = t.dtype
        return dequantize_kernel(t._data, t._scale_inv, dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


from float8 import quantizer as _quantizer  # noqa: E402  (quantizer.py imports this module)
