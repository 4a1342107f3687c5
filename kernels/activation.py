"""Activations as custom ops, forward and backward, optionally writing FP8 directly (per-tensor scaling).

    act_fwd(x, kind, bias=None) -> y                                        act(x + bias), x.dtype
    act_fp8(x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False)
        -> (data, data_t, scale_inv, amax)                                  act(x + bias) in FP8
    act_fp8_save_input(x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False)
        -> (data, data_t, scale_inv, amax, x_data, x_scale_inv)             act_fp8, and x itself in E4M3
    act_bwd(dy, x, kind, bias=None, x_scale_inv=None) -> dx                 dy * act'(x + bias)
    act_bwd_with_amax(dy, x, kind) -> (dx, max|dx|)                         act_bwd and dx's amax, one pass
    dact_fp8(dy, x, kind, bias, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=True,
             with_dbias=True, x_scale_inv=None) -> (data, data_t, scale_inv, amax, dbias)

kind: one of KINDS; swiglu maps x (..., 2H) = [gate | linear] to silu(gate) * linear (..., H). A bias has
x's last dim and is added first. data_t: data with its last two dims swapped, contiguous, or (0,) without
with_transpose. scale None: current scaling; else a one-element float32 scale, and amax is still max|out|.
x_scale_inv given: x is act_fp8_save_input's E4M3 copy, read as x * x_scale_inv. On a CUDA tensor each op
runs its launcher *_triton, elsewhere its reference *_ref.
Numerics: float32, never rounded to x.dtype before the FP8 cast; the references agree to a few float32 ulps.

Formulas: kernels/activation_math.py; kernels: kernels/activation_fwd_kernel.py and
kernels/activation_bwd_kernel.py; launchers: kernels/activation_launch.py; references:
kernels/activation_ref.py; design and measurements: docs/design.md §10.
"""

from __future__ import annotations

from typing import Optional

import torch

from .activation_launch import (
    TRANSPOSE_CONFIG,
    act_bwd_triton,
    act_fp8_triton,
    act_fwd_triton,
    dact_fp8_triton,
    dbias_partials,
    launch_bwd,
    launch_fwd,
)
from .activation_math import INV_SQRT_2PI, KINDS, SAVED_X_DTYPE, SQRT1_2
from .activation_ref import (
    _out_shape,
    act_bwd_ref,
    act_fp8_ref,
    act_fp8_save_input_ref,
    act_fwd_ref,
    act_ref_fp32,
    dact_fp8_ref,
    dact_ref_fp32,
)
from .common import (
    check_flag,
    check_hp_input,
    check_tensorwise_args,
    refuse_redefinition,
    triton_op,
    use_triton,
)
from .reference import FP8_DTYPES, amax_ref

# Before any definition: run a second time (another name, a reload), this module redefines nothing.
refuse_redefinition("float8::act_fwd", __name__)

__all__ = [
    "INV_SQRT_2PI",
    "KINDS",
    "SAVED_X_DTYPE",
    "SQRT1_2",
    "TRANSPOSE_CONFIG",
    "act_bwd",
    "act_bwd_ref",
    "act_bwd_with_amax",
    "act_bwd_triton",
    "act_fp8",
    "act_fp8_ref",
    "act_fp8_save_input",
    "act_fp8_save_input_ref",
    "act_fp8_triton",
    "act_fwd",
    "act_fwd_ref",
    "act_fwd_triton",
    "act_ref_fp32",
    "dact_fp8",
    "dact_fp8_ref",
    "dact_fp8_triton",
    "dact_ref_fp32",
    "dbias_partials",
    "launch_bwd",
    "launch_fwd",
]


# ---- input checks -----------------------------------------------------------------------------------


