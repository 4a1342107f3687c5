"""transpose_fp8(data) -> data.t() contiguous: an FP8 matrix copied into the other layout.

A per-tensor FP8 GEMM operand that exists in one layout only (a gradient whose producer wrote the rows:
lean activation memory, ops/linear.py) gets its transpose here when the weight-gradient GEMM needs it.
Bits are moved, never rounded: the result equals `data.t().contiguous()` bit for bit. torch's own strided
copy of a 1-byte transpose is far from the copy bandwidth; this one moves (TILE, TILE) tiles through
shared memory as 16-bit lanes (the activation kernels' fastest transpose: kernels/activation_math.py, `_fp8_t`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, refuse_redefinition, triton_op
from .launch import FastLauncher
from .reference import FP8_DTYPES

# Before any definition: run a second time (another name, a reload), this module redefines nothing.
refuse_redefinition("float8::transpose_fp8", __name__)

TILE_M, TILE_N, NUM_WARPS = 64, 128, 4


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, M, N, TILE_M: tl.constexpr, TILE_N: tl.constexpr):
    # x: (M, N) uint8 contiguous; y: (N, M) uint8 contiguous
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * TILE_M + tl.arange(0, TILE_M)
    cols = pid_n * TILE_N + tl.arange(0, TILE_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tile = tl.load(x_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0)
    t = tl.trans(tile.to(tl.uint16)).to(tl.uint8)
    tl.store(y_ptr + cols.to(tl.int64)[:, None] * M + rows[None, :], t, mask=tl.trans(mask))


_launch_transpose = FastLauncher(_transpose_kernel)


def transpose_fp8_triton(data: torch.Tensor) -> torch.Tensor:
    """(N, M) contiguous copy of the (M, N) FP8 matrix data."""
    x = data.contiguous()
    m, n = x.shape
    y = torch.empty((n, m), dtype=x.dtype, device=x.device)
    if x.numel():
        grid = (cdiv(m, TILE_M), cdiv(n, TILE_N))
        _launch_transpose(
            grid, x.view(torch.uint8), y.view(torch.uint8), m, n, TILE_M=TILE_M, TILE_N=TILE_N, num_warps=NUM_WARPS
        )
    return y


def transpose_fp8_ref(data: torch.Tensor) -> torch.Tensor:
    """The contiguous transpose of FP8 data's last two dims: the semantics of transpose_fp8. A new tensor
    always (`contiguous()` returns a (1, N), (N, 1) or empty transpose as a view of data, which a registered
    op must not return)."""
    return data.t().clone(memory_format=torch.contiguous_format)


def _check(data) -> None:
    if not isinstance(data, torch.Tensor) or data.dtype not in FP8_DTYPES:
        raise TypeError(f"transpose_fp8 takes an FP8 tensor, got {getattr(data, 'dtype', type(data).__name__)}")
    if data.dim() != 2:
        raise ValueError(f"transpose_fp8 takes a 2-D tensor, got shape {tuple(data.shape)}")


@triton_op("float8::transpose_fp8")
def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """data (M, N) FP8 -> (N, M) contiguous, the same bits (Triton on CUDA, torch elsewhere)."""
    _check(data)
    if data.device.type == "cuda":
        return transpose_fp8_triton(data)
    return transpose_fp8_ref(data)
