"""Functional forms of the ops: one call, same kernels, same autograd as the op classes.

    y = float8.ops.functional.linear(x, weight, bias, recipe=Recipe())

A functional call keeps no state between calls: the weight is quantized on every call (an op keeps its
FP8 weight until the weight changes), and delayed-scaling recipes are refused (their history must live
somewhere: use the op).
"""

from __future__ import annotations

from typing import Optional

import torch

from float8 import DelayedScaling, Recipe
from float8.ops.activations import GELU, ReLU, SiLU, SwiGLU
from float8.ops.base import BasicOp
from float8.ops.bias import Bias
from float8.ops.linear import Linear
from float8.ops.norms import LayerNorm, RMSNorm
from float8.ops.sequential import run_ops


def _stateless(recipe: Optional[Recipe]) -> Recipe:
    recipe = recipe or Recipe()
    if any(isinstance(getattr(recipe, r), DelayedScaling) for r in ("input", "weight", "grad")):
        raise ValueError("functional forms keep no amax history: use the op classes for delayed scaling")
    return recipe


def _bound(op: BasicOp, **params) -> BasicOp:
    # Bind the caller's tensors as the op's parameters (no copies); autograd reaches them through run_ops.
    for name, value in params.items():
        if value is not None:
            op._parameters[name] = value
    return op


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, recipe: Optional[Recipe] = None):
    """x @ weight.t() + bias with FP8 fprop/dgrad/wgrad GEMMs."""
    op = Linear.__new__(Linear)
    BasicOp.__init__(op)
    op.in_features, op.out_features = weight.shape[1], weight.shape[0]
    op.__dict__["_w8_cache"] = None
    op.__dict__["_expansion"] = None
    op._parameters["weight"] = weight
    op._parameters["bias"] = None
    op.set_recipe(_stateless(recipe))
    ops = [op] if bias is None else [op, Bias.sharing(bias, op)]
    return run_ops(ops, x)


def rms_norm(x, weight, eps: float = 1e-6):
    op = RMSNorm(weight.shape[0], eps, device="meta")
    return run_ops([_bound(op, weight=weight)], x)


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    op = LayerNorm(weight.shape[0], eps, device="meta")
    if bias is None:
        bias = torch.zeros_like(weight)  # no bias: a constant zero one, which receives no gradient
    return run_ops([_bound(op, weight=weight, bias=bias)], x)


def gelu(x, approximate: str = "none"):
    return run_ops([GELU(approximate)], x)


def relu(x):
    return run_ops([ReLU()], x)


def silu(x):
    return run_ops([SiLU()], x)


def swiglu(x):
    return run_ops([SwiGLU()], x)
