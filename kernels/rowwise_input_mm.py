"""float8::fp8_rowwise_input_mm: x quantized per row to E4M3, then an FP8 x FP8 GEMM with an E4M3 weight.

fp8_rowwise_input_mm(x, w_data, w_scale_inv, bias=None) -> y
    x (M, K) bfloat16/float16 with contiguous rows; w_data (N, K) E4M3, rows contiguous; w_scale_inv () or
    contiguous (N, 1) float32; bias (N,) in x's dtype or None. y (M, N) in x's dtype.

    x8, sx = quantize_rowwise(x, E4M3)  (x8 (M, K) E4M3, sx (M,) its row scale_inv)
    y = (x8 @ w_data.t()) * sx * w_scale_inv (+ bias)
    both in kernels/weight_only_kernel.py `_rowwise_input_mm_kernel`, in one launch or two:
    - one launch (a prepared eager call, `prepare`): each program draws a ticket; the first tickets quantize
      x's rows into a workspace (kernels/rowwise.py's code) and count themselves in; the others wait for the
      count, then run their GEMM tile on the workspace; the last of them zeroes the counters for the next
      launch (one set per stream and thread).
    - two launches (the checked op, torch.compile, a CUDA graph capture): a small kernel over the same row
      quantization (kernels/weight_only_kernel.py _quantize_into_workspace_kernel) fills the workspace, then
      the same kernel runs without quantizing programs. The bits are the one launch's.

Why: ops.Linear's inference forward with an FP8-only weight at 33-128 tokens, where the recipe asks for it
(`Recipe.inference_fp8_input_from`, off by default: eagerly it is at best level with the weight-only
kernel, docs/inference.md; under CUDA graphs it is the faster kernel). There the weight-only kernel is no
longer bound by reading the weight: it widens every weight tile for a bf16 MMA, and its time grows with
the tokens. FP8 MMAs do half the work on the same weight bytes. GPU time summed over the Llama-style and HF
Llama layers on the H100 (2026-11-26, weights read from memory, benchmarks/results/profile_rowwise_input_inference.txt):
at 128 tokens 217 us plus 16 us of row quantization, against 362 us for the weight-only kernel and 337 us
for bf16 F.linear; at 64 tokens 182 + 18 against 289 and 321. cuBLASLt's row-wise FP8 GEMM
(torch._scaled_mm) is as fast on the GPU, but its call costs about 20 us of host against about 5 for a
prepared launch of this kernel, and eager forwards at these sizes wait for the host (docs/performance.md).
Why two paths: eagerly one launch and one allocation fewer per layer is what counts; on the GPU the one
launch is slower (its GEMM programs draw tickets behind the quantizing ones and wait for them, which run
with the GEMM's 4 warps): the layer shapes of the sweep summed on the H100, 217 against 186 us at 128
tokens, 169 against 152 at 33 (10-14%), up to 23% on a small layer (k/v at 128 tokens, 20.5 against 15.8;
benchmarks/results/profile_rowwise_input_inference.txt, 3d); a CUDA graph, waiting for no host, would pay
that. The two launches are three GPU operations on a split-K layer (its counters' zero fill).

Numerics: one scale per row of x (current scaling, no margin: each row uses E4M3's whole range), the
products exact in float32, each K step's FP8 MMA result added to a float32 accumulator (Hopper's FP8 MMA
accumulates in fewer bits than float32: with the sum left inside the MMA over a 14336-long K, a sweep found
outputs off by more than 1%), the row and weight scales applied once, the bias, one rounding to x's dtype.
`fp8_rowwise_input_mm_ref` states it; only the order of the float32 sums differs. The result is an FP8
Linear's (x's rounding joins the weight's), where the weight-only kernel keeps x as it is.

Non-finite input: a row of x holding inf or NaN gets a NaN scale (common.scale_from_amax), so that row of y
is NaN; the other rows are unaffected. A poisoned weight (scale_inv NaN) makes its columns NaN.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import weight_only
from .common import cdiv, fp8_constants, refuse_redefinition, triton_op, use_triton
from .launch import FastLauncher
from .rowwise import quantize_rowwise_ref, row_blocks, warps_for
from .scratch import Scratch
from .weight_only_kernel import COUNTER_LINE, _quantize_into_workspace_kernel, _rowwise_input_mm_kernel

# Before any definition: run a second time (another name, a reload), this module redefines nothing.
refuse_redefinition("float8::fp8_rowwise_input_mm", __name__)

E4M3 = torch.float8_e4m3fn


def supports(x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor) -> bool:
    """Whether fp8_rowwise_input_mm takes these operands: a 2-D bf16/fp16 x with contiguous rows, an (N, K)
    E4M3 weight with contiguous rows, and its scale: one float32, or a contiguous (N, 1) one per row."""
    if not (
        x.dtype in (torch.bfloat16, torch.float16)
        and x.dim() == 2
        and x.stride(1) == 1
        and w_data.dim() == 2
        and w_data.dtype == E4M3
        and w_data.stride(1) == 1
        and w_scale_inv.dtype == torch.float32
    ):
        return False
    if w_scale_inv.numel() == 1:
        return True
    return tuple(w_scale_inv.shape) == (w_data.shape[0], 1) and w_scale_inv.stride(0) == 1


def fp8_rowwise_input_mm_ref(
    x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The semantics: x quantized per row (quantize_rowwise_ref, E4M3, no margin), the float32 product of the
    two FP8 operands' values, times x's row scales, times the weight's scales, plus the bias, rounded once
    to x's dtype."""
    x8, sx = quantize_rowwise_ref(x, E4M3)
    acc = (x8.float() @ w_data.float().t()) * sx
    acc = acc * (w_scale_inv.reshape(1, -1) if w_scale_inv.numel() > 1 else w_scale_inv.reshape(()))
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


