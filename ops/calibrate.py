"""Static input scales for FP8 inference: fixed once from real data, so a forward casts each Linear input
with one kernel and a given scale, instead of an amax pass first (current scaling).

    model = ops.convert(model, fp8_weights=True)
    report = ops.calibrate(model, batches)          # every Linear's input: scale = fp8_max / max|input|
    torch.save(model.state_dict(), path)            # the scales are in it
    fresh = ops.convert(build(), fp8_weights=True)
    ops.load_input_scales(fresh, state_dict); fresh.load_state_dict(state_dict)   # strict

- `calibrate(model, batches)` runs the model on each batch under no_grad, in eval mode, with a forward
  pre-hook on each selected `ops.Linear` that keeps the running max of |input| on the device; then it gives
  each of those Linears a `StaticScalingState` input quantizer (float8/quantizer.py) with the scale current
  scaling would derive from that amax (`scale_from_amax`, the same bits), divided by 2**margin.
- `set_input_scale(linear, scale=... | amax=...)`: the same for one Linear, from a number you have.
- `load_input_scales(model, state_dict)`: before `model.load_state_dict(state_dict)`, gives the Linears whose
  static scale the state dict holds a static input quantizer, so that a strict load into a freshly converted
  (uncalibrated) model works.

A static scale saturates inputs larger than the calibration's amax (times 2**margin) to the FP8 maximum;
an input holding inf or NaN still comes out non-finite (its scale-inverse is NaN: StaticQuantizer's
contract). Only the input quantizer changes: weights and gradients keep their recipe, a calibrated Linear
still trains (gradients flow, its input is cast with the fixed scale), and it runs under torch.compile.
Changing the Linear's recipe or amax group afterwards (`set_recipe(..., overwrite=True)`, or a Sequential
handing its recipe to a Linear built without one) rebuilds its quantizers from the recipe, dropping the
static scale.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import torch

from float8 import Float8Tensor
from float8.kernels import amax as amax_kernel
from float8.ops.base import BasicOp
from float8.ops.input_scale import (
    _check_margin,
    _input_dtype,
    _install,
    _not_per_tensor,
    _scale_args,
    _scale_for,
    fix_input_scale,
)
from float8.ops.linear import STATIC_SCALE_KEY as SCALE_KEY
from float8.ops.linear import Linear
from float8.ops.sequential import Sequential
from float8.quantizer import StaticScalingState, all_reduce_amax

__all__ = ["CalibrationReport", "calibrate", "load_input_scales", "set_input_scale"]


@dataclass(frozen=True)
class CalibrationReport:
    """What `calibrate` did, keyed by the Linears' fully qualified names (`model.named_modules()` order).

    amax: max |input| over all batches of each calibrated Linear (after the reduction over its amax group).
    scales: the static input scale it was given (float32 value, as a float).
    skipped: the selected Linears that keep their recipe's input quantizer, each with the reason.
    margin: the margin asked for (None: each Linear's recipe margin). batches: how many batches ran.
    """

    amax: Dict[str, float]
    scales: Dict[str, float]
    skipped: Dict[str, str]
    margin: Optional[int]
    batches: int


def set_input_scale(
    linear: Linear,
    *,
    scale: Union[float, torch.Tensor, None] = None,
    amax: Union[float, torch.Tensor, None] = None,
    margin: Optional[int] = None,
) -> StaticScalingState:
    """Fix `linear`'s input scale: give it a `StaticScalingState` input quantizer, and return that.

    Exactly one of `scale` (the scale itself: fp8_max / amax as you derived it) or `amax` (max |input| you
    measured: the scale is then the one current scaling derives from it, divided by 2**margin (None: the
    margin of the Linear's recipe for its input), and rounded down to a power of two if the recipe asks for
    power_of_2). A number or a one-element float32
    tensor; on the CPU an invalid value (a non-finite or negative amax, a scale out of range) raises
    ValueError. The quantizer is on the weight's device, in the recipe's input format, and keeps the amax
    group of the quantizer it replaces (give every rank of that group the same value).
    """
    if not isinstance(linear, Linear):
        raise TypeError(f"set_input_scale takes a float8.ops.Linear, got {type(linear).__name__}")
    if (scale is None) == (amax is None):
        raise ValueError("set_input_scale needs exactly one of scale= or amax=")
    if scale is not None and margin:
        raise ValueError("margin applies to amax=; a given scale= is used as it is")
    return fix_input_scale(linear, scale=scale, amax=amax, margin=margin)


def calibrate(
    model: torch.nn.Module,
    batches: Iterable[Any],
    *,
    margin: Optional[int] = None,
    filter_fn: Optional[Callable[[torch.nn.Module, str], bool]] = None,
    forward: Optional[Callable[[torch.nn.Module, Any], Any]] = None,
) -> CalibrationReport:
    """Fix the input scale of each `ops.Linear` of `model` from the inputs it sees on `batches`.

    batches: an iterable of inputs, read once (a generator works). Each batch runs as `forward(model, batch)`
        when `forward` is given; else a tuple is passed as positional arguments (`model(*batch)`), a mapping
        as keyword arguments (`model(**batch)`), anything else, a list included, as the one argument
        (`model(batch)`). Outputs are dropped.
    margin: each scale is fp8_max / amax / 2**margin (headroom for inputs larger than the calibration's);
        None (the default): each Linear's recipe margin for its input, so the scale is the one current
        scaling of that recipe would derive from the amax.
    A torch.compile'd model is calibrated through the module it wraps, run eagerly (dynamo does not see
    forward hooks added after it compiled); the compiled model then recompiles for the new quantizers.
    filter_fn(module, fqn) -> bool: picks the Linears (default: all), as in `ops.convert`.

    The model runs under torch.no_grad and in eval mode; each module's training flag is restored after.
    Each selected Linear gets scale = scale_from_amax(amax, fp8 format, margin, the recipe's power_of_2),
    where amax = max |input| over all batches (reduced with MAX over the Linear's amax group first, if it has
    one): the bits current scaling derives from that amax. amax 0 gives scale 1 (the library's rule).
    Nothing is changed unless every selected Linear can be calibrated. Raises ValueError naming the layer for
    a Linear that saw no input (a branch the batches never reach: leave it out with filter_fn), and for a
    non-finite amax (inf or NaN activations in the calibration set: a bug to fix, not a scale to derive).
    Skipped, and listed with the reason in the report (they keep their recipe's input quantizer): Linears
    whose input scaling is per row or per block, and Linears an `ops.Sequential` runs as its own ops (without
    their forward, so no hook sees their input: use `set_input_scale` with an amax you measured; a plain
    module inside a Sequential runs its forward, and its Linears are calibrated).
    Raises ValueError if no Linear is left to calibrate.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"calibrate takes an nn.Module, got {type(model).__name__}")
    if isinstance(batches, torch.Tensor):
        raise TypeError(
            "calibrate takes an iterable of batches, got a tensor (iterating it would feed its rows one by "
            "one): pass [x] for a single batch"
        )
    model = getattr(model, "_orig_mod", model)  # an OptimizedModule of torch.compile: its module, eagerly
    run = forward if forward is not None else _call
    selected, skipped = _select(model, filter_fn)
    if not selected:
        why = "; ".join(f"{k}: {v}" for k, v in skipped.items()) or "it holds no float8.ops.Linear"
        raise ValueError(f"calibrate: no Linear of the model can be calibrated ({why})")
    for fqn, linear in selected.items():
        _check_margin(_scale_args(linear, margin)[1], _input_dtype(linear), fqn)

    running = {fqn: _Running(linear) for fqn, linear in selected.items()}
    handles = [linear.register_forward_pre_hook(running[fqn], with_kwargs=True) for fqn, linear in selected.items()]
    modes = [(m, m.training) for m in model.modules()]
    count = 0
    try:
        model.eval()
        with torch.no_grad():
            for batch in batches:
                run(model, batch)
                count += 1
    finally:
        for h in handles:
            h.remove()
        for m, training in modes:
            m.training = training

    amaxes = {fqn: r.reduced() for fqn, r in running.items()}
    scales = {fqn: _scale_for(amaxes[fqn], *_scale_args(linear, margin)) for fqn, linear in selected.items()}
    on_host = _to_host({fqn: torch.stack([amaxes[fqn], scales[fqn]]) for fqn in selected})  # the host sync
    amax_values = {fqn: a for fqn, (a, _) in on_host.items()}
    _check_amaxes(amax_values, count)
    for fqn, linear in selected.items():
        _install(linear, scales[fqn])
    return CalibrationReport(amax_values, {fqn: s for fqn, (_, s) in on_host.items()}, skipped, margin, count)


def load_input_scales(model: torch.nn.Module, state_dict: Mapping) -> List[str]:
    """Before `model.load_state_dict(state_dict)`: give each Linear whose static input scale `state_dict`
    holds (a checkpoint of a calibrated model) a static input quantizer with that scale, so that a strict
    load into a freshly converted model works. Returns the names of those Linears.

    Linears of the model the state dict has no static scale for keep what they have: a calibrated model
    then refuses a strict load of an uncalibrated checkpoint (missing `...input_quantizer.static_scale`
    keys) rather than keeping scales the checkpoint does not have.
    """
    names = []
    for key in state_dict:
        if key != SCALE_KEY and not key.endswith("." + SCALE_KEY):
            continue
        fqn = key[: -len(SCALE_KEY)].rstrip(".")
        try:
            linear = model.get_submodule(fqn)
        except AttributeError as e:
            raise ValueError(
                f"load_input_scales: the state dict has a static scale for {fqn!r}, which the model lacks"
            ) from e
        if not isinstance(linear, Linear):
            raise ValueError(
                f"load_input_scales: the state dict has a static scale for {fqn!r}, which is a "
                f"{type(linear).__name__} in this model, not a float8.ops.Linear (convert the model first)"
            )
        set_input_scale(linear, scale=state_dict[key])
        names.append(fqn or "<root>")
    return names


# ---- the pieces ------------------------------------------------------------------------------------------


def _call(model: torch.nn.Module, batch):
    """model(*batch) for a tuple, model(**batch) for a mapping, else model(batch)."""
    if isinstance(batch, tuple):
        return model(*batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(batch)


class _Running:
    """A forward pre-hook keeping the running max |input| of one Linear, on the device (no host sync).

    -1 until an input is seen: a value no amax takes, which survives a MAX reduction only where no rank of
    the group saw an input (so every rank raises together, instead of one rank leaving a collective)."""

    def __init__(self, linear: Linear):
        self.group = linear.input_quantizer.amax_group
        self.amax = torch.full((), -1.0, dtype=torch.float32, device=linear.weight.device)

    def __call__(self, module, args, kwargs):
        x = args[0] if args else kwargs.get("x")
        if not isinstance(x, torch.Tensor):
            return None  # the Linear's own forward names the problem
        x = x.dequantize() if isinstance(x, Float8Tensor) else x.detach()
        # The library's amax (NaN if x holds a NaN, like current scaling's); max keeps a NaN too.
        self.amax = torch.maximum(self.amax, amax_kernel(x).to(self.amax.device))
        return None

    def reduced(self) -> torch.Tensor:
        """The running amax, reduced with MAX over the Linear's amax group if it has one."""
        if self.group is None:
            return self.amax
        return all_reduce_amax(self.amax.clone(), self.group)


def _select(model: torch.nn.Module, filter_fn):
    """({fqn: Linear} to calibrate, {fqn: reason} of selected Linears that are skipped)."""
    run_by = _run_by_a_sequential(model)
    selected, skipped = {}, {}
    for fqn, module in model.named_modules():
        if not isinstance(module, Linear) or (filter_fn is not None and not filter_fn(module, fqn)):
            continue
        name = fqn or "<root>"
        if id(module) in run_by:
            skipped[name] = (
                f"run by the ops.Sequential {run_by[id(module)]!r} without its forward, so no hook sees its "
                "input (ops.set_input_scale takes an amax you measured)"
            )
            continue
        reason = _not_per_tensor(module)
        if reason is not None:
            skipped[name] = reason
            continue
        selected[name] = module
    return selected, skipped


def _run_by_a_sequential(model: torch.nn.Module) -> Dict[int, str]:
    """{id(Linear): fqn of the ops.Sequential} for the Linears a Sequential runs as basic ops (never calling
    their forward). A plain module inside a Sequential runs its own forward: its Linears are not listed."""
    found = {}
    for fqn, module in model.named_modules():
        if isinstance(module, Sequential):
            for op in module.ops:
                for basic in op.expand() if isinstance(op, BasicOp) else ():
                    if isinstance(basic, Linear):
                        found.setdefault(id(basic), fqn or "<root>")
    return found


def _to_host(values: Dict[str, torch.Tensor]) -> Dict[str, list]:
    """{fqn: list of floats} of equally shaped tensors, with one transfer per device (one in all, as a rule)."""
    by_device: Dict[torch.device, List[str]] = {}
    for fqn, t in values.items():
        by_device.setdefault(t.device, []).append(fqn)
    out = {}
    for names in by_device.values():
        out.update(zip(names, torch.stack([values[n] for n in names]).tolist()))
    return {fqn: out[fqn] for fqn in values}


def _check_amaxes(amax: Dict[str, float], batches: int) -> None:
    """ValueError naming the Linears that saw no input, then those whose amax is not finite."""
    unseen = [fqn for fqn, a in amax.items() if a < 0]
    if unseen:
        raise ValueError(
            f"calibrate: {len(unseen)} Linear(s) saw no input in {batches} batch(es): {', '.join(unseen)}. "
            "Leave them out with filter_fn, or give them batches that reach them; nothing was changed"
        )
    bad = [f"{fqn} (amax {a})" for fqn, a in amax.items() if not math.isfinite(a)]
    if bad:
        raise ValueError(
            f"calibrate: non-finite inputs (inf or NaN) reached {', '.join(bad)}: the calibration batches "
            "overflow; a scale cannot be derived from them. Nothing was changed"
        )
