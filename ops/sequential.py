"""Sequential: ops in order, run by the runner (ops/runner.py) inside one autograd Function, so forward and
backward fuse across ops. A plain nn.Module inside a Sequential runs as it is, with ordinary autograd, and
is a fusion boundary.
"""

from __future__ import annotations

from typing import Optional

import torch

from float8 import Recipe
from float8.ops.base import BasicOp
from float8.ops.linear import Linear
from float8.ops.runner import Float8PrecisionWarning, run_ops
from float8.quantizer import check_amax_group


class Sequential(torch.nn.Module):
    """Ops in order, fused. Indexable and iterable like nn.Sequential.

    Options, keyword-only: recipe (applies to ops without one), fuse (False runs every op on its own),
    amax_group (a process group for ops without one: per-tensor amaxes are reduced with MAX over it, so all
    ranks quantize with one scale; delayed scaling's amaxes of one step go out in one all-reduce).
    """

    def __init__(self, *ops: torch.nn.Module, recipe: Optional[Recipe] = None, fuse: bool = True, amax_group=None):
        super().__init__()
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a float8.Recipe, got {type(recipe).__name__}")
        for i, op in enumerate(ops):
            if not isinstance(op, torch.nn.Module):
                raise TypeError(f"Sequential takes ops or nn.Modules; item {i} is a {type(op).__name__}")
        self.ops = torch.nn.ModuleList(ops)
        self.recipe, self.fuse = recipe, fuse
        self.amax_group = check_amax_group(amax_group)
        for op in ops:
            if isinstance(op, BasicOp):
                op.set_recipe(recipe)
                op.set_amax_group(amax_group)
        _check_residual_pairs(ops)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Sequential(*self.ops[i], recipe=self.recipe, fuse=self.fuse, amax_group=self.amax_group)
        return self.ops[i]

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self):
        return iter(self.ops)

    def _segments(self):
        """Runs of basic ops (expanded: Linear with bias is Linear + Bias) between plain modules. An op with
        forward or backward hooks runs alone, through its own call, so that its hooks fire (a fusion
        boundary, like a plain module)."""
        segment, depth = [], 0
        for i, op in enumerate(self.ops):
            hooked = isinstance(op, BasicOp) and _has_hooks(op)
            if hooked and (depth or _residual_step(op)):
                raise ValueError(
                    f"item {i} ({type(op).__name__}) has hooks, and it is or sits inside a Residual/AddResidual pair: an op "
                    "with hooks runs alone so that they fire, and a residual cannot cross that boundary. Move the "
                    "hook to the Sequential, or out of the pair."
                )
            depth += _residual_step(op)
            if isinstance(op, BasicOp) and not hooked:
                segment.extend(op.expand())
            else:
                if segment:
                    yield segment
                    segment = []
                yield op
        if segment:
            yield segment

    def forward(self, x: torch.Tensor, target: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x through the ops. A Sequential that ends with a LinearCrossEntropy takes the labels as `target`
        and returns the loss."""
        ends_in_loss = len(self.ops) > 0 and getattr(self.ops[-1], "is_loss", False)
        if ends_in_loss != (target is not None):
            raise ValueError(
                "a Sequential ending with LinearCrossEntropy needs target="
                if ends_in_loss
                else "target= is only taken by a Sequential that ends with LinearCrossEntropy"
            )
        segments = list(self._segments())
        for seg in segments[:-1] if ends_in_loss else segments:
            if isinstance(seg, list):
                x = run_ops(seg, x, self.fuse)
            else:
                x = seg(x)
        return self.ops[-1](x, target) if ends_in_loss else x


def _has_hooks(op: torch.nn.Module) -> bool:
    return bool(op._forward_hooks or op._forward_pre_hooks or op._backward_hooks or op._backward_pre_hooks)


def _residual_step(op) -> int:
    return getattr(op, "residual_step", 0)


def _check_residual_pairs(ops) -> None:
    depth = 0
    for i, op in enumerate(ops):
        if not isinstance(op, BasicOp) and depth:
            raise ValueError(
                f"item {i} ({type(op).__name__}) is a plain module inside a Residual/AddResidual pair; "
                "a residual cannot cross a fusion boundary: wrap the module's work in ops, or move the pair"
            )
        depth += _residual_step(op)
        if depth < 0:
            raise ValueError(f"AddResidual at item {i} has no Residual before it")
    if depth:
        raise ValueError(f"{depth} Residual op(s) without a matching AddResidual")


__all__ = ["Float8PrecisionWarning", "Sequential", "run_ops"]


def linears_outside_sequentials(model: torch.nn.Module) -> list:
    """The ops.Linear modules of `model` that no Sequential in it runs: those that take module hooks (a hook
    on an op inside a Sequential makes it run alone and splits the Sequential's fused segments)."""
    inside = {id(m) for seq in model.modules() if isinstance(seq, Sequential) for m in seq.modules()}
    return [m for m in model.modules() if isinstance(m, Linear) and id(m) not in inside]