_launch = FastLauncher(_rowwise_input_mm_kernel)
_launch_quantize = FastLauncher(_quantize_into_workspace_kernel)
# Rows up to this long are quantized from registers by the quantizing programs (4 warps: 32 floats a thread).
Q_MAX_SINGLE_K = 4096


def _launch_plan(x, w_data, w_scale_inv, bias, config=None, split_k=None, quantize=True) -> weight_only._Launch:
    """The launch of _rowwise_input_mm_kernel for these operands: y, the split K's partial sums, a fresh
    workspace (x8 and its row scales: args[1], the scales at byte args[14]) and, where the kernel counts
    (quantizing programs, a split K), fresh zeroed counters at args[7] (else y there, not read). config and
    split_k as in weight_only.fp8_weight_mm_triton (default: weight_only.FP8_X_CONFIGS and split_k_for).
    quantize=False: no quantizing programs (Q = 0), the caller fills the workspace first."""
    m, k = x.shape
    n = w_data.shape[0]
    device_index = x.device.index if x.is_cuda else None
    config, split_k, k_per_split, grid, _ = weight_only.plan(m, n, k, device_index, config, split_k, None, True)
    block_m, block_n, block_k, warps, stages, swap = config
    q_rows, q_block_k, q_single = row_blocks(k, Q_MAX_SINGLE_K)
    quantize = quantize and m * n > 0  # no GEMM program to read x8 (or reset the counters): nothing to launch
    q = cdiv(m, q_rows) if quantize else 0
    sx_offset = cdiv(m * k, 16) * 16
    ws = torch.empty(sx_offset + 4 * m, dtype=torch.uint8, device=x.device)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    out = y if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    # Counters: tickets, quantized row blocks, finished GEMM programs (a COUNTER_LINE each), then one per
    # output tile of a split K.
    # Without quantizing programs only a split K counts (in a CUDA graph each zero fill is a node: none where
    # nothing reads it).
    tiles = grid[0] * grid[1] if split_k > 1 else 0
    size = 3 * COUNTER_LINE.value + tiles
    counts = torch.zeros(size, dtype=torch.int32, device=x.device) if quantize or tiles else y
    bias_arg, has_bias = (x, False) if bias is None else (bias, True)
    c = fp8_constants(E4M3)
    args = (x, ws, w_data, w_scale_inv, bias_arg, out, y, counts, m, n, k, k_per_split, x.stride(0))
    args += (w_data.stride(0), sx_offset, q, grid[0], grid[1], c["FP8_MAX"], c["MIN_SCALE"], q_rows, q_block_k)
    args += (q_single, 0 if w_scale_inv.numel() == 1 else 1, has_bias, block_m, block_n, block_k, split_k, swap)
    args += (quantize,)
    grid = (q + grid[0] * grid[1] * grid[2],)
    return weight_only._Launch(y, out, args, grid, {"num_warps": warps, "num_stages": stages}, None, ())