def _check(op, x, kind, bias, *, dy=None, transpose=False, x_scale_inv=None):
    if x_scale_inv is None:
        check_hp_input(x, op)
    else:
        _check_saved_x(op, x, x_scale_inv)
    if not isinstance(kind, str) or kind not in KINDS:
        raise ValueError(f"{op}: unknown activation kind {kind!r}; the kinds are {', '.join(KINDS)}")
    if x.dim() < (2 if transpose else 1):
        need = "at least 2 dims (..., M, N) to transpose" if transpose else "at least 1 dim"
        raise ValueError(f"{op}: x must have {need}, got shape {tuple(x.shape)}")
    n_in = x.shape[-1]
    if kind == "swiglu" and n_in % 2:
        raise ValueError(
            f"{op}: swiglu takes x (..., 2H) = [gate | linear] and needs an even last dim, got shape {tuple(x.shape)}"
        )
    if bias is not None:
        check_hp_input(bias, op, "bias")
        if tuple(bias.shape) != (n_in,):
            raise ValueError(
                f"{op}: bias has shape {tuple(bias.shape)} but x has shape {tuple(x.shape)}; bias must be ({n_in},)"
            )
        if bias.device != x.device:
            raise ValueError(f"{op}: bias is on {bias.device} but x is on {x.device}")
    if dy is not None:
        check_hp_input(dy, op, "dy")
        want = _out_shape(x, kind)
        if tuple(dy.shape) != tuple(want):
            raise ValueError(
                f"{op}: dy has shape {tuple(dy.shape)} but x has shape {tuple(x.shape)}; "
                f"for {kind} dy must be {tuple(want)}"
            )
        if dy.device != x.device:
            raise ValueError(f"{op}: dy is on {dy.device} but x is on {x.device}")


def _check_saved_x(op, x, x_scale_inv) -> None:
    """x given with x_scale_inv: the forward's FP8 copy of the activation's input (act_fp8_save_input)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FP8_DTYPES:
        raise TypeError(
            f"{op}: x_scale_inv is given, so x must be the FP8 copy of the input (act_fp8_save_input), "
            f"got {getattr(x, 'dtype', type(x).__name__)}"
        )
    rows = (*x.shape[:-1], 1)
    if (
        not isinstance(x_scale_inv, torch.Tensor)
        or x_scale_inv.dtype != torch.float32
        or tuple(x_scale_inv.shape) not in ((), rows)
        or not x_scale_inv.is_contiguous()
    ):
        raise ValueError(
            f"{op}: x_scale_inv must be a () float32 tensor (one scale) or a contiguous {rows} one (one per row "
            f"of x), got {getattr(x_scale_inv, 'dtype', type(x_scale_inv).__name__)} "
            f"{tuple(getattr(x_scale_inv, 'shape', ()))}"
        )
    if x_scale_inv.device != x.device:
        raise ValueError(f"{op}: x_scale_inv is on {x_scale_inv.device} but x is on {x.device}")


# ---- custom ops -------------------------------------------------------------------------------------


@triton_op("float8::act_fwd")
def act_fwd(x: torch.Tensor, kind: str, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(x + bias) in x.dtype; (..., N) -> (..., N), or (..., 2H) -> (..., H) for swiglu."""
    _check("act_fwd", x, kind, bias)
    if use_triton(x, writes_fp8=False):
        return act_fwd_triton(x, kind, bias)
    return act_fwd_ref(x, kind, bias)


def _check_fp8(op, x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose, dy=None, x_scale_inv=None):
    _check(op, x, kind, bias, dy=dy, transpose=with_transpose, x_scale_inv=x_scale_inv)
    check_tensorwise_args(dy if x_scale_inv is not None else x, fp8_dtype, scale, margin, power_of_2, op)
    check_flag(with_transpose, "with_transpose", op)


