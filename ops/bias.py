"""Bias: y = x + bias. Its backward is dbias = sum of dy over rows, fused with the gradient's FP8
cast-transpose when the op before it (a Linear) wants the gradient in FP8."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from float8.kernels.activation import dact_fp8
from float8.ops.base import BasicOp, OpContext, QuantRequest, RunState, plain, sequence_parallel


def add_bias(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x + bias under autograd, in x's dtype. A bias kept in another dtype (a float32 master weight) is
    added in its own precision, so its gradient is the float32 sum over rows that Bias.op_backward gives,
    not a sum rounded to x's dtype (bf16: 8 bits)."""
    if bias.dtype == x.dtype:
        return x + bias
    return (x + bias).to(x.dtype)


def bias_backward(dy2: torch.Tensor, dx_request: Optional[QuantRequest]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias in float32 sums cast to dy's dtype) of y = x + bias, for dy2 (rows, N) high precision:
    dx is FP8 as `dx_request` asks (dbias and the cast-transpose in one kernel where its quantizer fuses)."""
    r = dx_request
    if r is not None and r.fuses:
        data, data_t, scale_inv, amax, dbias = dact_fp8(
            dy2, dy2, "identity", None, r.fp8_dtype, r.kernel_scale(), r.margin, r.power_of_2, r.with_transpose, True
        )
        return r.finish(data, data_t, scale_inv, amax, dy2.dtype), dbias
    dbias = dy2.sum(0, dtype=torch.float32)
    return (dy2 if r is None else r._quantize(dy2)), dbias


class Bias(BasicOp):
    """y = x + bias over the last dim. x: (..., size); `bias`: (size,), zeros at start.

    parameter: an existing Parameter to use as the bias (a Linear's own, inside its expansion).
    sequence_parallel_group: a process group whose ranks each hold a block of the tokens (sequence
    parallelism): the bias gradient is summed over it.
    """

    fusion_role, folds_into_gemm = "bias", True

    def __init__(
        self,
        size: int,
        *,
        parameter: Optional[torch.nn.Parameter] = None,
        device=None,
        dtype=None,
        recipe=None,
        sequence_parallel_group=None,
    ):
        super().__init__()
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"Bias: size must be a positive int, got {size!r}")
        if parameter is None:
            parameter = torch.nn.Parameter(torch.zeros(size, device=device, dtype=dtype))
        elif tuple(parameter.shape) != (size,):
            raise ValueError(f"Bias({size}) got a parameter of shape {tuple(parameter.shape)}")
        self.bias = parameter
        sequence_parallel(self, sequence_parallel_group)
        self.set_recipe(recipe)

    @property
    def has_torch_forward(self) -> bool:
        return self.grad_sum_group is None  # a sequence-parallel bias's gradient is summed by the runner

    def torch_forward(self, x: torch.Tensor, run: Optional[RunState] = None) -> torch.Tensor:
        return add_bias(x, self.bias)

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest] = None) -> torch.Tensor:
        x = plain(x)
        if x.shape[-1] != self.bias.shape[0]:
            raise ValueError(f"Bias of shape {tuple(self.bias.shape)} cannot add to input of shape {tuple(x.shape)}")
        return x + self.bias.to(x.dtype)

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        dy2 = plain(dy).reshape(-1, dy.shape[-1])
        dx, dbias = bias_backward(dy2, dx_request)
        if dx_request is None:
            dx = dy  # unchanged, in its own shape
        return dx, [dbias.to(self.bias.dtype)]
