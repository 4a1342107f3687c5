"""Functional forms of the ops: one call, same kernels, same autograd as the op classes.

    y = float8.ops.functional.linear(x, weight, bias, recipe=Recipe())

`linear` is the stateless primitive; its engine (`linear_fwd` / `linear_bwd`, exported here too) is in
ops/linear_engine.py. A functional call keeps no state between calls: the weight is quantized on every
call, and delayed-scaling recipes are refused (their history must live somewhere: use the op).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from float8 import DelayedScaling, Float8Tensor, Recipe
from float8.ops.activations import GELU, ReLU, SiLU, SwiGLU
from float8.ops.base import DEFAULT_RECIPE, BasicOp
from float8.ops.cross_entropy import linear_cross_entropy
from float8.ops.linear_engine import (
    LinearSaved,
    _LinearFunction,
    check_fp8_weight_grad,
    check_linear_args,
    fp8_pays_off,
    grad_request,
    linear_bwd,
    linear_fwd,
    linear_fwd_high_precision,
    quantize_weight,
    rebuilds_weight,
)
from float8.ops.norms import LayerNorm, RMSNorm
from float8.ops.runner import run_ops

__all__ = [
    "LinearSaved",
    "check_fp8_weight_grad",
    "check_linear_args",
    "fp8_pays_off",
    "gelu",
    "grad_request",
    "layer_norm",
    "linear",
    "linear_bwd",
    "linear_cross_entropy",
    "linear_fwd",
    "linear_fwd_high_precision",
    "quantize_weight",
    "rebuilds_weight",
    "relu",
    "rms_norm",
    "silu",
    "swiglu",
]


def _stateless(recipe: Optional[Recipe]) -> Recipe:
    recipe = recipe or DEFAULT_RECIPE
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a float8.Recipe, got {type(recipe).__name__}")
    if any(isinstance(getattr(recipe, r), DelayedScaling) for r in ("input", "weight", "grad")):
        raise ValueError("functional forms keep no amax history: use the op classes for delayed scaling")
    return recipe


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *, recipe: Optional[Recipe] = None
) -> torch.Tensor:
    """y = x @ weight.t() + bias with FP8 fprop/dgrad/wgrad GEMMs (the stateless primitive of ops.Linear).

    x: (..., K) float32/bfloat16/float16 (or a Float8Tensor); weight: (N, K), high precision or an FP8-only
    Float8Tensor (which must not require grad); bias: (N,) or None. y: (..., N) in x's dtype. The weight is
    quantized on every call; on CUDA, GEMMs below recipe.min_fp8_gemm_flops run in x's dtype.
    """
    recipe = _stateless(recipe)
    check_linear_args(x, weight, bias)
    tokens = x.numel() // max(1, x.shape[-1])
    fp8 = isinstance(weight, Float8Tensor) or isinstance(x, Float8Tensor)
    if not fp8 and not fp8_pays_off(recipe, tokens, weight.shape[1], weight.shape[0], x.device):
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    if torch.is_grad_enabled():
        check_fp8_weight_grad(weight)
    return _LinearFunction.apply(x, weight, bias, recipe.quantizers(), recipe.fprop_fast_accum)


# ---- norms and activations: the op classes, run once ---------------------------------------------------


def _run(ops, x):
    return run_ops(ops, x)


def _bound(op: BasicOp, **params) -> BasicOp:
    # Bind the caller's tensors as the op's parameters (no copies); autograd reaches them through run_ops.
    for name, value in params.items():
        if value is not None:
            op._parameters[name] = value
    return op


def _check_norm_weight(weight, name: str) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        raise ValueError(f"{name}: weight must be 1-D (normalized_shape,), got {getattr(weight, 'shape', weight)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim of x (..., N) with weight (N,): see ops.RMSNorm."""
    _check_norm_weight(weight, "rms_norm")
    op = RMSNorm(weight.shape[0], eps=eps, device="meta")
    return _run([_bound(op, weight=weight)], x)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim of x (..., N) with weight (N,) and bias (N,) or None: see ops.LayerNorm."""
    _check_norm_weight(weight, "layer_norm")
    op = LayerNorm(weight.shape[0], eps=eps, device="meta")
    if bias is None:
        bias = torch.zeros_like(weight)  # no bias: a constant zero one, which receives no gradient
    return _run([_bound(op, weight=weight, bias=bias)], x)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU of x (erf form, or approximate="tanh"): see ops.GELU."""
    return _run([GELU(approximate=approximate)], x)


def relu(x: torch.Tensor) -> torch.Tensor:
    """ReLU of x: see ops.ReLU."""
    return _run([ReLU()], x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU of x: see ops.SiLU."""
    return _run([SiLU()], x)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :H]) * x[..., H:] for x (..., 2H): see ops.SwiGLU."""
    return _run([SwiGLU()], x)
