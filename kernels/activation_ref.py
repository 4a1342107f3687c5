"""Pure-torch references of the activation ops: the kernels' float32 formulas, op for op.

act_ref_fp32(x, kind, bias=None) -> act(x + bias)        dact_ref_fp32(dy, x, kind, bias=None, x_scale_inv=None)
act_fwd_ref, act_fp8_ref, act_fp8_save_input_ref, act_bwd_ref, dact_fp8_ref: the ops' outputs (the
signatures of kernels/activation.py's ops); _out_shape, _grad_dtype: their output shape and dtype
Numerics: float32, unrounded until the output (or FP8) cast; the kernels agree to a few float32 ulps (exp, erf).
"""

from __future__ import annotations

from typing import Optional

import torch

from .activation_math import ERFC_P, INV_SQRT_2PI, SAVED_X_DTYPE, SQRT1_2, TANH_BETA, TANH_KAPPA, TANH_KAPPA3
from .reference import FP8_DTYPES, quantize_tensorwise_ref


def _n_out(n_in: int, kind: str) -> int:
    return n_in // 2 if kind == "swiglu" else n_in


def _out_shape(x: torch.Tensor, kind: str):
    return (*x.shape[:-1], _n_out(x.shape[-1], kind))


def _grad_dtype(dy, x):
    """The dtype of a high-precision dx: x's, or dy's where x is the forward's saved FP8 copy."""
    return dy.dtype if x.dtype in FP8_DTYPES else x.dtype


# ---- references: pure torch, float32, the kernels' formulas op for op -------------------------------


def _v_ref(x, bias, x_scale_inv=None):
    v = x.float()
    if x_scale_inv is not None:
        v = v * x_scale_inv
    return v + bias.float() if bias is not None else v


def _logistic_ref(u):
    t = torch.exp(-u.abs())
    r = 1.0 / (1.0 + t)
    tr = t * r
    pos = u >= 0.0
    return torch.where(pos, r, tr), torch.where(pos, tr, r)


def _silu_ref(v):
    t = torch.exp(-v.abs())
    return torch.where(v >= 0.0, v, v * t) / (1.0 + t)


def _silu_dsilu_ref(v):
    s, c = _logistic_ref(v)
    return v * s, s * (1.0 + v * c)


def _phi_ref(v):
    e = torch.exp(-0.5 * v * v)
    t = 1.0 / (1.0 + 0.5 * (v.abs() * SQRT1_2))
    p = ERFC_P[-1] * t + ERFC_P[-2]
    for c in reversed(ERFC_P[:-2]):
        p = p * t + c
    lower = 0.5 * ((t * e) * torch.exp(p))
    upper = 0.5 * (1.0 + torch.erf(v * SQRT1_2))
    return torch.where(v < 0.0, lower, upper), e


def act_ref_fp32(x: torch.Tensor, kind: str, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(x + bias) in float32, unrounded: what the FP8 kernels quantize."""
    v = _v_ref(x, bias)
    if kind == "relu":
        return torch.where(v < 0.0, 0.0, v)
    if kind == "gelu":
        return v * _phi_ref(v)[0]
    if kind == "gelu_tanh":
        w = 2.0 * (TANH_BETA * (v + TANH_KAPPA * v * v * v))
        t = torch.exp(-w.abs())
        return torch.where(w >= 0.0, v, v * t) / (1.0 + t)
    if kind == "silu":
        return _silu_ref(v)
    if kind == "swiglu":
        h = v.shape[-1] // 2
        return _silu_ref(v[..., :h]) * v[..., h:]
    return v.clone()  # identity: never an alias of x


def dact_ref_fp32(
    dy: torch.Tensor,
    x: torch.Tensor,
    kind: str,
    bias: Optional[torch.Tensor] = None,
    x_scale_inv: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """dy * act'(x + bias) in float32, unrounded: what the fused backward quantizes (x * x_scale_inv for an
    FP8 x)."""
    g = dy.float()
    if kind == "identity":
        return g.clone()  # never an alias of dy
    v = _v_ref(x, bias, x_scale_inv)
    if kind == "relu":
        return torch.where(v <= 0.0, 0.0, g)
    if kind == "gelu":
        cdf, e = _phi_ref(v)
        return g * (cdf + v * (e * INV_SQRT_2PI))
    if kind == "gelu_tanh":
        w = 2.0 * (TANH_BETA * (v + TANH_KAPPA * v * v * v))
        s, c = _logistic_ref(w)
        dw = 2.0 * (TANH_BETA * (1.0 + TANH_KAPPA3 * v * v))
        return g * (s + v * (s * c * dw))
    if kind == "silu":
        return g * _silu_dsilu_ref(v)[1]
    h = v.shape[-1] // 2  # swiglu
    a, b = v[..., :h], v[..., h:]
    silu_a, dsilu_a = _silu_dsilu_ref(a)
    return torch.cat([(g * b) * dsilu_a, g * silu_a], dim=-1)


def act_fwd_ref(x: torch.Tensor, kind: str, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(x + bias) in float32, rounded to x's dtype: what act_fwd computes."""
    return act_ref_fp32(x, kind, bias).to(x.dtype)


def act_fp8_ref(
    x: torch.Tensor,
    kind: str,
    bias: Optional[torch.Tensor],
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """act(x + bias) in float32, quantized per tensor as quantize_tensorwise_ref does: what act_fp8 returns."""
    return quantize_tensorwise_ref(act_ref_fp32(x, kind, bias), fp8_dtype, scale, margin, power_of_2, with_transpose)


def act_fp8_save_input_ref(
    x: torch.Tensor,
    kind: str,
    bias: Optional[torch.Tensor],
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """act_fp8_ref's outputs, then the FP8 copy of x the backward reads (its data and scale-inverse)."""
    saved = quantize_tensorwise_ref(x, SAVED_X_DTYPE)
    return (*act_fp8_ref(x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose), saved[0], saved[2])


def act_bwd_ref(
    dy: torch.Tensor,
    x: torch.Tensor,
    kind: str,
    bias: Optional[torch.Tensor] = None,
    x_scale_inv: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """dy * act'(x + bias) in float32, in the gradient's dtype: what act_bwd computes."""
    return dact_ref_fp32(dy, x, kind, bias, x_scale_inv).to(_grad_dtype(dy, x))


def dact_fp8_ref(
    dy: torch.Tensor,
    x: torch.Tensor,
    kind: str,
    bias: Optional[torch.Tensor],
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = True,
    with_dbias: bool = True,
    x_scale_inv: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, data_t, scale_inv, amax, dbias): dy * act'(x + bias) in float32 quantized per tensor, and its
    column sums: what dact_fp8 returns."""
    dx = dact_ref_fp32(dy, x, kind, bias, x_scale_inv)
    data, data_t, scale_inv, amax = quantize_tensorwise_ref(dx, fp8_dtype, scale, margin, power_of_2, with_transpose)
    dbias = dx.reshape(-1, dx.shape[-1]).sum(0).to(dy.dtype) if with_dbias else dy.new_empty((0,))
    return data, data_t, scale_inv, amax, dbias