@triton_op("float8::act_fp8")
def act_fp8(
    x: torch.Tensor,
    kind: str,
    bias: Optional[torch.Tensor],
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """act(x + bias) quantized per tensor: (data, data_t, scale_inv, amax).

    scale None: current scaling (margin, power_of_2), two launches; else a one-element fp32 scale on x's
    device (delayed or static scaling; margin and power_of_2 ignored), one launch. data (..., N) fp8;
    data_t (..., N, M) fp8 if with_transpose, else an empty (0,) fp8 tensor; scale_inv () fp32;
    amax () fp32 = max|act(x + bias)|.
    """
    _check_fp8("act_fp8", x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose)
    if use_triton(x):
        return act_fp8_triton(x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose)
    return act_fp8_ref(x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose)


@triton_op("float8::act_fp8_save_input")
def act_fp8_save_input(
    x: torch.Tensor,
    kind: str,
    bias: Optional[torch.Tensor],
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """act_fp8, and x itself quantized for the backward: (data, data_t, scale_inv, amax, x_data, x_scale_inv).

    x_data: x (before the bias) in E4M3, per-tensor current scaling with margin 0, x's shape; x_scale_inv
    () fp32. The backward (dact_fp8 / act_bwd with x_scale_inv) reads it in place of x: half the bytes of
    a bf16 x. Same kernel passes as act_fp8 (pass 1 always runs: it also takes max|x|); the other outputs
    are bit for bit act_fp8's.
    """
    _check_fp8("act_fp8_save_input", x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose)
    if use_triton(x):
        return act_fp8_triton(x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose, save_input=True)
    return act_fp8_save_input_ref(x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose)


@triton_op("float8::act_bwd")
def act_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    kind: str,
    bias: Optional[torch.Tensor] = None,
    x_scale_inv: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """dx = dy * act'(x + bias), x's shape (2H columns for swiglu), in x.dtype (dy.dtype for an FP8 x).

    x_scale_inv: x is the forward's FP8 copy (act_fp8_save_input) and its values are x * x_scale_inv; () or,
    for a copy quantized per row, (..., 1)."""
    _check("act_bwd", x, kind, bias, dy=dy, x_scale_inv=x_scale_inv)
    if use_triton(x, writes_fp8=False):
        return act_bwd_triton(dy, x, kind, bias, x_scale_inv=x_scale_inv)
    return act_bwd_ref(dy, x, kind, bias, x_scale_inv)


def act_bwd_with_amax(dy: torch.Tensor, x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(act_bwd(dy, x, kind), max|dx|): the same dx, and the maximum of its values as a () float32 tensor,
    folded in by the pass that writes dx on CUDA (for the FP8 cast that reads dx next: ops/known_amax.py), from
    act_bwd_ref and amax_ref elsewhere. A plain function, not an op: eager callers only (ops/swiglu_fusion.py)."""
    _check("act_bwd", x, kind, None, dy=dy)
    if use_triton(x, writes_fp8=False):
        return act_bwd_triton(dy, x, kind, with_amax=True)
    dx = act_bwd_ref(dy, x, kind)
    return dx, amax_ref(dx)


@triton_op("float8::dact_fp8")
def dact_fp8(
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
    """The fused activation backward: dx = dy * act'(x + bias), quantized per tensor, and dbias.

    Returns (data (..., M, N_IN) fp8, data_t (..., N_IN, M) fp8 or (0,) without with_transpose,
    scale_inv () fp32, amax () fp32 = max|dx|, dbias (N_IN,) in dy.dtype = float32 row sums of dx).
    scale None: current scaling (margin, power_of_2); else a one-element fp32 scale (delayed scaling;
    margin and power_of_2 ignored). with_dbias=False skips the sums (no bias to train) and returns an
    empty (0,) dbias. kind "identity" with x = dy is a bias's backward (dbias and dy's FP8 cast).
    x_scale_inv: x is the forward's FP8 copy (act_fp8_save_input) and its values are x * x_scale_inv; () or,
    for a copy quantized per row, (..., 1).
    """
    _check_fp8("dact_fp8", x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose, dy, x_scale_inv)
    check_flag(with_dbias, "with_dbias", "dact_fp8")
    if use_triton(x):
        return dact_fp8_triton(
            dy, x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose, with_dbias, x_scale_inv=x_scale_inv
        )
    return dact_fp8_ref(
        dy, x, kind, bias, fp8_dtype, scale, margin, power_of_2, with_transpose, with_dbias, x_scale_inv
    )
