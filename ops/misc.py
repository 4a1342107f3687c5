"""Small ops: Quantize, Identity, Reshape, Dropout, and the residual pair (branch out / add back)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from float8 import Float8Tensor
from float8.ops.base import BasicOp, OpContext, QuantRequest, RunState, plain, take


class Quantize(BasicOp):
    """Make the activation FP8 here (and its gradient FP8 on the way back, if `backward=True`).

    With a Linear next, the cast uses what the Linear asks for (format, scaling, transpose); otherwise the
    op's recipe decides (forward format, per-tensor current scaling). The backward passes the gradient
    through unchanged in value; with backward=True it is quantized (and dequantized, unless the op before
    wants FP8) so the gradient carries FP8 rounding like the forward activation.
    """

    def __init__(self, *, forward: bool = True, backward: bool = False, recipe=None):
        super().__init__()
        self.quantize_forward, self.quantize_backward = forward, backward
        self.set_recipe(recipe)

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest] = None) -> torch.Tensor:
        if not self.quantize_forward or isinstance(x, Float8Tensor):
            return x
        if out_request is not None:
            return out_request._quantize(x)
        return Float8Tensor.quantize(x, self.recipe.format.forward_dtype)

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        if not self.quantize_backward or isinstance(dy, Float8Tensor):
            return dy, []
        if dx_request is not None:
            return dx_request._quantize(dy), []
        return Float8Tensor.quantize(dy, self.recipe.format.backward_dtype).dequantize(), []


class Identity(BasicOp):
    """y = x, and dx = dy: a placeholder op."""

    has_torch_forward = True

    def torch_forward(self, x: torch.Tensor, run: Optional[RunState] = None) -> torch.Tensor:
        return x

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest] = None) -> torch.Tensor:
        return x

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        return dy, []


class Reshape(BasicOp):
    """Reshape the activation (all of its dims, like torch.reshape); -1 infers one dim."""

    saves = ("logical",)

    def __init__(self, shape: Sequence[int]):
        super().__init__()
        self.shape = tuple(shape)

    def extra_repr(self) -> str:
        return f"{self.shape}"

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest] = None) -> torch.Tensor:
        x = plain(x)
        logical = tuple(ctx.run.lead) + (x.shape[-1],)
        try:
            y = x.reshape(logical).reshape(self.shape)
        except RuntimeError as e:
            raise ValueError(f"Reshape{self.shape} cannot reshape an activation of shape {logical}: {e}") from None
        ctx.logical = logical
        ctx.run.lead = tuple(y.shape[:-1])
        return y.reshape(-1, y.shape[-1]) if y.dim() > 0 else y.reshape(1, 1)

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        dy = plain(dy)
        return dy.reshape(-1, ctx.logical[-1]), []


class Dropout(BasicOp):
    """Zero each element with probability p in training mode and scale the rest by 1 / (1 - p); the
    identity in eval mode. x: any shape and dtype; the mask is drawn in float32."""

    saves = ("mask",)

    def __init__(self, *, p: float = 0.1):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def _drop(self, x):
        """(x with elements dropped and the rest scaled, the keep mask), or (x, None) when nothing drops."""
        if not self.training or self.p == 0:
            return x, None
        keep = torch.rand_like(x, dtype=torch.float32) >= self.p
        return x * keep.to(x.dtype) * (1.0 / (1 - self.p)), keep

    has_torch_forward = True

    def torch_forward(self, x: torch.Tensor, run: Optional[RunState] = None) -> torch.Tensor:
        return self._drop(x)[0]  # the mask op_forward draws, from the same RNG

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest] = None) -> torch.Tensor:
        y, ctx.mask = self._drop(plain(x))
        return y

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        dy = plain(dy)
        if ctx.mask is None:
            return dy, []
        mask = take(ctx, "mask")
        return dy * mask.to(dy.dtype) * (1.0 / (1 - self.p)), []


class Residual(BasicOp):
    """Branch out: remember the activation here; the matching AddResidual adds it back. Pairs nest."""

    fusion_role, residual_step = "residual", 1

    has_torch_forward = True

    def torch_forward(self, x: torch.Tensor, run: RunState) -> torch.Tensor:
        run.residuals.append(x)
        # A view, so that each use of x has a node of its own: the gradients then meet two by two, in the
        # order of Residual's backward (branch + residual, innermost pair first), whatever the nesting.
        return x.view_as(x)

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest] = None) -> torch.Tensor:
        x = plain(x)
        ctx.run.residuals.append(x)
        return x

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        if not ctx.run.residual_grads:
            raise RuntimeError("Residual without a matching AddResidual after it")
        return plain(dy) + ctx.run.residual_grads.pop(), []


class AddResidual(BasicOp):
    """Add back the activation remembered by the matching Residual (the nearest one still open)."""

    residual_step = -1

    has_torch_forward = True

    @staticmethod
    def _add(x2, r2):
        if r2.shape != x2.shape:
            raise ValueError(f"AddResidual: the branch has shape {tuple(x2.shape)}, the residual {tuple(r2.shape)}")
        return x2 + r2

    def torch_forward(self, x: torch.Tensor, run: RunState) -> torch.Tensor:
        """x + the residual, both as (rows, features) like the op's own forward (a Reshape between the
        pair may have changed the token dims); the result in x's shape."""
        r = run.residuals.pop()
        return self._add(x.reshape(-1, x.shape[-1]), r.reshape(-1, r.shape[-1])).reshape(x.shape)

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest] = None) -> torch.Tensor:
        if not ctx.run.residuals:
            raise ValueError("AddResidual needs a Residual op before it in the same Sequential")
        return self._add(plain(x), ctx.run.residuals.pop())

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        dy = plain(dy)
        ctx.run.residual_grads.append(dy)
        return dy, []