def fp8_rowwise_input_mm_triton(
    x: torch.Tensor,
    w_data: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[weight_only.Config] = None,
    split_k: Optional[int] = None,
) -> torch.Tensor:
    """Two launches, no checks (fp8_rowwise_input_mm checks): x quantized per row into the workspace
    (_quantize_into_workspace_kernel), then the GEMM (the same kernel as a prepared call's, without quantizing
    programs). config and split_k as in weight_only.fp8_weight_mm_triton (default:
    weight_only.FP8_X_CONFIGS and split_k_for)."""
    call = _launch_plan(x, w_data, w_scale_inv, bias, config, split_k, quantize=False)
    m, k = x.shape
    if m * call.y.shape[1] == 0:
        return call.y  # nothing to compute (no launch with an empty grid)
    ws, offset = call.args[1], call.args[14]
    # Into the workspace as a whole (kernels/weight_only_kernel.py says why no dtype views of its slices),
    # in kernels/rowwise.py's blocks, with its constants: quantize_rowwise's bits.
    rows, block_k, single = row_blocks(k)
    c = fp8_constants(E4M3)
    args = (x, ws, offset, m, k, x.stride(0), c["FP8_MAX"], c["MIN_SCALE"], rows, block_k, single)
    _launch_quantize((cdiv(m, rows),), *args, num_warps=warps_for(rows, block_k))
    _launch(call.grid, *call.args, **call.options)
    return call.y


class PreparedRowwiseMM(weight_only.PreparedMM):
    """fp8_rowwise_input_mm for repeated eager calls (weight_only.PreparedMM's contract): one prepared launch,
    its counters kept per stream and thread (as a split K's are), its workspace (x8 and the row scales,
    M K rounded up to 16 bytes, plus 4 M) the kept buffer of the caller's layers (kernels/scratch.py: one per
    device, stream and thread, the size of the largest call, whatever the shapes served), or made afresh per
    call where the caller keeps none."""

    __slots__ = ("ws_bytes",)

    def operands(self, x: torch.Tensor, key: Optional[tuple]) -> Optional[torch.Tensor]:
        """The workspace (the kernel's sx argument); None: the caller's checked path."""
        return self.workspace(key, torch.uint8, self.ws_bytes, (self.ws_bytes,))


def prepare(
    x: torch.Tensor,
    w_data: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_shape: Optional[tuple[int, ...]] = None,
    scratch: Optional[Scratch] = None,
) -> tuple[torch.Tensor, Optional[PreparedRowwiseMM]]:
    """(y, PreparedRowwiseMM or None): one call of checked operands (`supports`, K, one CUDA device, the
    bias's dtype and contiguity, x contiguous), and what repeats it with less host time; None where
    weight_only.prepare_call gives None (the interpreter, a CUDA graph capture, another current device).
    scratch: the kept workspace (kernels/scratch.py) for the repeated calls; None: one per call."""
    if (x.is_cuda and torch.cuda.is_current_stream_capturing()) or x.shape[0] * w_data.shape[0] == 0:
        # A CUDA graph waits for no host: the two launches, whose GEMM waits for nothing (the module
        # docstring). An empty y: nothing to launch or prepare.
        return fp8_rowwise_input_mm_triton(x, w_data, w_scale_inv, bias), None
    call = _launch_plan(x, w_data, w_scale_inv, bias)
    p = PreparedRowwiseMM()
    p.ws_bytes = call.args[1].numel()
    return weight_only.prepare_call(call, _launch, x, w_data, w_scale_inv, bias, out_shape, p, scratch)


def fp8_rowwise_input_mm_prechecked(
    x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """fp8_rowwise_input_mm for a caller that has checked its operands (ops.Linear's inference forward): a
    plain eager call goes straight to the kernels; a traced one (torch.compile, a dispatch mode) through the
    registered op."""
    triton_fn, ref_fn = fp8_rowwise_input_mm_triton, fp8_rowwise_input_mm_ref
    return weight_only.call_prechecked(fp8_rowwise_input_mm, triton_fn, ref_fn, x, w_data, w_scale_inv, bias)


def _check(x, w_data, w_scale_inv, bias):
    op = "fp8_rowwise_input_mm"
    if not supports(x, w_data, w_scale_inv):
        raise ValueError(
            f"{op}: needs x (M, K) bfloat16/float16 and w_data (N, K) float8_e4m3fn, both with contiguous rows, "
            f"and w_scale_inv one float32 or a contiguous (N, 1); got x {tuple(x.shape)} {x.dtype} strides "
            f"{x.stride()}, w_data {tuple(w_data.shape)} {w_data.dtype} strides {w_data.stride()}, w_scale_inv "
            f"{tuple(w_scale_inv.shape)} {w_scale_inv.dtype}"
        )
    weight_only.check_k_bias_devices(op, x, w_data, w_scale_inv, bias)


@triton_op("float8::fp8_rowwise_input_mm")
def fp8_rowwise_input_mm(
    x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """y (M, N) in x's dtype = rowwise-quantized x @ (w_data * w_scale_inv).t() (+ bias); see the module
    docstring."""
    _check(x, w_data, w_scale_inv, bias)
    if use_triton(x):
        return fp8_rowwise_input_mm_triton(x, w_data, w_scale_inv, bias)
    return fp8_rowwise_input_mm_ref(x, w_data, w_scale_inv, bias)
