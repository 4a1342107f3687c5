"""LayerNorm and RMSNorm. Followed by a Linear, the norm kernel writes FP8 (and the transpose the Linear's
backward needs) directly: the normalized activations never exist in high precision."""

from __future__ import annotations

import torch

from float8.kernels import norm as K
from float8.ops.base import BasicOp, OpContext, QuantRequest, is_delayed, plain, wrap_fp8


def _check(x, n, name):
    if x.shape[-1] != n:
        raise ValueError(f"{name}({n}) got input of shape {tuple(x.shape)}: the last dim must be {n}")


class RMSNorm(BasicOp):
    def __init__(self, normalized_shape: int, eps: float = 1e-6, device=None, dtype=None, recipe=None):
        super().__init__()
        self.normalized_shape, self.eps = normalized_shape, eps
        self.weight = torch.nn.Parameter(torch.ones(normalized_shape, device=device, dtype=dtype))
        self.set_recipe(recipe)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"

    def op_forward(self, ctx: OpContext, x, out_request=None):
        x = plain(x)
        _check(x, self.normalized_shape, "RMSNorm")
        w = self.weight.to(x.dtype)
        if out_request is None:
            y, rstd = K.rmsnorm_fwd(x, w, self.eps)
        elif is_delayed(out_request):
            st = out_request.scaling
            data, data_t, scale_inv, amax, rstd = K.rmsnorm_fp8_scaled(
                x, w, self.eps, st.scale, out_request.fp8_dtype, out_request.with_transpose
            )
            st.update(amax, out_request.fp8_dtype)
            y = wrap_fp8(out_request, data, data_t, scale_inv, x.dtype)
        else:
            s = out_request.scaling
            data, data_t, scale_inv, _, rstd = K.rmsnorm_fp8(
                x, w, self.eps, out_request.fp8_dtype, s.margin, s.power_of_2, out_request.with_transpose
            )
            y = wrap_fp8(out_request, data, data_t, scale_inv, x.dtype)
        ctx.saved = (x, rstd)
        return y

    def op_backward(self, ctx: OpContext, dy, dx_request=None):
        x, rstd = ctx.saved
        ctx.saved = None
        dx, dw = K.rmsnorm_bwd(plain(dy), x, self.weight.to(x.dtype), rstd)
        return dx, [dw.to(self.weight.dtype)]


class LayerNorm(BasicOp):
    def __init__(self, normalized_shape: int, eps: float = 1e-5, device=None, dtype=None, recipe=None):
        super().__init__()
        self.normalized_shape, self.eps = normalized_shape, eps
        self.weight = torch.nn.Parameter(torch.ones(normalized_shape, device=device, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(normalized_shape, device=device, dtype=dtype))
        self.set_recipe(recipe)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"

    def op_forward(self, ctx: OpContext, x, out_request=None):
        x = plain(x)
        _check(x, self.normalized_shape, "LayerNorm")
        w, b = self.weight.to(x.dtype), self.bias.to(x.dtype)
        if out_request is None:
            y, mean, rstd = K.layernorm_fwd(x, w, b, self.eps)
        elif is_delayed(out_request):
            st = out_request.scaling
            data, data_t, scale_inv, amax, mean, rstd = K.layernorm_fp8_scaled(
                x, w, b, self.eps, st.scale, out_request.fp8_dtype, out_request.with_transpose
            )
            st.update(amax, out_request.fp8_dtype)
            y = wrap_fp8(out_request, data, data_t, scale_inv, x.dtype)
        else:
            s = out_request.scaling
            data, data_t, scale_inv, _, mean, rstd = K.layernorm_fp8(
                x, w, b, self.eps, out_request.fp8_dtype, s.margin, s.power_of_2, out_request.with_transpose
            )
            y = wrap_fp8(out_request, data, data_t, scale_inv, x.dtype)
        ctx.saved = (x, mean, rstd)
        return y

    def op_backward(self, ctx: OpContext, dy, dx_request=None):
        x, mean, rstd = ctx.saved
        ctx.saved = None
        dx, dw, db = K.layernorm_bwd(plain(dy), x, self.weight.to(x.dtype), mean, rstd)
        return dx, [dw.to(self.weight.dtype), db.to(self.bias.dtype)]
