"""Pure-torch references of the norm ops: the kernels' float32 formulas, step by step.

norm_stats_ref(x, eps, is_rms) -> (mean or None, rstd)      norm_apply_ref(x, weight, bias, mean, rstd) -> y fp32
norm_fwd_ref / norm_fp8_ref / norm_bwd_ref: the ops' outputs (signatures of kernels/norm.py's ops)
quantize_y_ref(y_hp, fp8_dtype, ...): reference.quantize_tensorwise_ref of y viewed as rows
Numerics: rstd = 1 / sqrt_rn(sum / N + eps) with a correctly rounded square root (sqrt_rn), divisions by a
tensor N (not a scalar), so the CPU gives the GPU kernels' bits wherever the row sums agree.
"""

from __future__ import annotations

import torch

from .reference import quantize_tensorwise_ref


def _no_mean(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm's mean output: an empty (0,) float32 tensor (a custom op cannot return None)."""
    return torch.empty((0,), dtype=torch.float32, device=x.device)


def _div_n(s: torch.Tensor, N: int) -> torch.Tensor:
    # A tensor divisor, not a Python scalar: CUDA divides by a scalar as a multiply by its reciprocal.
    return s / torch.full_like(s, N)


def norm_stats_ref(x: torch.Tensor, eps: float, is_rms: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(mean (M,) fp32 or None for RMSNorm, rstd (M,) fp32) of x viewed as (M, N)."""
    N = x.shape[-1]
    xf = x.reshape(-1, N).float()
    if is_rms:
        mean = None
        var = _div_n((xf * xf).sum(-1), N)
    else:
        mean = _div_n(xf.sum(-1), N)
        d = xf - mean[:, None]
        var = _div_n((d * d).sum(-1), N)
    rstd = torch.reciprocal(sqrt_rn(var + eps))
    return mean, rstd


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root (the kernels' sqrt_rn, CUDA's sqrtf).

    torch.sqrt on CPU is a vectorised approximation, 1 ulp off for ~20% of float32 inputs (and its float64
    sqrt for ~1%), so: a float64 sqrt rounded to float32 (within an ulp), then fixed by comparing v with the
    squares of the midpoints to its neighbours, which float64 holds exactly (25-bit midpoints).
    """
    v = v.float()
    s = torch.sqrt(v.double()).float()
    up = torch.nextafter(s, torch.full_like(s, float("inf")))
    down = torch.nextafter(s, torch.zeros_like(s))
    hi = (s.double() + up.double()) / 2
    lo = (s.double() + down.double()) / 2
    vd = v.double()
    s = torch.where(hi * hi < vd, up, s)
    return torch.where(lo * lo > vd, down, s)


def norm_apply_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
) -> torch.Tensor:
    """y in float32, shape (M, N), from given stats (mean None: RMSNorm), rounded step by step like the kernels."""
    N = x.shape[-1]
    xf = x.reshape(-1, N).float()
    if mean is None:
        y = (xf * rstd[:, None]) * weight.float()[None, :]
    else:
        y = ((xf - mean[:, None]) * rstd[:, None]) * weight.float()[None, :]
    if bias is not None:
        y = y + bias.float()[None, :]
    return y


def quantize_y_ref(
    y_hp: torch.Tensor,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.quantize_tensorwise_ref of y's rows: (data (y's shape), data_t (N, M) or (0,), scale_inv,
    amax = max|y|), at `scale` or (scale None) at the current scale."""
    N = y_hp.shape[-1]
    data, *rest = quantize_tensorwise_ref(y_hp.reshape(-1, N), fp8_dtype, scale, margin, power_of_2, with_transpose)
    return data.reshape(y_hp.shape), *rest


def norm_fwd_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd): RMSNorm (rms) or LayerNorm of x in float32, y in x's dtype: what norm_fwd computes."""
    mean, rstd = norm_stats_ref(x, eps, rms)
    y = norm_apply_ref(x, weight, bias, mean, rstd).to(x.dtype).reshape(x.shape)
    return y, _no_mean(x) if mean is None else mean, rstd


def norm_fp8_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    rms: bool,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_fwd_ref's y quantized per tensor, then mean and rstd: what norm_fp8 returns."""
    y, mean, rstd = norm_fwd_ref(x, weight, bias, eps, rms)
    return (*quantize_y_ref(y, fp8_dtype, scale, margin, power_of_2, with_transpose), mean, rstd)


def norm_bwd_ref(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    dres: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx (x.shape, x.dtype), dweight, dbias (weight.dtype)) from given stats; mean None: RMSNorm, dbias (0,).
    dres: added to dx once dx is rounded to x.dtype."""
    N = x.shape[-1]
    xf = x.reshape(-1, N).float()
    dyf = dy.reshape(-1, N).float()
    r = rstd[:, None]
    g = dyf * weight.float()[None, :]
    if mean is None:
        xhat = xf * r
        c1 = _div_n((g * xhat).sum(-1), N)
        dx = (g - xhat * c1[:, None]) * r
        db = weight.new_empty((0,))
    else:
        xhat = (xf - mean[:, None]) * r
        c1 = _div_n((g * xhat).sum(-1), N)
        c2 = _div_n(g.sum(-1), N)
        dx = ((g - c2[:, None]) - xhat * c1[:, None]) * r
        db = dyf.sum(0).to(weight.dtype)
    dw = (dyf * xhat).sum(0).to(weight.dtype)
    dx = dx.to(x.dtype).reshape(x.shape)
    return (dx if dres is None else dx + dres), dw, db
