"""Argument checks of the norm ops, shared by the ops and their fake (meta) implementations.

_check_fwd(op, x, weight, bias, eps, rms)     _check_fp8(op, ..., fp8_dtype, scale, margin, power_of_2, with_transpose)
_check_bwd(op, dy, x, weight, mean, rstd, dres=None)     _fake_stats(x, rms) -> (mean, rstd) of the right shapes
Each raises TypeError / ValueError naming the op and the argument; none touches tensor values.
"""

from __future__ import annotations

import math

import torch

from .common import check_flag, check_hp_input, check_tensorwise_args


def _check_vec(v, name, N, x, op):
    check_hp_input(v, op, name)
    if v.dim() != 1 or v.shape[0] != N:
        raise ValueError(
            f"{op}: {name} must have shape ({N},), the last dim of x {tuple(x.shape)}; got {tuple(v.shape)}"
        )
    if v.device != x.device:
        raise ValueError(f"{op}: {name} is on {v.device} but x is on {x.device}")


def _check_fwd(op, x, weight, bias, eps, rms) -> None:
    check_hp_input(x, op)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last dim to normalise over, got shape {tuple(x.shape)}")
    N = x.shape[-1]
    _check_vec(weight, "weight", N, x, op)
    if not isinstance(rms, bool):
        raise TypeError(f"{op}: rms must be a bool (True: RMSNorm, False: LayerNorm), got {type(rms).__name__}")
    if bias is not None:
        if rms:
            raise ValueError(f"{op}: rms=True (RMSNorm) takes no bias, got a bias of shape {tuple(bias.shape)}")
        _check_vec(bias, "bias", N, x, op)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (0.0 <= eps < math.inf):
        raise ValueError(f"{op}: eps must be a finite float >= 0, got {eps!r}")


def _check_fp8(op, x, weight, bias, eps, rms, fp8_dtype, scale, margin, power_of_2, with_transpose) -> None:
    _check_fwd(op, x, weight, bias, eps, rms)
    check_tensorwise_args(x, fp8_dtype, scale, margin, power_of_2, op)
    check_flag(with_transpose, "with_transpose", op)


def _check_stat(t, name, M, x, op):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise TypeError(f"{op}: {name} must be a float32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != (M,):
        raise ValueError(f"{op}: {name} must have shape ({M},) for x of shape {tuple(x.shape)}, got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"{op}: {name} is on {t.device} but x is on {x.device}")


def _check_bwd(op, dy, x, weight, mean, rstd, dres=None) -> None:
    _check_fwd(op, x, weight, None, 0.0, mean is None)
    check_hp_input(dy, op, "dy")
    if dy.shape != x.shape:
        raise ValueError(f"{op}: dy must have the shape of x {tuple(x.shape)}, got {tuple(dy.shape)}")
    if dy.device != x.device:
        raise ValueError(f"{op}: dy is on {dy.device} but x is on {x.device}")
    if dres is not None:
        check_hp_input(dres, op, "dres")
        if dres.shape != x.shape or dres.dtype != x.dtype or dres.device != x.device:
            raise ValueError(
                f"{op}: dres must have x's shape, dtype and device {tuple(x.shape)}, {x.dtype}, {x.device}; got "
                f"{tuple(dres.shape)}, {dres.dtype}, {dres.device}"
            )
    M = _rows(x)
    if mean is not None:
        _check_stat(mean, "mean", M, x, op)
    _check_stat(rstd, "rstd", M, x, op)


def _rows(x) -> int:
    return math.prod(x.shape[:-1])


def _fake_stats(x, rms):
    """(mean (M,) or (0,) for RMSNorm, rstd (M,)), float32."""
    M = _rows(x)
    return x.new_empty((0 if rms else M,), dtype=torch.float32), x.new_empty((M,), dtype=torch.float32)
