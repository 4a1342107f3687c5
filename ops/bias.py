"""Bias: y = x + bias. Its backward is dbias = sum of dy over rows, fused with the gradient's FP8
cast-transpose when the op before it (a Linear) wants the gradient in FP8."""

from __future__ import annotations

import torch

from float8 import Float8Tensor
from float8.kernels.activation import dbias_cast_transpose
from float8.ops.base import BasicOp, OpContext, is_delayed, plain, wrap_fp8


class Bias(BasicOp):
    def __init__(self, size: int, device=None, dtype=None, recipe=None):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(size, device=device, dtype=dtype))
        self.set_recipe(recipe)

    @classmethod
    def sharing(cls, parameter: torch.nn.Parameter, owner: BasicOp) -> "Bias":
        """A Bias op over an existing parameter (Linear's own bias): nothing is copied or registered twice."""
        op = cls.__new__(cls)
        BasicOp.__init__(op)
        op.__dict__["_shared_owner"] = owner
        op._parameters["bias"] = parameter
        return op

    @property
    def recipe(self):
        owner = self.__dict__.get("_shared_owner")
        return owner.recipe if owner is not None else super().recipe

    def op_forward(self, ctx: OpContext, x, out_request=None):
        x = plain(x)
        if x.shape[-1] != self.bias.shape[0]:
            raise ValueError(f"Bias of shape {tuple(self.bias.shape)} cannot add to input of shape {tuple(x.shape)}")
        return x + self.bias.to(x.dtype)

    def op_backward(self, ctx: OpContext, dy, dx_request=None):
        dy2 = plain(dy).reshape(-1, dy.shape[-1])
        if dx_request is not None and not is_delayed(dx_request):
            fmt = dx_request.scaling
            data, data_t, scale_inv, _, dbias = dbias_cast_transpose(dy2, dx_request.fp8_dtype, fmt.margin, fmt.power_of_2)
            dx = wrap_fp8(dx_request, data, data_t, scale_inv, dy.dtype)
            return dx, [dbias.to(self.bias.dtype)]
        dbias = dy2.sum(0, dtype=torch.float32).to(self.bias.dtype)
        return dy, [dbias]
