"""Cross-entropy of a chunk of logits rows, and its gradient written over the logits in place.

For each row i of logits z (C, V) with target t_i, label smoothing e and a gradient scale g (a () float32
tensor: 1/n_valid for a mean, 1 for a sum; or (C,), one per row):
    lse_i  = log sum_j exp(z_ij)                              (online: one running max and sum, float32)
    loss_i = lse_i - (1 - e) z_{i,t_i} - (e / V) sum_j z_ij   (F.cross_entropy's per-row loss)
    dz_ij  = g * (exp(z_ij - lse_i) - e / V - (1 - e) [j == t_i])   written over z_ij, in z's dtype
Rows whose target is ignore_index get loss 0, lse 0 and a zero gradient. Targets must be in [0, V) or
ignore_index (the caller checks). This is the part of a fused linear + cross-entropy between its GEMMs:
the logits chunk is read twice and written once, and never exists in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import use_triton
from .launch import on_device_of

# Columns per step of the online softmax, and warps per row. One (512, 128256) bf16 chunk on the H100
# (2026-11-22): 2048 x 8 warps 178 us, 4096 x 8 155 us, 8192 x 16 161 us, 16384 x 32 142 us (2.8 TB/s of
# reads and writes), 32768 x 32 159 us; the per-lane running max before this took two exps per element.
BLOCK_V = 16384
NUM_WARPS = 32


@triton.jit
def _ce_rows_kernel(
    z_ptr,  # (C, V) logits, row stride `stride`; overwritten by the gradient when WRITE_GRAD
    target_ptr,  # (C,) int64
    loss_ptr,  # (C,) float32
    lse_ptr,  # (C,) float32
    scale_ptr,  # () or (C,) float32: the gradient scale g, per row when scale_stride is 1
    scale_stride,
    stride,
    n_cols,
    ignore_index,
    smoothing,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    t = tl.load(target_ptr + row)
    cols = tl.arange(0, BLOCK)
    if t == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        if WRITE_GRAD:
            for start in range(0, n_cols, BLOCK):
                c = start + cols
                tl.store(base + c, tl.zeros([BLOCK], dtype=tl.float32).to(z_ptr.dtype.element_ty), mask=c < n_cols)
        return
    # Online softmax with one running max per row (not per lane): one exp per element, not two. The
    # kernel is bound by its exps as much as by memory (three per element cost ~1.7 ms of a 16384-token,
    # 128256-vocabulary loss on the H100).
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
    zsum = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        c = start + cols
        z = tl.load(base + c, mask=c < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # While the row has seen only -inf, s stays 0 (exp(-inf - -inf) would be NaN).
        s = tl.where(m_new == float("-inf"), 0.0, s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0))
        m = m_new
        zsum += tl.where(c < n_cols, z, 0.0)
    lse = m + tl.log(s)
    # A label outside [0, V) reads nothing: the caller refuses it once the call is queued (ops/cross_entropy.py
    # _check_labels), without a host sync before this kernel.
    z_t = tl.load(base + t, mask=(t >= 0) & (t < n_cols), other=0.0).to(tl.float32)
    loss = lse - (1.0 - smoothing) * z_t - smoothing / n_cols * tl.sum(zsum, axis=0)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)
    if WRITE_GRAD:
        g = tl.load(scale_ptr + row * scale_stride)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            z = tl.load(base + c, mask=c < n_cols, other=0.0).to(tl.float32)
            d = tl.exp(z - lse) - smoothing / n_cols - tl.where(c == t, 1.0 - smoothing, 0.0)
            tl.store(base + c, (d * g).to(z_ptr.dtype.element_ty), mask=c < n_cols)


def ce_rows_triton(
    z: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, ignore_index: int, smoothing: float, write_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and log-sum-exp of the logits z (and, with write_grad, their gradient in place), by the
    Triton kernel (no checks)."""
    rows, cols = z.shape
    loss = torch.empty(rows, dtype=torch.float32, device=z.device)
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    if rows:
        with on_device_of(z):
            _ce_rows_kernel[(rows,)](
                z,
                target,
                loss,
                lse,
                scale,
                0 if scale.dim() == 0 else scale.stride(0),
                z.stride(0),
                cols,
                ignore_index,
                float(smoothing),
                WRITE_GRAD=write_grad,
                BLOCK=BLOCK_V,
                num_warps=NUM_WARPS,
            )
    return loss, lse


def ce_rows_ref(
    z: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, ignore_index: int, smoothing: float, write_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch (float32 math), for the CPU path and the tests."""
    zf = z.float()
    valid = target != ignore_index
    t = torch.where(valid, target, 0).clamp(0, z.shape[1] - 1)  # out of range: refused by the caller, read nowhere
    lse = torch.logsumexp(zf, dim=-1)
    z_t = zf.gather(1, t[:, None]).squeeze(1)
    loss = lse - (1.0 - smoothing) * z_t - smoothing * zf.mean(dim=-1)
    loss = torch.where(valid, loss, 0.0)
    lse = torch.where(valid, lse, 0.0)
    if write_grad:
        d = torch.exp(zf - lse[:, None]) - smoothing / z.shape[1]
        d.scatter_add_(1, t[:, None], torch.full_like(z_t[:, None], -(1.0 - smoothing)))
        d = torch.where(valid[:, None], d * (scale if scale.dim() == 0 else scale[:, None]), 0.0)
        z.copy_(d)
    return loss, lse


def ce_rows(
    z: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, ignore_index: int, smoothing: float, write_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss (C,), lse (C,)) float32 of logits rows z (C, V) (float32/bfloat16/float16, unit column stride)
    with int64 targets (C,); with write_grad, z is overwritten by the gradient (module docstring)."""
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(
            f"ce_rows: logits must be 2-D with unit column stride, got shape {tuple(z.shape)} strides {z.stride()}"
        )
    if use_triton(z, writes_fp8=False):
        return ce_rows_triton(z, target, scale, ignore_index, smoothing, write_grad)
    return ce_rows_ref(z, target, scale, ignore_index, smoothing, write_grad)
