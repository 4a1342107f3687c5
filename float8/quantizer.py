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

Where they live: the protocol (`Quantizer`, `ScaleLayout`) and the quantizers without state
(`TensorwiseQuantizer`, `StaticQuantizer`, `RowwiseQuantizer`, `BlockwiseQuantizer`) are defined in
float8/tensor.py, beside the tensor whose `quantize` builds them; this module adds the quantizers that keep
state in buffers (`StaticScalingState`, `DelayedScalingState`), a Linear's three (`LinearQuantizers`,
`quantizer_for`) and the request a consumer hands its producer (`QuantRequest`), and exports them all. It
imports float8/tensor.py and float8/scaling.py; float8/recipe.py imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

from float8.checks import (  # ScaleLayout and the checks: exported from here too, where ops import them
    ScaleLayout,
    _check_margin_for,
    _poison_if_non_finite,
    _reduced_amax,
    all_reduce_amax,
    check_amax_group,
    check_dense,
    dequantized_gemms,
    static_scale,
)
from float8.kernels import quantize_tensorwise
from float8.kernels.reference import FLOAT32_MAX, check_fp8_dtype, min_scale, quantize_tensorwise_ref, scale_from_amax
from float8.scaling import DelayedScaling, Scaling
from float8.tensor import (  # the protocol and the quantizers without state, exported from here too
    BlockwiseQuantizer,
    Float8Tensor,
    Quantizer,
    RowwiseQuantizer,
    StaticQuantizer,
    TensorwiseQuantizer,
    _quantizer_for,
)


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
        s = static_scale(scale, fp8_dtype, device)
        self.register_buffer("static_scale", s if device is None else s.to(device))

    @property
    def scale(self) -> torch.Tensor:
        """The scale (the `static_scale` buffer)."""
        return self.static_scale

    def kernel_scale(self) -> torch.Tensor:
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
            state_dict[key] = static_scale(loaded, self.fp8_dtype, None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def get_extra_state(self) -> dict[str, str]:
        """The format the scale was made for: what the buffer alone does not say."""
        return {"fp8_dtype": str(self.fp8_dtype)}

    def set_extra_state(self, state: dict[str, str]) -> None:
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

    def bind(self, fp8_dtype: torch.dtype) -> None:
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

    def _for_format(self, fp8_dtype) -> "DelayedScalingState":
        """This state, bound to `fp8_dtype` (None: its own format, else E4M3); another format is an error."""
        self.bind(fp8_dtype or self.fp8_dtype or torch.float8_e4m3fn)
        return self

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

    def get_extra_state(self) -> dict[str, Union[str, bool, None]]:
        """The format and whether a step was recorded: what the buffers alone do not say."""
        return {"fp8_dtype": None if self.fp8_dtype is None else str(self.fp8_dtype), "has_history": self.has_history}

    def set_extra_state(self, state: dict[str, Union[str, bool, None]]) -> None:
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

    def kernel_scale(self) -> Optional[torch.Tensor]:
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


def quantizer_for(
    scaling: Union[Scaling, Quantizer],
    fp8_dtype: Optional[torch.dtype] = None,
    *,
    device: Union[torch.device, str, None] = None,
    amax_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Quantizer:
    """The quantizer of one scaling dataclass (or a quantizer, returned as it is) for `fp8_dtype`.

    A DelayedScaling gives a new DelayedScalingState on `device` (without a device it is refused: a
    delayed recipe needs a state that someone owns)."""
    if isinstance(scaling, DelayedScaling) and device is not None:
        fp8_dtype = fp8_dtype or torch.float8_e4m3fn
        return DelayedScalingState(scaling, device=device, fp8_dtype=fp8_dtype, amax_group=amax_group)
    return _quantizer_for(scaling, fp8_dtype, amax_group=amax_group)


def quantize_in_torch_ops(quantizer: TensorwiseQuantizer, x: torch.Tensor, with_transpose: bool) -> Float8Tensor:
    """What `quantizer._quantize(x, with_transpose)` gives, computed by torch operations (the reference
    the kernels are tested bit-exact against, kernels/reference.py) instead of a kernel: torch.compile can
    fuse them with the code that makes x and recompute them in a backward from tensors it keeps anyway,
    which it cannot do through a kernel. Current scaling without an amax group only."""
    if type(quantizer) is not TensorwiseQuantizer or quantizer.amax_group is not None:
        raise ValueError(f"quantize_in_torch_ops takes current per-tensor scaling without a group, got {quantizer!r}")
    q = quantizer
    data, data_t, scale_inv, _ = quantize_tensorwise_ref(x, q.fp8_dtype, None, q.margin, q.power_of_2, with_transpose)
    return q.finish(data, data_t, scale_inv, None, x.dtype, with_transpose)


__all__ = [
    "quantize_in_torch_ops",
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
    "check_amax_group",
    "check_dense",
    "dequantized_gemms",
]


@dataclass(frozen=True)
class QuantRequest:
    """What a consumer wants its input (or gradient) as: its quantizer, and whether a transpose is needed.

    A producer with a fused kernel (norm, activation, bias backward) honours it when `fuses`: it calls its
    kernel with `fp8_dtype`, `kernel_scale()`, `margin`, `power_of_2`, `with_transpose` and hands the outputs to
    `finish`. Otherwise it writes high precision and calls `_quantize`.
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

    def _quantize(self, x: torch.Tensor) -> Float8Tensor:
        """A high-precision output the producer could not write in FP8 itself, quantized as requested (the
        quantizer's `_quantize`: for ops, inside their autograd Functions)."""
        return self.quantizer._quantize(x, self.with_transpose)

    def finish(
        self,
        data: torch.Tensor,
        data_t: torch.Tensor,
        scale_inv: torch.Tensor,
        amax: Optional[torch.Tensor],
        nominal_dtype: torch.dtype,
    ) -> Float8Tensor:
        """The Float8Tensor from the producer kernel's outputs (after the quantizer's amax bookkeeping)."""
        return self.quantizer.finish(data, data_t, scale_inv, amax, nominal_dtype, self.with_transpose)
