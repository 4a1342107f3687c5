"""Activations share one base; each subclass only names its kernel kind.

Forward: followed by a Linear, the activation kernel writes FP8 (and the transpose, if the Linear's
backward reads it) directly, when the Linear's input quantizer `fuses`. Backward: preceded by a Linear,
dact and the gradient's FP8 cast-transpose run in one kernel (with dbias too, when a Bias sits between
them: see ops/fusion.py).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from float8.kernels.activation import SAVED_X_DTYPE, act_bwd, act_fp8, act_fp8_save_input, act_fwd, dact_fp8
from float8.kernels.quantize import quantize_tensorwise
from float8.ops.base import BasicOp, OpContext, QuantRequest, RunState, plain, take

# The kinds that keep an E4M3 copy of their input under Recipe(lean_activations=True): smooth derivatives,
# so rounding the input moves the gradient by about the input's own rounding. ReLU's derivative jumps at 0.
LEAN_KINDS = ("gelu", "gelu_tanh", "silu", "swiglu")


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(
            f"SwiGLU takes x (..., 2H) = [gate | linear] and needs an even last dim, got shape {tuple(x.shape)}"
        )
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# The plain-torch twin of each kind (BasicOp.torch_forward), in x's dtype: torch rounds after each function,
# the kernels once, from float32 registers (SwiGLU's silu(gate) * up: twice against once).
TORCH_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swiglu": _swiglu,
}


class Activation(BasicOp):
    """Base of the elementwise activations: y = act(x (+ bias, when fused with a Bias before it)).

    x: (..., N) float32/bfloat16/float16; y: x's shape and dtype (SwiGLU: (..., N/2)), or FP8 for a Linear
    after it in a Sequential. Computed in float32 registers.
    """

    fusion_role, saves = "activation", ("saved", "x_scale_inv", "bias")

    kind: str = ""

    def __init__(self, *, recipe=None):
        super().__init__()
        self.set_recipe(recipe)

    def activation_forward(
        self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest], bias: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """act(x + bias): FP8 from the activation kernel itself when out_request's quantizer fuses.

        Saves x (before the bias: the backward kernel adds it again) for the backward; under
        Recipe(lean_activations=True) an E4M3 copy of it with its scale-inverse (LEAN_KINDS)."""
        x = plain(x)
        r = out_request
        lean = ctx.run.grad and self.kind in LEAN_KINDS and self.recipe.lean_activations
        x_scale_inv = None
        if r is not None and r.fuses:
            args = (x, self.kind, bias, r.fp8_dtype, r.kernel_scale(), r.margin, r.power_of_2, r.with_transpose)
            if lean:
                data, data_t, scale_inv, amax, saved_x, x_scale_inv = act_fp8_save_input(*args)
            else:
                (data, data_t, scale_inv, amax), saved_x = act_fp8(*args), x
            y = r.finish(data, data_t, scale_inv, amax, x.dtype)
        else:
            y = act_fwd(x, self.kind, bias)
            if r is not None:
                y = r._quantize(y)
            saved_x = x
            if lean:
                saved_x, _, x_scale_inv, _ = quantize_tensorwise(x, SAVED_X_DTYPE)
        ctx.saved, ctx.x_scale_inv, ctx.bias = saved_x, x_scale_inv, bias
        return y

    def activation_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest], want_dbias: bool = False
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(dx, dbias or None): fused with dbias and the FP8 cast-transpose where the consumer wants FP8."""
        x, x_scale_inv, bias = take(ctx, "saved", "x_scale_inv", "bias")
        dy = plain(dy)
        r = dx_request
        if r is not None and r.fuses:
            data, data_t, scale_inv, amax, dbias = dact_fp8(
                dy,
                x,
                self.kind,
                bias,
                r.fp8_dtype,
                r.kernel_scale(),
                r.margin,
                r.power_of_2,
                r.with_transpose,
                want_dbias,
                x_scale_inv,
            )
            return r.finish(data, data_t, scale_inv, amax, dy.dtype), dbias if want_dbias else None
        dx = act_bwd(dy, x, self.kind, bias, x_scale_inv)
        dbias = dx.sum(0, dtype=torch.float32) if want_dbias else None
        if r is not None:
            dx = r._quantize(dx)
        return dx, dbias

    has_torch_forward = True

    def torch_forward(self, x: torch.Tensor, run: Optional[RunState] = None) -> torch.Tensor:
        return TORCH_ACTIVATIONS[self.kind](x)

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest] = None) -> torch.Tensor:
        return self.activation_forward(ctx, x, out_request)

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        dx, _ = self.activation_backward(ctx, dy, dx_request)
        return dx, []


class GELU(Activation):
    """GELU, erf form (torch.nn.functional.gelu's default); approximate="tanh" for the tanh form."""

    def __init__(self, *, approximate: str = "none", recipe=None):
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.kind = "gelu" if approximate == "none" else "gelu_tanh"
        super().__init__(recipe=recipe)


class ReLU(Activation):
    """max(x, 0), elementwise (NaN stays NaN, -0.0 stays -0.0, like torch.relu)."""

    kind = "relu"


class SiLU(Activation):
    """x * sigmoid(x), elementwise."""

    kind = "silu"


class SwiGLU(Activation):
    """silu(x[..., :H]) * x[..., H:] for input (..., 2H): output (..., H) (gate first, then the linear half)."""

    kind = "swiglu"
