"""Activations share one base; each subclass only names its kernel kind.

Forward: followed by a Linear, the activation kernel writes FP8 (and the transpose, if the Linear's
backward reads it) directly. Backward: preceded by a Linear, dact and the gradient's FP8 cast-transpose
run in one kernel (with dbias too, when a Bias sits between them: see ops/fusion.py).
"""

from __future__ import annotations

import torch

from float8.kernels import activation as K
from float8.ops.base import BasicOp, OpContext, is_delayed, plain, wrap_fp8


class Activation(BasicOp):
    kind: str = ""

    def __init__(self, recipe=None):
        super().__init__()
        self.set_recipe(recipe)

    def activation_forward(self, ctx: OpContext, x, out_request, bias=None):
        x = plain(x)
        if out_request is None:
            y = K.act_fwd(x, self.kind, bias)
        elif is_delayed(out_request):
            st = out_request.scaling
            data, data_t, scale_inv, amax = K.act_fp8_scaled(
                x, self.kind, bias, st.scale, out_request.fp8_dtype, out_request.with_transpose
            )
            st.update(amax, out_request.fp8_dtype)
            y = wrap_fp8(out_request, data, data_t, scale_inv, x.dtype)
        else:
            s = out_request.scaling
            data, data_t, scale_inv, _ = K.act_fp8(
                x, self.kind, bias, out_request.fp8_dtype, s.margin, s.power_of_2, out_request.with_transpose
            )
            y = wrap_fp8(out_request, data, data_t, scale_inv, x.dtype)
        ctx.saved, ctx.bias = x, bias  # x before the bias: the backward kernel adds it again
        return y

    def activation_backward(self, ctx: OpContext, dy, dx_request, want_dbias=False):
        """(dx, dbias or None): fused with dbias and the FP8 cast-transpose where the consumer wants FP8."""
        x, bias = ctx.saved, ctx.bias
        ctx.saved = ctx.bias = None
        dy = plain(dy)
        if dx_request is not None and not is_delayed(dx_request):
            s = dx_request.scaling
            data, data_t, scale_inv, _, dbias = K.dact_dbias_cast_transpose(
                dy, x, self.kind, bias, dx_request.fp8_dtype, s.margin, s.power_of_2, want_dbias
            )
            return wrap_fp8(dx_request, data, data_t, scale_inv, dy.dtype), dbias if want_dbias else None
        dx = K.act_bwd(dy, x, self.kind, bias)
        dbias = dx.sum(0, dtype=torch.float32) if want_dbias else None
        if dx_request is not None:
            dx = dx_request.quantize(dx)
        return dx, dbias

    def op_forward(self, ctx: OpContext, x, out_request=None):
        return self.activation_forward(ctx, x, out_request)

    def op_backward(self, ctx: OpContext, dy, dx_request=None):
        dx, _ = self.activation_backward(ctx, dy, dx_request)
        return dx, []


class GELU(Activation):
    """GELU, erf form (torch.nn.functional.gelu's default); approximate="tanh" for the tanh form."""

    def __init__(self, approximate: str = "none", recipe=None):
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.kind = "gelu" if approximate == "none" else "gelu_tanh"
        super().__init__(recipe)


class ReLU(Activation):
    kind = "relu"


class SiLU(Activation):
    kind = "silu"


class SwiGLU(Activation):
    """silu(x[..., :H]) * x[..., H:] for input (..., 2H): output (..., H)."""

    kind = "swiglu"
