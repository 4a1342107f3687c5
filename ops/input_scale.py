"""A Linear's static input scale: the checks and the arithmetic of `ops.set_input_scale`, and the install of a
`StaticScalingState` input quantizer. Kept apart from ops/calibrate.py, which runs models, so that
ops/linear.py can install a loaded scale without importing the calibration (which imports it)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from float8 import Float8Tensor, TensorwiseScaling
from float8.kernels.reference import scale_from_amax
from float8.quantizer import ScaleLayout, StaticScalingState, _check_margin_for


def fix_input_scale(
    linear: torch.nn.Module,
    *,
    scale: Union[float, torch.Tensor, None] = None,
    amax: Union[float, torch.Tensor, None] = None,
    margin: Optional[int] = None,
) -> StaticScalingState:
    """`ops.set_input_scale` after its argument checks (ops/calibrate.py): the Linear's new static input
    quantizer, from exactly one of `scale` and `amax`."""
    reason = _not_per_tensor(linear)
    if reason is not None:
        raise ValueError(f"set_input_scale: {reason}")
    fp8, margin, power_of_2 = _scale_args(linear, margin)
    _check_margin(margin, fp8)
    if amax is not None:
        scale = _scale_for(_amax_tensor(amax), fp8, margin, power_of_2)
    return _install(linear, scale)


def _not_per_tensor(linear) -> Optional[str]:
    """Why `linear`'s input cannot take one static scale, or None."""
    q = linear.input_quantizer
    if q.layout is ScaleLayout.TENSOR:
        return None
    return f"its input scaling is per {q.layout.value} ({type(q).__name__}); a static scale is one per tensor"


def _input_dtype(linear) -> torch.dtype:
    """The FP8 dtype of the Linear's input."""
    return getattr(linear.input_quantizer, "fp8_dtype", None) or linear.recipe.format.forward_dtype


def _scale_args(linear, margin: Optional[int]):
    """The arguments of `_scale_for` after the amax: (input FP8 dtype, margin (None: the recipe's input
    margin), the recipe's power_of_2)."""
    if margin is None:
        margin = int(getattr(linear.recipe.input, "margin", 0))
    return _input_dtype(linear), margin, bool(getattr(linear.recipe.input, "power_of_2", False))


def _check_margin(margin, fp8_dtype, fqn: Optional[str] = None) -> None:
    TensorwiseScaling(margin)  # an int in [0, 32]
    try:
        _check_margin_for(fp8_dtype, margin)
    except ValueError as e:
        raise ValueError(f"{fqn}: {e}" if fqn else str(e)) from None


def _amax_tensor(amax) -> torch.Tensor:
    """A () float32 tensor of a user's amax; on the CPU, ValueError unless finite and >= 0."""
    if isinstance(amax, torch.Tensor):
        if amax.numel() != 1 or isinstance(amax, Float8Tensor):
            raise ValueError(f"amax must hold one value (per-tensor scaling), got shape {tuple(amax.shape)}")
        a = amax.detach().float().reshape(())
    else:
        a = torch.tensor(float(amax), dtype=torch.float32)
    if a.device.type == "cpu" and not (torch.isfinite(a) and a >= 0):
        raise ValueError(f"amax must be a finite value >= 0, got {float(a)!r}")
    # A device value is not read on the host: a negative one gives a NaN scale (as inf and NaN do), never
    # the scale 1 of amax 0.
    return torch.where(a >= 0, a, torch.full_like(a, float("nan")))


def _scale_for(amax: torch.Tensor, fp8_dtype, margin: int, power_of_2: bool) -> torch.Tensor:
    """The library's rule (kernels/reference.py): the scale current scaling casts with for this amax."""
    return scale_from_amax(amax, fp8_dtype, margin, power_of_2)


def _install(linear, scale) -> StaticScalingState:
    """Make a StaticScalingState of `scale` the Linear's input quantizer (a submodule: in its state dict)."""
    old = linear.input_quantizer
    fp8 = _input_dtype(linear)
    q = StaticScalingState(scale, fp8, device=linear.weight.device, amax_group=old.amax_group)
    linear._modules.pop("input_quantizer", None)
    linear.input_quantizer = q  # nn.Module.__setattr__ registers it and drops a plain quantizer attribute
    return q
