"""Fusions are data: (pattern of fusion roles -> fused unit), walked by one matcher, forward and backward apart.
An op takes part under the role it declares (`BasicOp.fusion_role`: "linear", "bias", "activation", "norm",
"residual"); this module imports no op.

A unit covers one or more consecutive basic ops. It runs with the OpContext of each op it covers, so a
fused forward can pair with an unfused backward and vice versa (tests run every combination against the
unfused ops). Each fused unit has a guard, `can_fuse(ops)`.

Forward:
  Linear + Bias          bias added in the GEMM epilogue (cuBLASLt), no separate pass
  Bias + Activation      one kernel: act(x + bias), written as FP8 when the next op wants FP8
Backward:
  Bias + Activation      one kernel: dact, dbias and the FP8 cast-transpose of the gradient
  Residual + norm        the norm's backward kernel adds the residual branch's gradient to dx as it writes
                         it: no separate add (a read of two tensors and a write of one)
Single ops fuse with their neighbours through requests (ops/base.py): a norm or activation writes FP8
for the Linear after it; Bias and activation backwards write the FP8 gradient the Linear before wants.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Type

import torch

from float8.ops.context import OpContext, plain


class Unit:
    """One basic op, run as it is."""

    def __init__(self, ops: Sequence):
        self.ops = list(ops)

    @staticmethod
    def can_fuse(ops: Sequence[torch.nn.Module]) -> bool:
        return len(ops) == 1

    def forward(self, ctxs: List[OpContext], x: torch.Tensor, out_request: Any) -> torch.Tensor:
        return self.ops[0].op_forward(ctxs[0], x, out_request)

    def backward(
        self, ctxs: List[OpContext], dy: torch.Tensor, dx_request: Any
    ) -> Tuple[Optional[torch.Tensor], List[List[Optional[torch.Tensor]]]]:
        dx, grads = self.ops[0].op_backward(ctxs[0], dy, dx_request)
        return dx, [grads]


class LinearBiasForward(Unit):
    """Linear + Bias forward: the bias joins the GEMM's epilogue."""

    @staticmethod
    def can_fuse(ops: Sequence[torch.nn.Module]) -> bool:
        linear, bias = ops
        return linear.bias is None or linear.bias is bias.bias

    def forward(self, ctxs: List[OpContext], x: torch.Tensor, out_request: Any) -> torch.Tensor:
        linear, bias = self.ops
        # The bias joins the GEMM's output in the activation dtype (it may be a float32 master weight).
        return linear.op_forward(ctxs[0], x, None, bias=bias.bias.to(x.dtype))


class BiasActivationForward(Unit):
    """Bias + activation forward: act(x + bias) in one kernel, FP8 where the next op asks for it."""

    @staticmethod
    def can_fuse(ops: Sequence[torch.nn.Module]) -> bool:
        return True  # any bias size: a mismatch is reported by forward, naming both shapes

    def forward(self, ctxs: List[OpContext], x: torch.Tensor, out_request: Any) -> torch.Tensor:
        bias, act = self.ops
        x = plain(x)
        if x.shape[-1] != bias.bias.shape[0]:
            raise ValueError(f"Bias of shape {tuple(bias.bias.shape)} cannot add to input of shape {tuple(x.shape)}")
        return act.activation_forward(ctxs[1], x, out_request, bias=bias.bias.to(x.dtype))


class BiasActivationBackward(Unit):
    """Bias + activation backward: dact, dbias and the gradient's FP8 cast-transpose in one kernel."""

    @staticmethod
    def can_fuse(ops: Sequence[torch.nn.Module]) -> bool:
        return True

    def backward(
        self, ctxs: List[OpContext], dy: torch.Tensor, dx_request: Any
    ) -> Tuple[Optional[torch.Tensor], List[List[Optional[torch.Tensor]]]]:
        bias, act = self.ops
        dx, dbias = act.activation_backward(ctxs[1], dy, dx_request, want_dbias=True)
        return dx, [[dbias.to(bias.bias.dtype)], []]


class ResidualNormBackward(Unit):
    """Residual + norm backward: the norm's backward adds the residual branch's gradient as it writes dx."""

    @staticmethod
    def can_fuse(ops: Sequence[torch.nn.Module]) -> bool:
        return True

    def backward(
        self, ctxs: List[OpContext], dy: torch.Tensor, dx_request: Any
    ) -> Tuple[Optional[torch.Tensor], List[List[Optional[torch.Tensor]]]]:
        residual, norm = self.ops
        grads = ctxs[0].run.residual_grads
        if not grads or not norm.saved_input_like(ctxs[1], grads[-1]):
            # Unmatched, or a branch gradient of another dtype (torch's add would promote): one op at a time.
            dx, norm_grads = norm.op_backward(ctxs[1], dy, None)
            dx, _ = residual.op_backward(ctxs[0], dx, dx_request)
            return dx, [[], norm_grads]
        dx, norm_grads = norm.norm_backward(ctxs[1], dy, dres=grads.pop())
        return dx, [[], norm_grads]


FORWARD_FUSIONS = [
    (("linear", "bias"), LinearBiasForward),
    (("bias", "activation"), BiasActivationForward),
]
BACKWARD_FUSIONS = [
    (("bias", "activation"), BiasActivationBackward),
    (("residual", "norm"), ResidualNormBackward),
]


def match(ops: Sequence, fusions: Sequence[Tuple[Tuple[str, ...], Type[Unit]]], enabled: bool = True) -> List[tuple]:
    """Split `ops` into units: [(first index, unit)], trying each pattern in order at each position."""
    units, i = [], 0
    while i < len(ops):
        for pattern, unit_cls in fusions if enabled else ():
            window = ops[i : i + len(pattern)]
            if len(window) == len(pattern) and all(o.fusion_role == role for o, role in zip(window, pattern)):
                if unit_cls.can_fuse(window):
                    units.append((i, unit_cls(window)))
                    i += len(pattern)
                    break
        else:
            units.append((i, Unit(ops[i : i + 1])))
            i += 1
    return units
