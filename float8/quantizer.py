"""Quantizers: how a high-precision tensor becomes FP8, decided in one object per scaling kind.

A recipe builds them (`Recipe.quantizers()`), an op holds them, and `Float8Tensor.quantize` goes through
one too. A quantizer alone answers four questions (docs/design.md, "Quantizers"):

1. `quantize(x, with_transpose=...)` -> Float8Tensor, written by one kernel with its scale-inverse;
2. the request a norm or activation kernel honours when it writes FP8 for the next op: `fuses` (whether a
   fused kernel can write this form at all), and its arguments `fp8_dtype`, `kernel_scale()` (None: the
   kernel computes the amax itself, current scaling; a tensor: cast with this scale), `margin`,
   `power_of_2`; the producer hands the kernel's outputs back to `finish(...)`;
3. the GEMM operand layout it produces: `layout` (a `ScaleLayout`);
4. the amax bookkeeping after a kernel wrote its amax: `record(amax)` (the delayed history), on the
   device, with no host sync.

Per-tensor quantizers take an optional `amax_group` (a process group, or None): the amax is then reduced
with MAX over the group before the scale is derived from it, so every rank quantizes with one scale.

The non-finite contract (stated in code in kernels/reference.py): a tensor holding a NaN or an
inf never comes out finite. Current scaling derives a NaN scale from a non-finite amax (every value
and the scale-inverse become NaN); with a given scale (static or delayed) the cast saturates, and
`finish` then marks the scale-inverse NaN, so dequantizing, and every GEMM that reads the tensor,
gives non-finite values, as in high precision.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

from float8.kernels import amax as amax_kernel
from float8.kernels import quantize_blockwise, quantize_rowwise, quantize_tensorwise
from float8.kernels.reference import (
    FLOAT32_MAX,
    HIGH_PRECISION_DTYPES,
    check_fp8_dtype,
    max_margin,
    min_scale,
    scale_from_amax,
)
from float8.recipe import BlockwiseScaling, DelayedScaling, RowwiseScaling, TensorwiseScaling
from float8.tensor import Float8Tensor, block_shape


class ScaleLayout(enum.Enum):
    """The GEMM operand layout a quantizer produces.

    TENSOR: one scale; the transposed operand is the same bits (the cached transpose), so every GEMM of
        a Linear runs in FP8 and norms/activations can write it in their own kernels.
    ROW: one scale per row; the transposed operand needs its own quantization along its rows.
    BLOCK: one scale per 1x128 or 128x128 block; GEMMs run on dequantized operands (numerics, not speed).
    """

    TENSOR = "tensor"
    ROW = "row"
    BLOCK = "block"


def check_dense(x: torch.Tensor, what: str) -> None:
    """TypeError naming the problem for a sparse or nested tensor (which would otherwise fail deep inside
    torch, e.g. "NestedTensorImpl doesn't support sizes"): FP8 kernels and GEMMs read dense strided memory."""
    if x.is_nested:
        raise TypeError(f"{what} takes a dense tensor, got a nested tensor: pad it (torch.nested.to_padded_tensor) first")
    if x.layout is not torch.strided:
        raise TypeError(f"{what} takes a dense tensor, got layout {x.layout}: call .to_dense() first")


def check_quantize_input(x) -> None:
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


def check_amax_group(group):
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

    # ---- the request a fused kernel honours (per-tensor quantizers only) -----------------------------
    @property
    def fuses(self) -> bool:
        """Whether a norm/activation kernel can write this quantizer's FP8 form in its own launch."""
        return False

    def kernel_scale(self) -> Optional[torch.Tensor]:
        """The scale a fused kernel casts with; None: the kernel computes the amax (current scaling)."""
        return None

    def finish(self, data, data_t, scale_inv, amax, nominal_dtype, with_transpose: bool) -> Float8Tensor:
        """The Float8Tensor from a kernel's outputs, after the amax bookkeeping (`record`)."""
        scale_inv = self._after_kernel(scale_inv, amax)
        t = data_t if with_transpose and data_t.numel() == data.numel() and data.dim() >= 2 else None
        return Float8Tensor(data, scale_inv, nominal_dtype, t)

    def _after_kernel(self, scale_inv, amax):
        return scale_inv

    def record(self, amax: torch.Tensor) -> None:
        """Bookkeeping of one amax written by a kernel (delayed scaling keeps a history); device ops only."""


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


