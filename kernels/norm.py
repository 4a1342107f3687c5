"""RMSNorm and LayerNorm as custom ops (forward, forward straight to FP8, backward) and their launchers.

norm_fwd(x, weight, bias, eps, rms) -> (y, mean, rstd)
norm_fp8(x, weight, bias, eps, rms, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False)
    -> (data, data_t, scale_inv, amax, mean, rstd)
norm_bwd(dy, x, weight, mean, rstd, dres=None) -> (dx, dweight, dbias)      dx + dres, when given

rms=True is RMSNorm (no bias), rms=False LayerNorm (bias optional); x (..., N) is normalised over its last
dim, M = x.numel() // N rows. y, dx: x's shape and dtype; mean, rstd: (M,) float32, and RMSNorm's mean (and
dbias) an empty (0,) tensor, as a custom op cannot return None; data_t: (N, M), or (0,) without
with_transpose. scale None: current scaling; else a one-element float32 scale; amax = max|y| either way.
On a CUDA tensor each op runs norm_*_triton (the op's arguments, plus config: tile overrides), elsewhere
norm_*_ref. Numerics: float32, each step rounded in the references' order, so y and the FP8 bits equal
the references' given the same stats, and the stats agree to an ulp or two.

Kernels: kernels/norm_fwd_kernel.py, kernels/norm_bwd_kernel.py; references: kernels/norm_ref.py; argument
checks: kernels/norm_checks.py; design and measurements: docs/design.md §10. The launchers stay in
this module: tests/kernels/test_norm.py swaps the kernels in its namespace to record their launches.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .common import (
    cdiv,
    custom_op,
    fake_fp8_outputs,
    fp8_constants,
    margin_div,
    next_pow2,
    refuse_redefinition,
    use_triton,
)
from .launch import FastLauncher
from .norm_bwd_kernel import _norm_bwd_kernel
from .norm_checks import _check_bwd, _check_fp8, _check_fwd, _fake_stats, _rows
from .norm_fwd_kernel import ROWS_NOT_SPECIALIZED, _norm_fp8_tiles_kernel, _norm_rows_kernel
from .norm_ref import (
    _no_mean,
    norm_apply_ref,
    norm_bwd_ref,
    norm_fp8_ref,
    norm_fwd_ref,
    norm_stats_ref,
    quantize_y_ref,
    sqrt_rn,
)

# Before any definition: run a second time (another name, a reload), this module redefines nothing.
refuse_redefinition("float8::norm_fwd", __name__)

_rows_launcher = FastLauncher(_norm_rows_kernel)
_fp8_tiles_launcher = FastLauncher(_norm_fp8_tiles_kernel)
_bwd_launcher = FastLauncher(_norm_bwd_kernel)

__all__ = [
    "norm_fwd",
    "norm_fp8",
    "norm_bwd",
    "norm_fwd_triton",
    "norm_fp8_triton",
    "norm_bwd_triton",
    "norm_fwd_ref",
    "norm_fp8_ref",
    "norm_bwd_ref",
    "norm_stats_ref",
    "norm_apply_ref",
    "quantize_y_ref",
    "sqrt_rn",
    "ROWS_NOT_SPECIALIZED",
]

# Tile shapes (registers per thread on sm_90, from ptxas, in brackets; none spill). Row kernels: a tile of
# at most 8192 elements, >= 4096 while rows are short (<= 64 rows).
MAX_ONE_CHUNK = 8192  # N up to this: the whole row stays in registers (65-90)
CHUNK = 4096  # beyond it: loop over N in chunks of this many columns (80-98)
ROWS_TILE = 4096  # BLOCK_M * BLOCK_N of a row kernel when the row is short
TILES = dict(BLOCK_M=16, BLOCK_N=256, num_warps=8)  # FP8, second launch, no transpose (64-83)
TILES_T = dict(BLOCK_M=64, BLOCK_N=64, num_warps=8)  # ... with transpose: 64 B segments both ways (120-145)
BWD_ONE_CHUNK = 4096  # backward: whole rows up to this (89-95 at 16 warps; 8192 would spill)
BWD_CHUNKED = dict(BLOCK_M=2, BLOCK_N=2048, num_warps=8)  # beyond (86-115): 2 rows share a partial-dw update


# ---- launchers --------------------------------------------------------------------------------------


def _rows_config(N: int, config: Optional[dict] = None) -> dict:
    """Tile of a row kernel (also the backward's): the whole row up to MAX_ONE_CHUNK, else CHUNK-wide steps."""
    if config is not None:
        cfg = dict(config)
    else:
        block_n = next_pow2(N) if N <= MAX_ONE_CHUNK else CHUNK
        block_m = max(1, min(64, ROWS_TILE // block_n))
        tile = block_m * block_n
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if tile <= 2048 else 8 if tile <= 4096 else 16)
    cfg["ONE_CHUNK"] = N <= cfg["BLOCK_N"]
    return cfg


def _tiles_config(N: int, with_t: bool, config: Optional[dict] = None) -> dict:
    if config is not None:
        return dict(config)
    if with_t:
        return dict(TILES_T)
    block_n = min(TILES["BLOCK_N"], next_pow2(N))
    return dict(TILES, BLOCK_N=block_n, BLOCK_M=max(TILES["BLOCK_M"], min(64, ROWS_TILE // block_n)))


def _bwd_config(N: int, config: Optional[dict] = None) -> dict:
    if config is not None:
        cfg = dict(config)
    elif N <= BWD_ONE_CHUNK:
        block_n = next_pow2(N)
        block_m = max(1, min(64, ROWS_TILE // block_n))
        tile = block_m * block_n
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if tile <= 1024 else 8 if tile <= 2048 else 16)
    else:
        cfg = dict(BWD_CHUNKED)
    cfg["ONE_CHUNK"] = N <= cfg["BLOCK_N"]
    return cfg


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _rows_2d(t: torch.Tensor, N: int) -> torch.Tensor:
    """(M, N) view of t (a copy only when the rows cannot be addressed with one stride)."""
    t2 = t.reshape(-1, N)
    if t2.stride(-1) != 1 and t2.shape[-1] > 1:
        t2 = t2.contiguous()
    return t2


def _launch_rows(x2, weight, bias, eps, is_rms, y, amax, config):
    """Run _norm_rows_kernel over x2 (M, N): write y (amax None), or fold max|y| into amax (y None).
    Returns (mean or None, rstd).

    Both uses launch the same specialization: write_y is not specialized on, and in place of the missing
    tensor goes a fresh allocation of the same dtype (so of the same 16-byte alignment), never touched.
    """
    M, N = x2.shape
    dev = x2.device
    rstd = torch.empty((M,), dtype=torch.float32, device=dev)
    mean = None if is_rms else torch.empty((M,), dtype=torch.float32, device=dev)
    if M == 0:
        return mean, rstd
    write_y = y is not None
    if y is None:
        y = torch.empty((1,), dtype=x2.dtype, device=dev)
    if amax is None:
        amax = rstd  # fp32, fresh: the same specialization as a zeroed amax
    cfg = _rows_config(N, config)
    _rows_launcher(
        (cdiv(M, cfg["BLOCK_M"]),),
        x2,
        weight,
        bias if bias is not None else weight,
        y,
        mean if mean is not None else rstd,
        rstd,
        amax,
        M,
        N,
        float(N),
        x2.stride(0),
        float(eps),
        int(write_y),
        IS_RMS=is_rms,
        HAS_BIAS=bias is not None,
        ONE_CHUNK=cfg["ONE_CHUNK"],
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"],
        enable_fp_fusion=False,  # no FMA contraction: the references' rounding, step by step
    )
    return mean, rstd


def _contig(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.contiguous()


def norm_fwd_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    rms: bool,
    config: Optional[dict] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_fwd on the GPU: (y (x.shape, x.dtype), mean (M,) fp32 or (0,) for RMSNorm, rstd (M,) fp32)."""
    N = x.shape[-1]
    x2 = _rows_2d(x, N)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean, rstd = _launch_rows(x2, weight.contiguous(), _contig(bias), eps, rms, y, None, config)
    return y, _no_mean(x) if mean is None else mean, rstd


def _fp8_outputs(x, fp8_dtype, with_transpose):
    N = x.shape[-1]
    M = x.numel() // N
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    data_t = torch.empty((N, M) if with_transpose else (0,), dtype=fp8_dtype, device=x.device)
    return data, data_t


def _launch_tiles(x2, w, b, mean, rstd, amax, scale, data, data_t, with_t, margin, power_of_2, config):
    """Run _norm_fp8_tiles_kernel: cast y at scale_from_amax(amax) (scale None) or at `scale`.
    Returns scale_inv."""
    M, N = x2.shape
    if M == 0:  # no program to write it
        if scale is None:
            return torch.ones((), dtype=torch.float32, device=x2.device)  # amax 0 -> scale 1
        return scale.reshape(()).reciprocal()
    scale_inv = torch.empty((), dtype=torch.float32, device=x2.device)
    cfg = _tiles_config(N, with_t, config)
    tiles_n = cdiv(N, cfg["BLOCK_N"])
    _fp8_tiles_launcher(
        (cdiv(M, cfg["BLOCK_M"]) * tiles_n,),
        x2,
        w,
        b if b is not None else w,
        mean if mean is not None else rstd,
        rstd,
        amax,
        scale if scale is not None else amax,
        data,
        data_t if with_t else data,
        scale_inv,
        M,
        N,
        x2.stride(0),
        tiles_n,
        margin_div(margin),
        **fp8_constants(data.dtype),
        IS_RMS=mean is None,
        HAS_BIAS=b is not None,
        CURRENT=scale is None,
        POWER_OF_2=power_of_2,
        WITH_T=with_t,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"],
        enable_fp_fusion=False,
    )
    return scale_inv


def norm_fp8_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    rms: bool,
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
    config: Optional[dict] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_fp8 on the GPU, current scaling (scale None) or a given scale: two launches, no host sync.
    (data, data_t (N, M) or (0,), scale_inv, amax, mean (M,) or (0,) for RMSNorm, rstd)."""
    N = x.shape[-1]
    x2 = _rows_2d(x, N)
    w = weight.contiguous()
    b = _contig(bias)
    data, data_t = _fp8_outputs(x, fp8_dtype, with_transpose)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    if scale is not None:
        scale = scale.reshape(1).float()
    # Stats and amax(y) first, by the forward's own compiled kernel (so with its stats, bit for bit); then y
    # again, tile by tile, cast and written in both layouts. A given scale takes this route too, though one
    # row kernel could cast as it goes: its FP8 store changes the register layout Triton picks for the row
    # (16 elements a thread instead of 16 bytes), with it the order of the row sums, and the stats then
    # differ from the forward's in the last bit (measured on the H100: rstd in 28 of 129 fp16 rows).
    mean, rstd = _launch_rows(x2, w, b, eps, rms, None, amax, config)
    scale_inv = _launch_tiles(
        x2, w, b, mean, rstd, amax, scale, data, data_t, with_transpose, margin, power_of_2, config
    )
    return data, data_t, scale_inv, amax, _no_mean(x) if mean is None else mean, rstd


def norm_bwd_triton(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: Optional[torch.Tensor],
    rstd: torch.Tensor,
    config: Optional[dict] = None,
    dres: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_bwd on the GPU (mean None: RMSNorm): (dx (x.shape, x.dtype), dweight (N,), dbias (N,) or (0,)
    for RMSNorm, in weight.dtype). Partial column sums per program, summed by torch (no atomics).
    dres: added to dx (see norm_bwd)."""
    is_rms = mean is None
    N = x.shape[-1]
    x2 = _rows_2d(x, N)
    dy2 = _rows_2d(dy, N)
    dres2 = _rows_2d(dres, N) if dres is not None else x2
    M = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cfg = _bwd_config(N, config)
    row_blocks = cdiv(M, cfg["BLOCK_M"])
    if "GRID" in cfg:
        grid = cfg["GRID"]
    elif x.device.type == "cuda":
        grid = 2 * _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device())
    else:
        grid = 4
    grid = max(1, min(grid, row_blocks))
    dw_part = torch.zeros((grid, N), dtype=torch.float32, device=x.device)
    db_part = None if is_rms else torch.zeros((grid, N), dtype=torch.float32, device=x.device)
    if M:
        _bwd_launcher(
            (grid,),
            dy2,
            x2,
            weight.contiguous(),
            mean.contiguous() if mean is not None else rstd,
            rstd.contiguous(),
            dx,
            dres2,
            dw_part,
            db_part if db_part is not None else dw_part,
            M,
            N,
            float(N),
            x2.stride(0),
            dy2.stride(0),
            dres2.stride(0),
            row_blocks,
            IS_RMS=is_rms,
            HAS_DRES=dres is not None,
            ONE_CHUNK=cfg["ONE_CHUNK"],
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            num_warps=cfg["num_warps"],
            enable_fp_fusion=False,
        )
    dw = dw_part.sum(0).to(weight.dtype)
    db = weight.new_empty((0,)) if is_rms else db_part.sum(0).to(weight.dtype)
    return dx, dw, db


# ---- public ops -------------------------------------------------------------------------------------


@custom_op("float8::norm_fwd")
def norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, rms: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y (x.shape, x.dtype), mean (M,) fp32 or (0,) for RMSNorm, rstd (M,) fp32).

    rms=True: y = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps), no bias. rms=False: y = (x - mean) *
    rstd * weight + bias (bias optional), rstd = 1/sqrt(var + eps).
    """
    _check_fwd("norm_fwd", x, weight, bias, eps, rms)
    if use_triton(x, writes_fp8=False):
        return norm_fwd_triton(x, weight, bias, eps, rms)
    return norm_fwd_ref(x, weight, bias, eps, rms)


@norm_fwd.register_fake
def _(x, weight, bias, eps, rms):
    _check_fwd("norm_fwd", x, weight, bias, eps, rms)
    return (torch.empty_like(x, memory_format=torch.contiguous_format), *_fake_stats(x, rms))


@custom_op("float8::norm_fp8")
def norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    rms: bool,
    fp8_dtype: torch.dtype,
    scale: Optional[torch.Tensor] = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_fwd straight to FP8, per-tensor scaling: y is never written in high precision.

    scale None: current scaling (scale from max|y|, margin, power_of_2); else a one-element fp32 scale on
    x's device (delayed or static scaling; margin and power_of_2 ignored). Returns (data (x.shape) fp8,
    data_t (N, M) fp8 or (0,) without with_transpose, scale_inv () fp32, amax () fp32 = max|y| (for a
    delayed-scaling history), mean (M,) fp32 or (0,) for RMSNorm, rstd (M,) fp32).
    """
    _check_fp8("norm_fp8", x, weight, bias, eps, rms, fp8_dtype, scale, margin, power_of_2, with_transpose)
    if use_triton(x):
        return norm_fp8_triton(x, weight, bias, eps, rms, fp8_dtype, scale, margin, power_of_2, with_transpose)
    return norm_fp8_ref(x, weight, bias, eps, rms, fp8_dtype, scale, margin, power_of_2, with_transpose)


@norm_fp8.register_fake
def _(x, weight, bias, eps, rms, fp8_dtype, scale=None, margin=0, power_of_2=False, with_transpose=False):
    _check_fp8("norm_fp8", x, weight, bias, eps, rms, fp8_dtype, scale, margin, power_of_2, with_transpose)
    t_shape = (x.shape[-1], _rows(x)) if with_transpose else None
    return (*fake_fp8_outputs(x, x.shape, t_shape, fp8_dtype), *_fake_stats(x, rms))


@custom_op("float8::norm_bwd")
def norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: Optional[torch.Tensor],
    rstd: torch.Tensor,
    dres: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx (x.shape, x.dtype), dweight (N,), dbias (N,) in weight.dtype) from the forward's stats.

    mean None: RMSNorm, and dbias is an empty (0,) tensor of weight.dtype. dres (x's shape and dtype): a
    gradient added to dx, as `dx + dres` would (the residual branch's, for a norm right after a Residual).
    """
    _check_bwd("norm_bwd", dy, x, weight, mean, rstd, dres)
    if use_triton(x, writes_fp8=False):
        return norm_bwd_triton(dy, x, weight, mean, rstd, dres=dres)
    return norm_bwd_ref(dy, x, weight, mean, rstd, dres)


@norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, dres=None):
    _check_bwd("norm_bwd", dy, x, weight, mean, rstd, dres)
    dbias = weight.new_empty((0,) if mean is None else weight.shape)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight), dbias
