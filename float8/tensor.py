"""Float8Tensor: FP8 bits that carry their own scale-inverse, and the quantizers without state.

    Float8Tensor.quantize(x, scaling=None, fp8_dtype=E4M3, with_transpose=False) -> Float8Tensor
    Float8Tensor(data, scale_inv, nominal_dtype, transpose=None, requires_grad=False, quantizer_id=None)
    .fp8_data, .scale_inv, .dequantize(dtype), .requantizer (what an in-place write re-quantizes with)
    Quantizer (protocol: quantize, operands, requantizer), TensorwiseQuantizer, StaticQuantizer,
    RowwiseQuantizer, BlockwiseQuantizer

Numerics: hp ≈ fp8_data.float() * scale_inv (scale_inv 0-d or one per block); non-finite values never
come out finite. The whole contract (scale layouts, the transpose cache, views, in-place writes, .to):
docs/design.md §2. The quantizers that keep state are in float8/quantizer.py, which exports them all.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from float8 import dispatch
from float8.checks import (
    ScaleLayout,
    _check_margin_for,
    _check_parts,
    _describe_scale,
    _poison_if_non_finite,
    _reduced_amax,
    check_amax_group,
    check_dense,
    layout_of_scale,
    static_scale,
)
from float8.kernels import dequantize as dequantize_kernel
from float8.kernels import quantize_blockwise, quantize_rowwise, quantize_tensorwise
from float8.kernels.reference import (
    HIGH_PRECISION_DTYPES,
    check_fp8_dtype,
    scale_from_amax,
)
from float8.quantizer_id import check_quantizer_id, lays_out, quantizer_id, rebuild_quantizer
from float8.scaling import BlockwiseScaling, DelayedScaling, RowwiseScaling, TensorwiseScaling
from float8.writes import _stamp, requantize_into, transpose_in_step

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
        quantizer_id: Optional[tuple] = None,
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
        self._quantizer_id = quantizer_id  # float8/quantizer_id.py; None: laid out as its scale's shape says
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
        scaling: Union[TensorwiseScaling, RowwiseScaling, BlockwiseScaling, Quantizer, None] = None,
        with_transpose: bool = False,
    ) -> "Float8Tensor":
        """Quantize a float32/bfloat16/float16 tensor to FP8 (E4M3 unless fp8_dtype says otherwise).

        scale: a per-tensor float32 scale (static scaling); the cast kernel writes scale_inv = 1 / scale.
        scaling: TensorwiseScaling() (default: current per-tensor scaling), RowwiseScaling(),
            BlockwiseScaling(block), a DelayedScalingState (whose history is updated on the device), or any
            quantizer of float8.quantizer. Every form goes through one quantizer's `quantize` (below).
        with_transpose: also write the transposed FP8 layout in the same kernel, for a backward pass.
            Ignored under no_grad/inference_mode, where no backward pass can read it.
        If x requires grad, the result does too: gradients pass through the quantization as the identity
        (straight-through estimator), and through dequantize() and FP8 GEMMs as their high-precision ones.
        """
        if scale is not None:
            if scaling is not None:
                raise ValueError("pass either scale= (static scaling) or scaling=, not both")
            quantizer = StaticQuantizer(scale, fp8_dtype or torch.float8_e4m3fn)
        else:
            quantizer = _quantizer_for(TensorwiseScaling() if scaling is None else scaling, fp8_dtype)
        return quantizer.quantize(x, with_transpose=with_transpose)

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
    def requantizer(self) -> Quantizer:
        """The stateless quantizer of this tensor's format and scale layout (`Quantizer.requantizer` of the
        quantizer that made it, whose identity the tensor carries): in-place writes re-quantize through it
        with a fresh scale, and its `layout` tells an FP8 GEMM what the scales are. A tensor built from its
        parts without `quantizer_id` is read from its scale's shape (0-d: per tensor; one per row; (1, 128)
        or (128, 128) blocks)."""
        qid = self._quantizer_id
        if qid is None or not lays_out(qid, self._data.shape, self._scale_inv.shape):
            # None, or a view or cat whose scales are no longer laid out as the quantizer lays them out (the
            # rows of per-row tensors concatenated side by side): what the scales are now.
            return _requantizer_from_scale(self)
        return rebuild_quantizer(qid, Quantizer)

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
        return dispatch.fallback(func, args, kwargs, _is_float8, requantize_into)

    # ---- torch.compile / FSDP / serialization -------------------------------------------------
    def __tensor_flatten__(self):
        # Called twice per Float8Tensor parameter on every call of a compiled graph (guards, then the
        # unwrapping of its inputs): no cache, the common case, answers without the staleness check.
        # The quantizer's identity (constants) rides in the context: traced code writes what eager code writes.
        if self._transpose_raw is None:
            return ["_data", "_scale_inv"], (self.dtype, self._quantizer_id)
        inner = ["_data", "_scale_inv"]
        if self._transpose is not None:
            inner.append("_transpose")
        return inner, (self.dtype, self._quantizer_id)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):
        nominal_dtype, quantizer_id = ctx
        return Float8Tensor(
            inner_tensors["_data"],
            inner_tensors["_scale_inv"],
            nominal_dtype,
            inner_tensors.get("_transpose"),
            quantizer_id=quantizer_id,
        )

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        cache = self._transpose
        out = Float8Tensor(
            self._data.clone(),
            self._scale_inv.clone(),
            self.dtype,
            None if cache is None else cache.clone(),
            self.requires_grad,
            self._quantizer_id,
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
            (
                self._data.view(torch.uint8),
                self.fp8_dtype,
                self._scale_inv,
                self.dtype,
                t,
                self.requires_grad,
                self._quantizer_id,
            ),
        )


def _rebuild_float8_tensor(bits, fp8_dtype, scale_inv, nominal_dtype, transpose_bits, requires_grad, quantizer_id=None):
    # quantizer_id: absent from files saved before tensors carried one (their layout is read from the scale).
    check_fp8_dtype(fp8_dtype)
    if quantizer_id is not None:
        check_quantizer_id(quantizer_id)
    t = None if transpose_bits is None else transpose_bits.view(fp8_dtype)
    return Float8Tensor(bits.view(fp8_dtype), scale_inv, nominal_dtype, t, requires_grad, quantizer_id)


def _is_float8(t) -> bool:
    return isinstance(t, Float8Tensor)


class _DequantizeSTE(torch.autograd.Function):
    """dequantize() of a Float8Tensor that requires grad: the gradient passes unchanged (as its dtype)."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = t.dtype
        return dequantize_kernel(t._data, t._scale_inv, dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


# ---- quantizers: how a high-precision tensor becomes a Float8Tensor ------------------------------------
# The protocol and the stateless quantizers, which `Float8Tensor.quantize` builds; those that keep state in
# buffers are in float8/quantizer.py (which exports all, and says what a quantizer answers; docs/design.md §4).


def check_quantize_input(x: object) -> None:
    """TypeError unless x is a plain, dense float32/bfloat16/float16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize needs a torch.Tensor, got {type(x).__name__}")
    check_dense(x, "quantize")
    if isinstance(x, Float8Tensor):
        raise TypeError(
            "quantize got a Float8Tensor; it is already FP8. Use .dequantize() first to re-quantize with "
            "another scaling."
        )
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"quantize needs a float32, bfloat16 or float16 tensor, got {x.dtype}")


class Quantizer:
    """Base of the quantizers. Subclasses set `fp8_dtype`, `layout` and implement `_quantize`."""

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    layout: ScaleLayout = ScaleLayout.TENSOR
    margin: int = 0
    power_of_2: bool = False
    amax_group = None

    def quantize(self, x: torch.Tensor, *, with_transpose: bool = False) -> Float8Tensor:
        """x (float32/bfloat16/float16) as a Float8Tensor of this quantizer's format and scaling.

        with_transpose: also write the transposed FP8 layout (for a backward pass); ignored under
        no_grad/inference_mode, where no backward pass can read it. If x requires grad, so does the
        result, and gradients pass through the quantization unchanged (straight-through estimator).
        """
        check_quantize_input(x)
        grad = torch.is_grad_enabled()
        want_t = bool(with_transpose) and grad and x.dim() >= 2
        if grad and x.requires_grad:
            return _QuantizeSTE.apply(x, self, want_t)
        return self._quantize(x, want_t)

    def _quantize(self, x: torch.Tensor, with_transpose: bool) -> Float8Tensor:
        """`quantize` without the grad-mode rule and without autograd: for ops, which run inside their
        own autograd Function (grad mode off) and know whether a backward pass will read the transpose."""
        raise NotImplementedError

    def operands(
        self, x: torch.Tensor, rows: bool, columns: bool
    ) -> Tuple[Optional[Float8Tensor], Optional[Float8Tensor]]:
        """x (2-D) as the GEMM operands a consumer asks for, each made as this layout needs (None where not
        asked): `rows` for a GEMM that reduces along x's last dim (x @ w.t()), `columns` for one that
        reduces along its first (x.t() @ dy: a weight gradient; the weight in an input gradient). Per
        tensor, one kernel writes both (the columns are the same bits' transpose cache); per row, x is
        quantized again along its columns; layouts whose GEMMs dequantize serve both with one tensor."""
        if self.layout is ScaleLayout.ROW:
            cols = self._quantize(x.t(), False).t() if columns else None
            return (self._quantize(x, False) if rows else None), cols
        x8 = self._quantize(x, columns and self.layout is ScaleLayout.TENSOR)
        return (x8 if rows else None), (x8 if columns else None)

    # ---- the request a fused kernel honours (per-tensor quantizers only) -----------------------------
    @property
    def fuses(self) -> bool:
        """Whether a norm/activation kernel can write this quantizer's FP8 form in its own launch."""
        return False

    def kernel_scale(self) -> Optional[torch.Tensor]:
        """The scale a fused kernel casts with; None: the kernel computes the amax (current scaling)."""
        return None

    def finish(
        self,
        data: torch.Tensor,
        data_t: torch.Tensor,
        scale_inv: torch.Tensor,
        amax: Optional[torch.Tensor],
        nominal_dtype: torch.dtype,
        with_transpose: bool,
    ) -> Float8Tensor:
        """The Float8Tensor from a kernel's outputs, after the amax bookkeeping (`record`)."""
        scale_inv = self._after_kernel(scale_inv, amax)
        t = data_t if with_transpose and data_t.numel() == data.numel() and data.dim() >= 2 else None
        return Float8Tensor(data, scale_inv, nominal_dtype, t, quantizer_id=self.requantizer_id)

    def _after_kernel(self, scale_inv, amax):
        return scale_inv

    def record(self, amax: torch.Tensor) -> None:
        """Bookkeeping of one amax written by a kernel (delayed scaling keeps a history); device ops only."""

    @property
    def requantizer(self) -> "Quantizer":
        """The stateless quantizer of this one's format and layout, which the tensors it makes carry
        (`Float8Tensor.requantizer`): an in-place write re-quantizes through it with a fresh scale (no static
        scale, amax history, amax group, margin or power-of-2 rounding: a written value is never clipped).
        Per-tensor and per-row layouts: the library's current scaling of that layout and format. Other
        layouts: the quantizer itself, by default (so a granularity of one's own must be stateless, defined
        at the top level of a module, and built again by `constructor_arguments()`)."""
        if self.layout is ScaleLayout.TENSOR:
            return _PER_TENSOR[self.fp8_dtype]
        if self.layout is ScaleLayout.ROW:
            return _PER_ROW[self.fp8_dtype]
        return self

    @property
    def requantizer_id(self) -> tuple:
        """The identity of `requantizer`, as the tensors this quantizer makes carry it (float8/quantizer_id.py)."""
        q = self.requantizer
        if q is _PER_TENSOR.get(self.fp8_dtype):
            return _PER_TENSOR_ID[self.fp8_dtype]
        if q is _PER_ROW.get(self.fp8_dtype):
            return _PER_ROW_ID[self.fp8_dtype]
        return quantizer_id(q)

    def constructor_arguments(self) -> Tuple[tuple, dict]:
        """(args, kwargs) with which this quantizer's class builds it again: by default its format alone.
        A quantizer of one's own whose constructor takes more says so here."""
        return (self.fp8_dtype,), {}

    def _for_format(self, fp8_dtype) -> "Quantizer":
        """This quantizer, to write `fp8_dtype` (None: its own format); another format is an error."""
        if fp8_dtype is not None and fp8_dtype != self.fp8_dtype:
            raise ValueError(f"the quantizer writes {self.fp8_dtype}, not the requested {fp8_dtype}")
        return self


class _QuantizeSTE(torch.autograd.Function):
    """Quantization as the identity for gradients (the straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, quantizer, with_transpose):
        ctx.dtype = x.dtype
        return quantizer._quantize(x, with_transpose)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, Float8Tensor):
            grad = grad.dequantize()
        return grad.to(ctx.dtype), None, None


class TensorwiseQuantizer(Quantizer):
    """One scale for the whole tensor from its own amax (current scaling): scale = fp8_max / amax.

    amax_group: a process group over which the amax is reduced (MAX) first, so all ranks share one scale;
    a norm or activation then writes high precision and this quantizer casts it (one extra pass).
    """

    layout = ScaleLayout.TENSOR

    def __init__(self, fp8_dtype=torch.float8_e4m3fn, *, margin: int = 0, power_of_2: bool = False, amax_group=None):
        check_fp8_dtype(fp8_dtype)
        TensorwiseScaling(margin, power_of_2)  # validates margin and power_of_2
        _check_margin_for(fp8_dtype, margin)
        self.fp8_dtype, self.margin, self.power_of_2 = fp8_dtype, margin, power_of_2
        self.amax_group = check_amax_group(amax_group)

    @property
    def fuses(self) -> bool:
        """Yes, without an amax group (with one, the amax is reduced before the cast)."""
        return self.amax_group is None

    def _quantize(self, x, with_transpose):
        scale = None
        if self.amax_group is not None:
            scale = scale_from_amax(_reduced_amax(x, self.amax_group), self.fp8_dtype, self.margin, self.power_of_2)
        data, data_t, scale_inv, _ = quantize_tensorwise(
            x, self.fp8_dtype, scale, self.margin, self.power_of_2, with_transpose
        )
        return self.finish(data, data_t, scale_inv, None, x.dtype, with_transpose)

    def __repr__(self) -> str:
        return f"TensorwiseQuantizer({self.fp8_dtype}, margin={self.margin}, power_of_2={self.power_of_2})"


class StaticQuantizer(Quantizer):
    """One given scale (static scaling). The cast kernel writes scale_inv = 1 / scale.

    A number, or a CPU tensor, is checked when the quantizer is made: it must be a float32 value in
    [min_scale(fp8_dtype), float32 max] (so that 1 / scale and fp8_max / scale are finite), else ValueError.
    A CUDA tensor is not read on the host (no sync): an invalid value (0, negative, inf, NaN, out of that
    range) makes every tensor it quantizes NaN instead.
    """

    layout = ScaleLayout.TENSOR

    def __init__(self, scale: Union[torch.Tensor, float], fp8_dtype=torch.float8_e4m3fn, *, device=None):
        check_fp8_dtype(fp8_dtype)
        self.fp8_dtype = fp8_dtype
        self.scale = static_scale(scale, fp8_dtype, device)

    @property
    def fuses(self) -> bool:
        """Yes: the kernel casts with the given scale."""
        return True

    def kernel_scale(self) -> torch.Tensor:
        """The given scale (validated, or NaN if a device scale was invalid)."""
        return self.scale

    def _quantize(self, x, with_transpose):
        scale = self.kernel_scale()  # StaticScalingState keeps it in a buffer
        if scale.device != x.device:
            raise ValueError(f"scale is on {scale.device} but the input is on {x.device}")
        data, data_t, scale_inv, amax = quantize_tensorwise(x, self.fp8_dtype, scale, 0, False, with_transpose)
        return self.finish(data, data_t, scale_inv, amax, x.dtype, with_transpose)

    def _after_kernel(self, scale_inv, amax):
        return _poison_if_non_finite(scale_inv, amax)


class RowwiseQuantizer(Quantizer):
    """One scale per row (per slice along the last dim): scale_inv has shape x.shape[:-1] + (1,)."""

    layout = ScaleLayout.ROW

    def __init__(self, fp8_dtype=torch.float8_e4m3fn, *, margin: int = 0, power_of_2: bool = False):
        check_fp8_dtype(fp8_dtype)
        RowwiseScaling(margin, power_of_2)
        _check_margin_for(fp8_dtype, margin)
        self.fp8_dtype, self.margin, self.power_of_2 = fp8_dtype, margin, power_of_2

    def _quantize(self, x, with_transpose):
        data, scale_inv = quantize_rowwise(x, self.fp8_dtype, self.margin, self.power_of_2)
        t = _transpose_copy(data, with_transpose)
        return Float8Tensor(data, scale_inv, x.dtype, t, quantizer_id=self.requantizer_id)


class BlockwiseQuantizer(Quantizer):
    """One scale per block: (1, 128) for activations and gradients, (128, 128) for 2-D weights."""

    layout = ScaleLayout.BLOCK

    def __init__(self, fp8_dtype=torch.float8_e4m3fn, *, block=(1, 128), margin: int = 0, power_of_2: bool = False):
        check_fp8_dtype(fp8_dtype)
        self.block = BlockwiseScaling(block, margin, power_of_2).block
        _check_margin_for(fp8_dtype, margin)
        self.fp8_dtype, self.margin, self.power_of_2 = fp8_dtype, margin, power_of_2
        # Writes take blocks of the same shape and format from the library's own class (not a subclass).
        plain = type(self) is BlockwiseQuantizer and margin == 0 and not power_of_2
        self._requantizer = self if plain else BlockwiseQuantizer(fp8_dtype, block=self.block)
        self._requantizer_id = quantizer_id(self._requantizer)

    @property
    def requantizer(self) -> "BlockwiseQuantizer":
        """Blocks of the same shape and format, without margin or power-of-2 rounding."""
        return self._requantizer

    @property
    def requantizer_id(self) -> tuple:
        """The identity of `requantizer`, made once with the quantizer."""
        return self._requantizer_id

    def constructor_arguments(self) -> Tuple[tuple, dict]:
        """Its format and block shape (a margin or power-of-2 rounding makes a requantizer without them)."""
        return (self.fp8_dtype,), {"block": self.block}

    def _quantize(self, x, with_transpose):
        rows, cols = self.block
        data, scale_inv = quantize_blockwise(x, rows, cols, self.fp8_dtype, self.margin, self.power_of_2)
        t = _transpose_copy(data, with_transpose)
        return Float8Tensor(data, scale_inv, x.dtype, t, quantizer_id=self.requantizer_id)


# The requantizers of every per-tensor and per-row quantizer: one instance per format, whose identities are
# made once (tensors made by any of them carry the same tuple, which a compiled graph's guard compares by
# identity).
_PER_TENSOR = {fmt: TensorwiseQuantizer(fmt) for fmt in (torch.float8_e4m3fn, torch.float8_e5m2)}
_PER_TENSOR_ID = {fmt: quantizer_id(q) for fmt, q in _PER_TENSOR.items()}
_PER_ROW = {fmt: RowwiseQuantizer(fmt) for fmt in (torch.float8_e4m3fn, torch.float8_e5m2)}
_PER_ROW_ID = {fmt: quantizer_id(q) for fmt, q in _PER_ROW.items()}

# torch.load(weights_only=True) refuses unknown callables and classes: these build only from tensors,
# dtypes, strings and numbers (a carried quantizer identity holds a ScaleLayout).
torch.serialization.add_safe_globals([_rebuild_float8_tensor, Float8Tensor, ScaleLayout])


def _transpose_copy(data, with_transpose):
    # Per-row and block layouts have no fused transposing kernel: the copy is made here, once.
    return data.transpose(-2, -1).clone(memory_format=torch.contiguous_format) if with_transpose else None


def _quantizer_for(scaling, fp8_dtype=None, *, amax_group=None) -> Quantizer:
    """`float8.quantizer.quantizer_for` but for what needs a state module: the quantizer of a stateless
    scaling dataclass for `fp8_dtype` (default E4M3), or a quantizer given as it is (checked against, or
    for a delayed state bound to, `fp8_dtype`). A DelayedScaling keeps an amax history, which only a
    DelayedScalingState (float8/quantizer.py) holds: it is refused here."""
    if isinstance(scaling, Quantizer):
        return scaling._for_format(fp8_dtype)
    fp8_dtype = fp8_dtype or torch.float8_e4m3fn
    if isinstance(scaling, TensorwiseScaling):
        return TensorwiseQuantizer(
            fp8_dtype, margin=scaling.margin, power_of_2=scaling.power_of_2, amax_group=amax_group
        )
    if amax_group is not None and not isinstance(scaling, DelayedScaling):
        raise ValueError(
            f"amax_group applies to per-tensor scaling; {type(scaling).__name__} scales are local to their rows "
            "or blocks"
        )
    if isinstance(scaling, RowwiseScaling):
        return RowwiseQuantizer(fp8_dtype, margin=scaling.margin, power_of_2=scaling.power_of_2)
    if isinstance(scaling, BlockwiseScaling):
        return BlockwiseQuantizer(fp8_dtype, block=scaling.block, margin=scaling.margin, power_of_2=scaling.power_of_2)
    if isinstance(scaling, DelayedScaling):
        raise TypeError(
            "DelayedScaling is a recipe without state; quantize with scaling=DelayedScalingState(recipe), "
            "which keeps the amax history"
        )
    raise TypeError(
        f"scaling must be a float8 scaling recipe, a quantizer or a DelayedScalingState, got {type(scaling).__name__}"
    )


def _requantizer_from_scale(t: Float8Tensor) -> Quantizer:
    """The requantizer of a tensor built from its parts without one: read from its scale's shape."""
    layout, block = layout_of_scale(t._data.shape, t._scale_inv.shape)
    if layout is ScaleLayout.TENSOR:
        return _PER_TENSOR[t.fp8_dtype]
    if layout is ScaleLayout.ROW:
        return _PER_ROW[t.fp8_dtype]
    return BlockwiseQuantizer(t.fp8_dtype, block=block)