def _poison_if_non_finite(scale_inv: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    # A cast with a given scale saturates +-inf to +-fp8_max; the tensor must still read as non-finite.
    # scale_inv + 0 * amax: scale_inv itself for a finite amax (>= 0), NaN for inf or NaN. One op, where
    # isfinite + full_like + where were three (with an allocation): ~25 us of host time per static-scale
    # quantize on the H100 machine. tests/float8/test_quantizer.py pins the NaN for inf and NaN inputs.
    return torch.add(scale_inv, amax, alpha=0)


def all_reduce_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """MAX of `amax` over `group`, in place. A NaN becomes inf first: a MAX reduction may drop a NaN
    (whether it does depends on the rank order), an inf it keeps, and both give a non-finite scale."""
    amax.copy_(torch.where(amax.isnan(), torch.full_like(amax, float("inf")), amax))
    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=group)
    return amax


def _reduced_amax(x: torch.Tensor, group) -> torch.Tensor:
    return all_reduce_amax(amax_kernel(x), group)


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
        self.scale = _static_scale(scale, fp8_dtype, device)

    @property
    def fuses(self) -> bool:
        """Yes: the kernel casts with the given scale."""
        return True

    def kernel_scale(self):
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


class StaticScalingState(torch.nn.Module, StaticQuantizer):
    """A StaticQuantizer whose scale is a buffer: an op's fixed scale, saved in its state dict.

    `float8.ops.calibrate` and `ops.set_input_scale` make one a Linear's `input_quantizer` (a submodule,
    so `model.state_dict()` carries the scale, and `model.to(device)` moves it).
    - Buffer `static_scale` () float32, registered at construction (its own name, not `scale`: a delayed
      state's buffer is `scale` too, and a checkpoint must say which quantizer it was made with). It stays
      float32 through `model.to(bfloat16)`/`.half()`.
    - The scale is validated as StaticQuantizer validates it, at construction and at every load: on the CPU
      an invalid value raises ValueError; a CUDA value is not read on the host and an invalid one becomes NaN
      (every tensor it quantizes comes out NaN, never finite and wrong).
    - The extra state carries the format (a scale is fp8_max / amax of one format); loading a state of
      another format raises.
    - amax_group: the process group the scale was agreed over (calibration reduced its amax over it), or
      None. The cast reduces nothing; the group tells an FP8 all-gather over it that every rank casts with
      this one scale (ops/parallel.py), so every rank must be given the same scale.
    """

    layout = ScaleLayout.TENSOR

    def __init__(
        self, scale: Union[torch.Tensor, float], fp8_dtype=torch.float8_e4m3fn, *, device=None, amax_group=None
    ):
        torch.nn.Module.__init__(self)
        check_fp8_dtype(fp8_dtype)
        self.fp8_dtype = fp8_dtype
        self.amax_group = check_amax_group(amax_group)
        s = _static_scale(scale, fp8_dtype, device)
        self.register_buffer("static_scale", s if device is None else s.to(device))

    @property
    def scale(self) -> torch.Tensor:
        """The scale (the `static_scale` buffer)."""
        return self.static_scale

    def kernel_scale(self):
        """The scale buffer (validated, or NaN if an invalid scale reached it on a CUDA device)."""
        return self.static_scale

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) must move the scale, never round it (a bf16 scale is another scale).
        return _apply_keeping_float32(self, fn)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A loaded scale is checked like a given one: a checkpoint cannot bring an unvalidated scale in.
        key = prefix + "static_scale"
        loaded = state_dict.get(key)
        if isinstance(loaded, torch.Tensor):
            state_dict[key] = _static_scale(loaded, self.fp8_dtype, None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def get_extra_state(self):
        """The format the scale was made for: what the buffer alone does not say."""
        return {"fp8_dtype": str(self.fp8_dtype)}

    def set_extra_state(self, state) -> None:
        loaded = getattr(torch, str(state.get("fp8_dtype", self.fp8_dtype)).replace("torch.", ""))
        if loaded != self.fp8_dtype:
            raise ValueError(
                f"the checkpoint's static scale was made for {loaded}, this quantizer casts to {self.fp8_dtype}: "
                "the scale would be wrong. Load it into a model of the same recipe format."
            )

    def extra_repr(self) -> str:
        return f"fp8_dtype={self.fp8_dtype}"


def _apply_keeping_float32(module: torch.nn.Module, fn) -> torch.nn.Module:
    """`Module._apply` for quantizer state: the buffers follow fn's device and stay float32."""
    for name, buf in module._buffers.items():
        moved = fn(buf)
        module._buffers[name] = moved if moved.dtype == torch.float32 else buf.to(moved.device)
    return module


def _static_scale(scale, fp8_dtype, device) -> torch.Tensor:
    lo = min_scale(fp8_dtype)
    valid = f"a finite positive float32 value in [{lo:.3g}, {FLOAT32_MAX:.3g}] for {fp8_dtype}"
    if isinstance(scale, torch.Tensor):
        if isinstance(scale, Float8Tensor) or scale.numel() != 1:
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
        return Float8Tensor(data, scale_inv, x.dtype, _transpose_copy(data, with_transpose))


class BlockwiseQuantizer(Quantizer):
    """One scale per block: (1, 128) for activations and gradients, (128, 128) for 2-D weights."""

    layout = ScaleLayout.BLOCK

    def __init__(self, fp8_dtype=torch.float8_e4m3fn, *, block=(1, 128), margin: int = 0, power_of_2: bool = False):
        check_fp8_dtype(fp8_dtype)
        self.block = BlockwiseScaling(block, margin, power_of_2).block
        _check_margin_for(fp8_dtype, margin)
        self.fp8_dtype, self.margin, self.power_of_2 = fp8_dtype, margin, power_of_2

    def _quantize(self, x, with_transpose):
        rows, cols = self.block
        data, scale_inv = quantize_blockwise(x, rows, cols, self.fp8_dtype, self.margin, self.power_of_2)
        return Float8Tensor(data, scale_inv, x.dtype, _transpose_copy(data, with_transpose))


def _transpose_copy(data, with_transpose):
    # Per-row and block layouts have no fused transposing kernel: the copy is made here, once.
    return data.transpose(-2, -1).clone(memory_format=torch.contiguous_format) if with_transpose else None


class DelayedScalingState(torch.nn.Module, Quantizer):
    """Delayed scaling: the scale of step t comes from the amaxes of earlier steps (its history).

    The cast needs no amax pass first: it uses `scale`, and the kernel returns this tensor's amax, which
    `record` folds into the history with device ops only (no .item(), no host sync, CUDA-graph safe).
    - Buffers, registered at construction (so a checkpoint loads strictly into a fresh model and resumes
      with the same scales): `amax_history` (history_len,) float32, newest first; `scale` () float32, NaN
      until a finite amax is recorded (no scale yet). They stay float32 through `model.to(bfloat16)`.
      A checkpoint with another history length loads too: its newest entries are kept.
      The state dict also carries the format and whether a step was recorded (`get_extra_state`).
    - The first step (no amax recorded yet) quantizes with current scaling and records its amax. If that
      amax was not finite, the next step casts with the NaN "no scale yet": its tensor comes out NaN (an
      overflow stays visible, never a silent saturation) and its amax is recorded.
    - One format per state: the first quantize binds `fp8_dtype` (or pass it); another format raises, and
      so does loading a checkpoint made for another format.
    - A non-finite amax is never recorded: the history and the scale stay as they were, and the tensor of
      that step is marked non-finite (its scale_inv is NaN).
    - amax_group: a process group over which each amax is reduced (MAX) before it is recorded.
    Options are keyword-only: device, fp8_dtype, amax_group.
    """

    layout = ScaleLayout.TENSOR

    def __init__(self, recipe: DelayedScaling = DelayedScaling(), *, device=None, fp8_dtype=None, amax_group=None):
        torch.nn.Module.__init__(self)
        if not isinstance(recipe, DelayedScaling):
            raise TypeError(f"DelayedScalingState needs a DelayedScaling recipe, got {type(recipe).__name__}")
        self.recipe = recipe
        self.margin, self.power_of_2 = recipe.margin, recipe.power_of_2
        self.fp8_dtype = None
        if fp8_dtype is not None:
            self.bind(fp8_dtype)
        self.amax_group = check_amax_group(amax_group)
        self.deferred = None  # a list while a run defers its amax reductions (record, reduce_deferred)
        self.register_buffer("amax_history", torch.empty(recipe.history_len, dtype=torch.float32, device=device))
        self.register_buffer("scale", torch.empty((), dtype=torch.float32, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Forget every step: an empty history, no scale (also after `to_empty` of a meta-device model)."""
        with torch.no_grad():
            self.amax_history.zero_()
            self.scale.fill_(float("nan"))
        self.has_history = False

    def bind(self, fp8_dtype) -> None:
        """Tie this state to one FP8 format; a second format is an error (its scales would be wrong)."""
        check_fp8_dtype(fp8_dtype)
        if self.fp8_dtype is None:
            _check_margin_for(fp8_dtype, self.recipe.margin)
            self.fp8_dtype = fp8_dtype
        elif fp8_dtype != self.fp8_dtype:
            raise ValueError(
                f"this DelayedScalingState keeps the amax history of {self.fp8_dtype} tensors; quantizing "
                f"{fp8_dtype} with it would use a scale made for the other format. Use one state per format."
            )

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) / .half() must move the state, never round it: an fp16 scale of 1.6e5
        # would become inf. The buffers follow fn's device and stay float32.
        return _apply_keeping_float32(self, fn)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A checkpoint made with another history length (the default was 16 before 1024) loads: the newest
        # entries are kept, and a longer window starts with the rest empty (0 never raises a "max").
        key = prefix + "amax_history"
        loaded = state_dict.get(key)
        if isinstance(loaded, torch.Tensor) and loaded.dim() == 1 and loaded.shape != self.amax_history.shape:
            fitted = torch.zeros_like(self.amax_history)
            n = min(loaded.shape[0], fitted.shape[0])
            fitted[:n] = loaded[:n].to(fitted.device, fitted.dtype)
            state_dict[key] = fitted
        _check_delayed_state(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def get_extra_state(self):
        """The format and whether a step was recorded: what the buffers alone do not say."""
        return {"fp8_dtype": None if self.fp8_dtype is None else str(self.fp8_dtype), "has_history": self.has_history}

    def set_extra_state(self, state) -> None:
        fp8 = state.get("fp8_dtype")
        if fp8 is not None:
            loaded = getattr(torch, fp8.replace("torch.", ""))
            if self.fp8_dtype is not None and loaded != self.fp8_dtype:
                raise ValueError(
                    f"the checkpoint's delayed-scaling state was made for {loaded}, this one quantizes "
                    f"{self.fp8_dtype}: its scales would be wrong. Load it into a model of the same recipe format."
                )
            self.bind(loaded)
        self.has_history = bool(state.get("has_history", False))

    @property
    def fuses(self) -> bool:
        """Fused kernels can write it, but for a first step with an amax group (reduced before the cast)."""
        return self.has_history or self.amax_group is None

    def kernel_scale(self):
        """The scale of this step, or None on the first step (current scaling in the kernel)."""
        return self.scale if self.has_history else None

    def _quantize(self, x, with_transpose):
        self.bind(self.fp8_dtype or torch.float8_e4m3fn)
        if self.scale.device != x.device:
            raise ValueError(f"DelayedScalingState lives on {self.scale.device} but the input is on {x.device}")
        scale = self.kernel_scale()
        if scale is None and self.amax_group is not None:
            scale = scale_from_amax(_reduced_amax(x, self.amax_group), self.fp8_dtype, self.margin, self.power_of_2)
        data, data_t, scale_inv, amax = quantize_tensorwise(
            x, self.fp8_dtype, scale, self.margin, self.power_of_2, with_transpose
        )
        return self.finish(data, data_t, scale_inv, amax, x.dtype, with_transpose)

    def _after_kernel(self, scale_inv, amax):
        given = self.has_history
        self.record(amax)
        return _poison_if_non_finite(scale_inv, amax) if given else scale_inv

    @torch.no_grad()
    def record(self, amax: torch.Tensor) -> None:
        """Fold one amax into the history and compute the next scale, in place, on the device.

        With an amax group, the amax is reduced (MAX) over it first: at once, or, while a run defers the
        reductions (`deferred`, set by a Sequential), together with the run's other amaxes in one
        all-reduce at its end (`reduce_deferred`)."""
        if self.fp8_dtype is None:
            raise RuntimeError("DelayedScalingState.record before the state knows its format: bind(fp8_dtype) first")
        amax = amax.detach().float().reshape(())
        self.has_history = True
        if self.amax_group is not None and self.deferred is not None:
            self.deferred.append((self, amax.clone()))
            return
        if self.amax_group is not None:
            amax = all_reduce_amax(amax.clone(), self.amax_group)
        self.fold(amax)

    @torch.no_grad()
    def fold(self, amax: torch.Tensor) -> None:
        """Record an amax that is already reduced over the group: history and next scale, device ops only."""
        finite = torch.isfinite(amax)
        history = self.amax_history
        rolled = torch.roll(history, 1)
        rolled[0] = torch.where(finite, amax, 0.0)
        history.copy_(torch.where(finite, rolled, history))
        reduced = history.amax() if self.recipe.amax_compute_algo == "max" else history[0]
        candidate = scale_from_amax(reduced, self.fp8_dtype, self.recipe.margin, self.recipe.power_of_2)
        self.scale.copy_(torch.where(finite, candidate, self.scale))

    def update(self, amax: torch.Tensor, fp8_dtype=None) -> None:
        """`record`, binding the format first if given (the older name of this method)."""
        if fp8_dtype is not None:
            self.bind(fp8_dtype)
        self.record(amax)

    def extra_repr(self) -> str:
        return f"{self.recipe!r}, fp8_dtype={self.fp8_dtype}"


def _check_delayed_state(state_dict, prefix: str) -> None:
    """Refuse a delayed-scaling state that no run could have written: a history entry that is negative or
    not finite (only finite amaxes are recorded), or a scale that is inf, <= 0, outside the format's range,
    or NaN once a finite amax was recorded. Such a state would cast every later tensor with a wrong scale and give
    finite, wrong outputs. A tensor on a GPU is checked on the device instead of read (no sync): an invalid
    state becomes a NaN scale there, so the outputs come out NaN, never finite and wrong."""
    history, scale = state_dict.get(prefix + "amax_history"), state_dict.get(prefix + "scale")
    extra = state_dict.get(prefix + "_extra_state") or {}
    recorded = bool(extra.get("has_history", False)) if isinstance(extra, dict) else False
    fp8 = extra.get("fp8_dtype") if isinstance(extra, dict) else None
    lo = min(min_scale(torch.float8_e4m3fn), min_scale(torch.float8_e5m2))
    if fp8 is not None:
        lo = min_scale(getattr(torch, fp8.replace("torch.", "")))
    if not isinstance(history, torch.Tensor) or not isinstance(scale, torch.Tensor):
        return  # a missing key: load_state_dict reports it
    h, sc = history.detach().float(), scale.detach().float().reshape(())
    history_ok = (torch.isfinite(h) & (h >= 0)).all()
    # NaN is "no scale yet": before any step, or after steps whose amaxes were all non-finite (none recorded).
    scale_ok = ((sc >= lo) & (sc <= FLOAT32_MAX)) | (torch.isnan(sc) & (not recorded or (h == 0).all()))
    if h.device.type == "cpu" and sc.device.type == "cpu":
        if not bool(history_ok):
            raise ValueError(f"{prefix}amax_history holds a negative or non-finite amax: not a state a run writes")
        if not bool(scale_ok):
            raise ValueError(
                f"{prefix}scale is {float(sc)!r}: a delayed-scaling scale must be in [{lo:.3g}, {FLOAT32_MAX:.3g}] "
                "(or NaN before the first step is recorded)"
            )
        return
    state_dict[prefix + "scale"] = torch.where(history_ok & scale_ok, sc, torch.full_like(sc, float("nan")))


def reduce_deferred(pending: list) -> None:
    """Reduce the amaxes that delayed states deferred during a run, one all-reduce per process group (one
    for a Sequential's whole step), and fold each into its state. `pending`: [(state, amax)], emptied."""
    by_group = {}
    for state, amax in pending:
        by_group.setdefault(id(state.amax_group), []).append((state, amax))
    pending.clear()
    for entries in by_group.values():
        amaxes = all_reduce_amax(torch.stack([a for _, a in entries]), entries[0][0].amax_group)
        for (state, _), amax in zip(entries, amaxes):
            state.fold(amax)


class LinearQuantizers(NamedTuple):
    """The three quantizers of a Linear: its input, its weight and its output gradient."""

    input: Quantizer
    weight: Quantizer
    grad: Quantizer


def quantizer_for(scaling, fp8_dtype=None, *, device=None, amax_group=None) -> Quantizer:
    """The quantizer of one scaling dataclass (or a quantizer, returned as it is) for `fp8_dtype`."""
    if isinstance(scaling, DelayedScalingState):
        scaling.bind(fp8_dtype or scaling.fp8_dtype or torch.float8_e4m3fn)
        return scaling
    if isinstance(scaling, Quantizer):
        if fp8_dtype is not None and fp8_dtype != scaling.fp8_dtype:
            raise ValueError(f"the quantizer writes {scaling.fp8_dtype}, not the requested {fp8_dtype}")
        return scaling
    fp8_dtype = fp8_dtype or torch.float8_e4m3fn
    if isinstance(scaling, TensorwiseScaling):
        return TensorwiseQuantizer(fp8_dtype, margin=scaling.margin, power_of_2=scaling.power_of_2, amax_group=amax_group)
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
        if device is None:
            raise TypeError(
                "DelayedScaling is a recipe without state; quantize with scaling=DelayedScalingState(recipe), "
                "which keeps the amax history"
            )
        return DelayedScalingState(scaling, device=device, fp8_dtype=fp8_dtype, amax_group=amax_group)
    raise TypeError(
        f"scaling must be a float8 scaling recipe, a quantizer or a DelayedScalingState, got {type(scaling).__name__}"
    )


def recipe_quantizers(recipe, *, device=None, amax_group=None) -> LinearQuantizers:
    """The (input, weight, grad) quantizers a recipe describes; delayed ones are new state modules."""
    fwd, bwd = recipe.format.forward_dtype, recipe.format.backward_dtype
    dev = torch.device("cpu") if device is None else device
    return LinearQuantizers(
        quantizer_for(recipe.input, fwd, device=dev, amax_group=amax_group),
        quantizer_for(recipe.weight, fwd, device=dev, amax_group=amax_group),
        quantizer_for(recipe.grad, bwd, device=dev, amax_group=amax_group),
    )


def quantizer_from_args(fp8_dtype, scale, scaling) -> Quantizer:
    """The quantizer behind `Float8Tensor.quantize(x, fp8_dtype, scale=..., scaling=...)`."""
    if scale is not None:
        if scaling is not None:
            raise ValueError("pass either scale= (static scaling) or scaling=, not both")
        return StaticQuantizer(scale, fp8_dtype or torch.float8_e4m3fn)
    return quantizer_for(TensorwiseScaling() if scaling is None else scaling, fp8_dtype)


def layout_quantizer(t: Float8Tensor) -> Quantizer:
    """The quantizer that reproduces t's own scale layout (for in-place writes that re-quantize t)."""
    s, shape, fp8 = t._scale_inv, t._data.shape, t.fp8_dtype
    if s.dim() == 0:
        return TensorwiseQuantizer(fp8)
    blocks = block_shape(shape, s.shape)
    if s.shape[-1] == 1 and all(b == 1 for b in blocks[:-1]):
        return RowwiseQuantizer(fp8)
    if blocks[-1] == 128 and all(b == 1 for b in blocks[:-1]):
        return BlockwiseQuantizer(fp8, block=(1, 128))
    if blocks == (128, 128):
        return BlockwiseQuantizer(fp8, block=(128, 128))
    if len(shape) >= 2 and blocks[-1] == 1 and (len(blocks) < 2 or blocks[-2] > 1):
        raise ValueError(
            f"in-place op on a transposed row-wise or block-scaled Float8Tensor (scale_inv {tuple(s.shape)} for "
            f"data {tuple(shape)}): its scales run along the columns, and re-quantizing would change its layout. "
            "Write the untransposed tensor, or work on t.dequantize()"
        )
    raise ValueError(f"no quantizer writes a scale_inv of shape {tuple(s.shape)} for data {tuple(shape)}")


def requantize_into(dst: Float8Tensor, src: torch.Tensor) -> None:
    """Write high-precision `src` into FP8 `dst` in place: same format and layout, fresh scale.

    dst's buffers are written, not replaced, so views and optimizer references stay valid; a cached
    transpose is re-derived from the new bits. dst must be a whole tensor, not a slice of one.
    """
    from float8.tensor import check_whole, mark_written

    check_whole(dst)
    quantizer = layout_quantizer(dst)
    if tuple(src.shape) != tuple(dst.shape):
        src = src.expand(dst.shape)
    with torch.no_grad():
        fresh = quantizer._quantize(src.to(dst.dtype), False)
        dst._data.copy_(fresh._data)
        dst._scale_inv.copy_(fresh._scale_inv)
        if dst._transpose_raw is not None:
            dst._transpose_raw.copy_(fresh._data.transpose(-2, -1))
    mark_written(dst)


__all__ = [
    "Quantizer",
    "ScaleLayout",
    "TensorwiseQuantizer",
    "StaticQuantizer",
    "StaticScalingState",
    "RowwiseQuantizer",
    "BlockwiseQuantizer",
    "DelayedScalingState",
    "LinearQuantizers",
    "quantizer_for",
    "recipe_quantizers",
    "requantize_into",
]


@dataclass(frozen=True)
class QuantRequest:
    """What a consumer wants its input (or gradient) as: its quantizer, and whether a transpose is needed.

    A producer with a fused kernel (norm, activation, bias backward) honours it when `fuses`: it calls its
    kernel with `fp8_dtype`, `kernel_scale()`, `margin`, `power_of_2`, `with_transpose` and hands the outputs to
    `finish`. Otherwise it writes high precision and calls `quantize`.
    """

    quantizer: Quantizer
    with_transpose: bool

    @property
    def fuses(self) -> bool:
        """Whether the producer's kernel can write this form itself (the quantizer's answer)."""
        return self.quantizer.fuses

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The FP8 format to write."""
        return self.quantizer.fp8_dtype

    @property
    def margin(self) -> int:
        """The margin of current scaling (scale divided by 2**margin)."""
        return self.quantizer.margin

    @property
    def power_of_2(self) -> bool:
        """Whether current scaling rounds the scale down to a power of two."""
        return self.quantizer.power_of_2

    def kernel_scale(self) -> Optional[torch.Tensor]:
        """The scale to cast with, or None: the kernel computes the amax (current scaling)."""
        return self.quantizer.kernel_scale()

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        """Quantize a high-precision output the producer could not write in FP8 itself."""
        return self.quantizer._quantize(x, self.with_transpose)

    def finish(self, data, data_t, scale_inv, amax, nominal_dtype) -> Float8Tensor:
        """The Float8Tensor from the producer kernel's outputs (after the quantizer's amax bookkeeping)."""
        return self.quantizer.finish(data, data_t, scale_inv, amax, nominal_dtype, self.with_transpose)
