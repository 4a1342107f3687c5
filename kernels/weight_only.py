"""float8::fp8_weight_mm: y = x @ dequantize(w).t() (+ bias) for few tokens, reading the weight as FP8 bytes.

fp8_weight_mm(x, w_data, w_scale_inv, bias=None) -> y
    x (M, K) bfloat16/float16; w_data (N, K) FP8 (E4M3 or E5M2), rows contiguous; w_scale_inv () float32
    (one scale), (N, 1) (one per row) or (N / r, K / c) (one per r x c block, c a multiple of 16: the
    128x128 blocks of hub FP8 checkpoints, float8/checkpoint.py); bias (N,) in x's dtype or None. y (M, N)
    in x's dtype.

Why: at decode and small-batch sizes an inference Linear is bound by host time and by reading its weight,
not by arithmetic. The FP8xFP8 path quantizes the activation first (a kernel of ours) and then calls
cuBLASLt: two launches and their Python. Here one kernel reads the weight's FP8 bytes (half of bf16's),
widens each tile to x's dtype in registers and multiplies with the activation as it is. The widening is
exact (every E4M3 and E5M2 value is a bfloat16 and a float16 value), the products are exact in the float32
accumulator, and the weight's scale is applied to the accumulated row once: the result is the
high-precision product with the dequantized weight, rounded once to x's dtype. Block scales are applied to
each K step's fp32 partial product (a step lies in one block column) before it joins the sum. Only the order of the
float32 sums differs from `fp8_weight_mm_ref`, so tests compare with a tolerance, not bits. There is no
activation quantization at all: it is more accurate than the FP8xFP8 GEMM, not less.

Non-finite values propagate: inf/NaN in x or a NaN weight code give non-finite outputs through the dot, and
a poisoned weight (scale_inv NaN, the tensor contract) makes its rows NaN.

The grid runs one program per (BLOCK_N columns, BLOCK_M rows) tile over all of K (at 17-128 tokens with the
tile's roles swapped, the widened weight as the MMA's A operand: `CONFIGS`), except on narrow layers,
whose K is split (`split_k_for`) and whose fp32 partial sums are added in split order: by a second kernel,
or, in a prepared call, by the last program of each tile (counted with one atomic per tile; FIXUP). Either
way the result never depends on scheduling. The tile table `CONFIGS` comes from the sweep of
benchmarks/weight_only.py.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable, NamedTuple, Optional

import torch

from .common import cdiv, forward_ad_or_functorch_active, refuse_redefinition, triton_op, use_triton
from .launch import FastLauncher, run_compiled, runtime_settings
from .reference import FP8_DTYPES
from .scratch import Scratch
from .weight_only_kernel import _fp8_weight_mm_kernel, _split_k_sum_kernel

# Before any definition: run a second time (another name, a reload), this module redefines nothing.
refuse_redefinition("float8::fp8_weight_mm", __name__)

# Largest token count ops.Linear's inference forward sends here. On GPU time alone the activation's
# quantization + cuBLASLt's FP8 GEMM wins above 16 tokens (benchmarks/weight_only.py on the H100, 2026-11-25,
# the Llama-style layers summed: 0.20 ms here against 0.21 at 16 tokens, 0.25 against 0.20 at 32, 0.39
# against 0.22 at 128; bf16 0.31-0.34), but that path is three launches and a Float8Tensor: 264-293 us of
# host time per call at 17-128 tokens on the H100 machine against 38-75 us for this one. Eager forwards at
# these sizes wait for the host (the Llama-style model at 128 tokens ran at 0.27x bf16 eager with the
# FP8 x FP8 path above 16 tokens, 0.63x with this kernel up to 128), so this kernel serves up to 128. A
# leaner FP8 x FP8 call (x quantized per row in one launch, cuBLASLt's row-wise GEMM, prepared) still took
# 33 us of host against 12.7 for this kernel's prepared call, and lost at 64-128 tokens too (2026-11-26:
# docs/performance.md). Our own FP8 x FP8 kernel with the row quantization inside (kernels/rowwise_input_mm.py,
# one prepared launch) is faster on the GPU from 33 tokens and eagerly at best level with this one on the
# H100 machine's host: a recipe opts in (Recipe.inference_fp8_input_from), for CUDA graphs.
MAX_TOKENS = 128

# (max M, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP): the first row whose max M >= M, the tile
# with the least GPU time summed over the Llama-style layers (benchmarks/weight_only.py's method: H100, weights
# read from memory). SWAP: the widened weight tile is the MMA's A operand, held in registers, and x's tile
# (tokens as the narrow side) its B operand; unswapped, the widened weight is B, which Triton writes back to
# shared memory before each wgmma and then waits for that wgmma, every K step. At 1-16 tokens the unswapped
# tile, on mma.sync, reads the large layers' weights at 93-110% of the copy rate (2026-11-25). At 32-128
# tokens the swapped tiles are faster (both orientations swept, Triton 3.6, 2026-11-26; us per layer at 128
# tokens, unswapped -> swapped, bf16 F.linear in brackets): 4096x4096 27.4 -> 23.5 (15.4), 4096->6144
# 39.8 -> 30.9 (21.3), 4096->14336 62.9 -> 57.0 (45.7), 14336->4096 65.7 -> 49.2 (53.1); the layers summed,
# 0.204 -> 0.191 ms at 32 tokens and 0.235 -> 0.217 at 64 (bf16 0.264 and 0.269).
CONFIGS = [
    (16, 16, 32, 256, 4, 4, False),
    (32, 32, 128, 128, 8, 4, True),
    (64, 64, 128, 128, 8, 3, True),
    (128, 128, 128, 128, 8, 3, True),
]
# Above 64 tokens, a layer whose 128-column tiles alone fill the GPU keeps the weight as B in one wave of
# tiles without split K: 84.3 against 87.1 us swapped for 4096->28672 at 128 tokens, 90.3 against 96.3
# for the 4096->32768 head (bf16 88.7, 103.3).
WIDE_CONFIG = (128, 128, 64, 8, 3, False)
# At <= 16 tokens (the first CONFIGS row) a long K is split too, so that each program streams about this
# many BLOCK_K steps of its columns and 2-3 programs share an SM: the 14336->4096 down projection (128
# tiles of 32 columns, 56 steps of 256) took 27.4 us in 3 splits summed in the kernel against 32.7 in one;
# layers of K = 4096 (16 steps) stay whole, 0-5% faster so (H100, 2026-11-26; docs/performance.md,
# "Weight-only tiles at decode sizes"). The same sweep moved the row's tile from (32, 512, 3 stages) to
# (32, 256, 4 stages): the Llama-style layers summed 0.905 against 0.920 ms unsplit, 0.863 with these
# splits. Every path splits alike (the same bits eager, graphed and compiled); a compiled call, which
# sums in a second launch, pays one more launch on such a layer.
DECODE_STEPS_PER_SPLIT = 16
Config = tuple[int, int, int, int, int, bool]

# The tiles of the E4M3-x kernel (kernels/rowwise_input_mm.py), (max M, BLOCK_M, BLOCK_N, BLOCK_K, warps,
# stages, SWAP): the least GPU time summed over the Llama-style and HF Llama layers in a sweep on the H100
# (2026-11-26, Triton 3.6, weights read from memory; benchmarks/results/profile_rowwise_input_inference.txt): at 64
# tokens 182 us against 289 for the weight-only kernel and 321 for bf16 F.linear, at 128 tokens 217 against
# 362 and 337.
FP8_X_CONFIGS = [
    (64, 64, 64, 256, 4, 3, True),
    (128, 128, 64, 128, 4, 4, True),
]


def fp8_x_config_for(m: int | torch.SymInt) -> Config:
    """The E4M3-x tile for m tokens (FP8_X_CONFIGS; the last row above its bound)."""
    for row in FP8_X_CONFIGS:
        if m <= row[0]:
            return row[1:]
    return FP8_X_CONFIGS[-1][1:]


_launch = FastLauncher(_fp8_weight_mm_kernel)
_launch_sum = FastLauncher(_split_k_sum_kernel)
MAX_SPLIT_K = 8
MAX_COUNTER_SETS = 64  # per prepared call: (stream, host thread) pairs whose counters it keeps
SUM_BLOCK_N = 128


def config_for(m: int | torch.SymInt, n: int | torch.SymInt = 0, programs: int = 0) -> Config:
    """The tile serving m tokens of an n-column layer on a GPU of `programs` SMs: the CONFIGS row, or above
    64 tokens WIDE_CONFIG where n's 128-column tiles number at least `programs`."""
    if m > 64 and programs and cdiv(n, WIDE_CONFIG[1]) >= programs:
        return WIDE_CONFIG
    for row in CONFIGS:
        if m <= row[0]:
            return row[1:]
    return CONFIGS[-1][1:]


@functools.lru_cache(maxsize=None)
def _sm_count(device_index) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_k_for(n: int, k: int, block_n: int, block_k: int, programs: int, steps_per_split: int = 0) -> int:
    """How many K ranges a narrow layer's columns are split into, so that its tiles fill the GPU, and with
    steps_per_split, a long K into ranges of about that many BLOCK_K steps (DECODE_STEPS_PER_SPLIT).

    One program per BLOCK_N columns leaves most SMs idle on a narrow layer (4096x1024, a GQA k/v
    projection: 32 programs of 32 columns on 132 SMs); splitting K gives each tile up to MAX_SPLIT_K
    programs, each over at least two BLOCK_K steps. Their fp32 partial sums are added in a fixed order (by
    a second small kernel, or by the tile's last program in a prepared call): deterministic, unlike atomic
    adds. Wide layers (tiles >= programs) are split only for a long K."""
    tiles = -(-n // block_n)
    split = programs // tiles
    if steps_per_split:
        split = max(split, k // (steps_per_split * block_k))
    split = max(1, min(MAX_SPLIT_K, split))
    while split > 1 and k < 2 * block_k * split:
        split -= 1
    return split


@functools.lru_cache(maxsize=512)
def _plan(m: int, n: int, k: int, device_index: Optional[int], config=None, split_k=None, s_cols=None, x_fp8=False):
    """What a call of this shape launches: (config, split_k, k_per_split, grid, sum_grid), worked out once
    per shape (a bounded cache: the shapes of a model's Linears at each token count it serves). device_index
    None: not a CUDA device (the interpreter), which never splits K. s_cols: the columns of a block scale,
    which BLOCK_K must divide (a K step then lies in one block): BLOCK_K is cut to the largest power of
    two dividing it. At decode sizes a long K is split too (DECODE_STEPS_PER_SPLIT), on every path, so that
    eager, graphed and compiled calls add the same partials in the same order."""
    programs = _sm_count(device_index) if device_index is not None else 0
    config = config or (fp8_x_config_for(m) if x_fp8 else config_for(m, n, programs))
    if s_cols is not None:
        config = (*config[:2], min(config[2], s_cols & -s_cols), *config[3:])
    block_m, block_n, block_k = config[:3]
    if split_k is None:
        steps = DECODE_STEPS_PER_SPLIT if m <= CONFIGS[0][0] else 0
        split_k = split_k_for(n, k, block_n, block_k, programs, steps) if programs else 1
    k_per_split = cdiv(cdiv(k, split_k), block_k) * block_k
    grid = (cdiv(n, block_n), cdiv(m, block_m), split_k)
    return config, split_k, k_per_split, grid, (cdiv(n, SUM_BLOCK_N), cdiv(m, block_m))


def plan(
    m: int | torch.SymInt,
    n: int | torch.SymInt,
    k: int | torch.SymInt,
    device_index: Optional[int],
    config: Optional[Config] = None,
    split_k: Optional[int] = None,
    s_cols: Optional[int] = None,
    x_fp8: bool = False,
) -> tuple[Config, int, int, tuple[int, int, int], tuple[int, int]]:
    """_plan, cached for int sizes (x_fp8: x is E4M3, kernels/rowwise_input_mm.py's tile table). A size traced as a symbol (torch.compile with dynamic shapes, after a
    second token count) cannot key the cache (a SymInt is unhashable: 'unhashable type: non-nested SymInt'
    failed the compiled model on its second shape): worked out afresh, into the traced graph."""
    if type(m) is int and type(n) is int and type(k) is int:
        return _plan(m, n, k, device_index, config, split_k, s_cols, x_fp8)
    return _plan.__wrapped__(m, n, k, device_index, config, split_k, s_cols, x_fp8)


def scale_mode(w_data: torch.Tensor, w_scale_inv: torch.Tensor) -> tuple:
    """(SCALE_MODE, stride_s, s_rows, s_cols) of the kernel for this weight's scale: 0 one scale, 1 one per
    row ((N, 1)), 2 one per block ((N / s_rows, K / s_cols), e.g. 128x128 blocks of a hub checkpoint)."""
    if w_scale_inv.numel() == 1:
        return 0, 0, 1, 1
    n, k = w_data.shape
    rows, cols = w_scale_inv.shape
    if (rows, cols) == (n, 1):
        return 1, 0, 1, 1
    return 2, w_scale_inv.stride(0), n // rows, k // cols


class _Launch(NamedTuple):
    """One call's two launches, worked out: the outputs and every kernel argument (`_launch_plan`)."""

    y: torch.Tensor
    out: torch.Tensor  # y, or the (SPLIT_K, M, N) float32 partial sums
    args: tuple  # the main kernel's, in its parameter order
    grid: tuple
    options: dict
    sum_args: Optional[tuple]  # the summing kernel's, or None without a second launch
    sum_grid: tuple


def _launch_plan(x, w_data, w_scale_inv, bias, config=None, split_k=None, one_launch=False) -> _Launch:
    """one_launch: a split K sums its partials in the main kernel (FIXUP), counting into a fresh zeroed
    int32 tensor of one counter per output tile (args[7]); else by a second launch (sum_args)."""
    m, k = x.shape
    n = w_data.shape[0]
    mode, stride_s, s_rows, s_cols = scale_mode(w_data, w_scale_inv)
    config, split_k, k_per_split, grid, sum_grid = plan(
        m, n, k, x.device.index if x.is_cuda else None, config, split_k, s_cols if mode == 2 else None
    )
    block_m, block_n, block_k, warps, stages, swap = config
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    out = y if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    bias_arg, has_bias = (x, False) if bias is None else (bias, True)
    fixup = one_launch and split_k > 1
    counts = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=x.device) if fixup else y
    args = (
        x,
        x,  # sx_ptr: the slot of kernels/rowwise_input_mm.py's workspace (one PreparedMM call layout), not read
        w_data,
        w_scale_inv,
        bias_arg,
        out,
        y,
        counts,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        w_data.stride(0),
        stride_s,
        s_rows,
        s_cols,
        mode,
        has_bias,
        block_m,
        block_n,
        block_k,
        split_k,
        fixup,
        swap,
    )
    sum_args = None
    if split_k > 1 and not fixup:
        sum_args = (out, w_scale_inv, bias_arg, y, m, n, mode, has_bias, split_k, block_m, SUM_BLOCK_N)
    return _Launch(y, out, args, grid, {"num_warps": warps, "num_stages": stages}, sum_args, sum_grid)


_SUM_OPTIONS = {"num_warps": 4, "num_stages": 1}


def fp8_weight_mm_triton(
    x: torch.Tensor,
    w_data: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    config: Optional[Config] = None,
    split_k: Optional[int] = None,
) -> torch.Tensor:
    """The kernel, no checks (fp8_weight_mm checks). config: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SWAP);
    split_k: K ranges per column tile (default split_k_for on this GPU's SM count)."""
    call = _launch_plan(x, w_data, w_scale_inv, bias, config, split_k)
    _launch(call.grid, *call.args, **call.options)
    if call.sum_args is not None:
        _launch_sum(call.sum_grid, *call.sum_args, **_SUM_OPTIONS)
    return call.y


class PreparedMM:
    """fp8_weight_mm for repeated eager calls with one weight, one bias and one activation shape: the tile plan,
    the compiled kernel and every launch argument but x and y worked out once (`prepare`), so that a call
    does no validation and no specialization lookup in Python. ops.Linear keeps one per input shape of an
    FP8-only weight (its per-call host time is what decode-size eager forwards wait for: kernels/launch.py).

    A split-K call is one launch here (the kernel's FIXUP: the last program of a tile adds the partials, in
    split order, so the bits are the two-launch path's), which saves the summing kernel's launch: 11 us of
    host time per call on the H100 machine (29.7 against 18.5 us for a 4096x1024 layer at 16 tokens). Its
    tile counters are zero between launches and belong to one stream (two streams running the same layer
    at once would count into each other's): one set per stream and host thread (`_counts`), made on its
    first call. A CUDA graph never captures them: a call captured in a graph counts into graph memory that
    the graph zeroes (`prepare_call`). kernels/rowwise_input_mm.py's calls keep counters too (always).

    A call gives None, and the caller takes the checked path, where the fixed arguments would not fit: x not
    16-byte aligned (Triton specializes on it), another current device, Triton's runtime settings changed
    since, a call with counters while a CUDA graph is being captured, or a weight, scale or bias whose
    storage was swapped (same tensor object) for one off a 16-byte boundary or on another device. The
    caller guarantees the rest: x contiguous, its rows the prepared (M, K) (any leading dims: the kernel
    reads its pointer), of the prepared dtype on the prepared device, and the same weight tensors and bias
    (`matches`). y comes in the prepared `shape`."""

    __slots__ = ("w_data", "w_scale_inv", "bias", "device", "device_index", "shape", "settings")
    __slots__ += ("main", "grid", "tail", "split_shape", "split_numel", "tiles", "counts", "scratch")

    def matches(self, w_data: torch.Tensor, w_scale_inv: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
        """Whether these are the tensors this call was prepared for (identity: their values may change)."""
        return w_data is self.w_data and w_scale_inv is self.w_scale_inv and bias is self.bias

    def __call__(self, x: torch.Tensor, w_data, w_scale_inv, bias) -> Optional[torch.Tensor]:
        device = self.device_index
        x_ptr = x.data_ptr()
        if x_ptr % 16 or torch._C._cuda_getDevice() != device or runtime_settings() != self.settings:
            return None
        # x's dtype and device, which the caller guarantees are the prepared ones: new_empty parses one
        # argument where torch.empty parses three (5.9 against 7.0 us on the H100 machine's host, 2026-11-27).
        y = out = counts = x.new_empty(self.shape)
        key = None
        if self.tiles:
            key = self._stream_key(device)
            if key is None:
                return None
            counts = self._counts(key)
        if self.split_shape is not None:
            out = self.workspace(key, torch.float32, self.split_numel, self.split_shape)
            if out is None:
                return None
        sx = self.operands(x, key)
        if sx is None:
            return None
        # Addresses, not tensors: Triton's launcher asks the driver about each tensor argument's address
        # (cuPointerGetAttribute, to refuse CPU tensors): a launch with 8 tensors took 11.6 us of host on
        # the H100 machine, with their 8 addresses read in Python 10.5 (2026-11-27, .scratch micro-benchmark).
        # What the launcher checked is checked here: every address on the prepared device (x by the caller,
        # the weight's, scale's and bias's on each call: a storage swapped under the same tensor object, as
        # FSDP2 frees and re-gathers storages, is followed, never read stale) and 16-byte aligned, as the
        # kernel was compiled for. The tensors stay referenced here until the launch is queued.
        b = x if bias is None else bias
        sx_ptr, w_ptr, s_ptr, b_ptr = sx.data_ptr(), w_data.data_ptr(), w_scale_inv.data_ptr(), b.data_ptr()
        out_ptr, y_ptr, c_ptr = out.data_ptr(), y.data_ptr(), counts.data_ptr()
        if (sx_ptr | w_ptr | s_ptr | b_ptr | out_ptr | y_ptr | c_ptr) % 16 or not (w_ptr and s_ptr):
            # Not from torch's caching allocator (a pluggable one), or a swapped storage that is misaligned or
            # empty: Triton's own path.
            return None
        if w_data.get_device() != device or w_scale_inv.get_device() != device or b.get_device() != device:
            return None  # a storage swapped to another device: the checked path says so
        args = (x_ptr, sx_ptr, w_ptr, s_ptr, b_ptr, out_ptr, y_ptr, c_ptr, *self.tail)
        run_compiled(self.main, self.grid, device, args)
        return y

    def operands(self, x: torch.Tensor, key: Optional[tuple]) -> Optional[torch.Tensor]:
        """The kernel's sx argument for this call's x (None: the caller's checked path): x itself here (sx is
        not read). key: the call's stream and thread (`_stream_key`), None without counters."""
        return x

    def workspace(self, key: tuple, dtype: torch.dtype, numel: int, shape: tuple) -> Optional[torch.Tensor]:
        """A workspace of numel dtype elements for this call: the kept buffer of the caller's layers
        (kernels/scratch.py; the kernel reads only its address), or, where it keeps none, a fresh tensor of
        `shape`."""
        if self.scratch is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        if key is None:
            return None  # no stream key (a CUDA graph capture): never a kept buffer; the caller's checked path
        return self.scratch.get(key, dtype, numel, self.device)

    @staticmethod
    def _stream_key(device: int) -> Optional[tuple]:
        """The device, its current stream and the host thread: what counters and kept workspace belong to;
        None while a CUDA graph is captured. A graph would keep their addresses but not the tensors (this
        plan may be dropped while the graph lives: a reload, a new shape past the table's bound; a kept
        workspace may grow), and its replays, on whatever stream replays it, would count into the eager
        calls' counters: a capture takes `prepare`'s path, whose counters are graph memory zeroed by the
        graph itself. Keyed by the stream's handle and the host thread: one handle can name a stream of each
        thread (cudaStreamPerThread), whose launches may run at once; counters shared by two running
        launches would miscount (rowwise_input_mm's programs could wait for ever)."""
        if torch._C._cuda_isCurrentStreamCapturing():
            return None
        # The device too: stream handles repeat across devices (each one's default stream is 0), and a
        # model's layers on two GPUs share one kept workspace object (kernels/scratch.py).
        return (device, torch._C._cuda_getCurrentRawStream(device), threading.get_ident())

    def _counts(self, key: tuple) -> torch.Tensor:
        # Bounded: a pool of threads that come and go does not grow it without end (the oldest set is
        # dropped, freed in its stream's order).
        counts = self.counts.get(key)
        if counts is None:
            if len(self.counts) >= MAX_COUNTER_SETS:
                self.counts.pop(next(iter(self.counts), None), None)  # the set made first (a no-op if gone)
            counts = self.counts[key] = torch.zeros(self.tiles, dtype=torch.int32, device=self.device)
        return counts


def prepare(
    x: torch.Tensor,
    w_data: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_shape: Optional[tuple[int, ...]] = None,
    scratch: Optional[Scratch] = None,
) -> tuple[torch.Tensor, Optional[PreparedMM]]:
    """(y, PreparedMM or None): one fp8_weight_mm_triton call of checked operands (`supports`, K, one CUDA
    device, the bias's dtype and contiguity, x contiguous), and what repeats it with less host time
    (`prepare_call`). out_shape: the shape a repeated call's y is made in (the (M, N) rows, with the
    caller's leading dims: the caller then passes x with its own leading dims too, and no view is made on
    either side). scratch: the kept workspace of the caller's layers (kernels/scratch.py), which a repeated
    split-K call writes its partial sums to; None: a fresh tensor per call."""
    # A split K sums its partials in the main kernel (FIXUP), counting into a zeroed tensor made here.
    call = _launch_plan(x, w_data, w_scale_inv, bias, one_launch=True)
    return prepare_call(call, _launch, x, w_data, w_scale_inv, bias, out_shape, PreparedMM(), scratch)


def prepare_call(
    call: _Launch,
    launcher: FastLauncher,
    x: torch.Tensor,
    w_data: torch.Tensor,
    w_scale_inv: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_shape: Optional[tuple[int, ...]],
    p: PreparedMM,
    scratch: Optional[Scratch] = None,
) -> tuple[torch.Tensor, Optional[PreparedMM]]:
    """Launch `call` (one launch: a split K summed in it, its counters at args[7]) and fill `p` with what
    repeats it: (y, p), or (y, None) where a later call could not skip Triton's own launch path (the
    interpreter, another current device), and for a call made while a CUDA graph is captured (the graph
    repeats it). Shared by `prepare` and kernels/rowwise_input_mm.py's.

    The counters of a call made in a CUDA graph capture are graph memory and their zero fill a node of the
    graph: each replay zeroes them before the kernel reads them, whatever used that memory in between; they
    are never kept as the eager calls' counters (the plan is not returned)."""
    settings = runtime_settings()
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    main = launcher.launch_and_keep(call.grid, *call.args, **call.options)
    if capturing:
        return call.y, None
    aligned = all(t.data_ptr() % 16 == 0 for t in (*call.args[:8], call.y))
    if main is None or not aligned:
        return call.y, None
    p.w_data, p.w_scale_inv, p.bias, p.device, p.device_index = w_data, w_scale_inv, bias, x.device, x.device.index
    p.shape, p.settings, p.main, p.grid, p.tail = (
        tuple(call.y.shape) if out_shape is None else tuple(out_shape),
        settings,
        main,
        call.grid,
        call.args[8:],
    )
    counts = call.args[7]
    kept = counts is not call.y  # counters: a split K's, or the row quantization's (rowwise_input_mm)
    p.split_shape = tuple(call.out.shape) if call.out is not call.y else None
    p.split_numel = call.out.numel()
    p.scratch = scratch
    p.tiles = counts.numel() if kept else 0
    p.counts = {PreparedMM._stream_key(x.device.index): counts} if kept else {}  # not capturing (above)
    return call.y, p


def fp8_weight_mm_ref(
    x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The semantics: the float32 product of x with the widened FP8 weight, scaled per tensor, row or block,
    plus the bias, rounded once to x's dtype."""
    mode, _, s_rows, s_cols = scale_mode(w_data, w_scale_inv)
    if mode == 2:
        w = w_data.float() * w_scale_inv.repeat_interleave(s_rows, 0).repeat_interleave(s_cols, 1)
        acc = x.float() @ w.t()
    else:
        acc = x.float() @ w_data.float().t()
        acc = acc * (w_scale_inv.reshape(1, -1) if mode == 1 else w_scale_inv.reshape(()))
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


def supports(x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor) -> bool:
    """Whether fp8_weight_mm takes these operands: a 2-D bf16/fp16 x with contiguous rows, an (N, K) FP8
    weight with contiguous rows, and its scale: one, a contiguous (N, 1) per row, or (N / r, K / c) blocks
    with contiguous rows and c a multiple of 16 (the smallest K step of a dot)."""
    if not (
        x.dtype in (torch.bfloat16, torch.float16)
        and x.dim() == 2
        and x.stride(1) == 1
        and w_data.dim() == 2
        and w_data.dtype in FP8_DTYPES
        and w_data.stride(1) == 1
    ):
        return False
    if w_scale_inv.numel() == 1:
        return True
    if w_scale_inv.dim() != 2 or (w_scale_inv.stride(1) != 1 and w_scale_inv.shape[1] != 1):
        return False
    (n, k), (rows, cols) = w_data.shape, w_scale_inv.shape
    if (rows, cols) == (n, 1):
        return w_scale_inv.stride(0) == 1
    if rows <= 0 or cols <= 0 or n % rows or k % cols or (k // cols) % 16:
        return False
    r = n // rows  # a power of two, as in kernels/block_gemm.py: a hub ceil-div grid is never read as blocks
    return r & (r - 1) == 0


def fp8_weight_mm_prechecked(
    x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """fp8_weight_mm for a caller that has checked its operands (`supports`, K, one device, the bias's dtype):
    ops.Linear's inference forward. A plain eager call goes straight to the kernel, without a second
    validation in Python; a traced one (torch.compile, a dispatch mode) goes through the registered op."""
    return call_prechecked(fp8_weight_mm, fp8_weight_mm_triton, fp8_weight_mm_ref, x, w_data, w_scale_inv, bias)


def call_prechecked(
    op: Callable[..., torch.Tensor],
    triton_fn: Callable[..., torch.Tensor],
    ref_fn: Callable[..., torch.Tensor],
    x: torch.Tensor,
    *operands: Optional[torch.Tensor],
) -> torch.Tensor:
    """A checked caller's call of one of these GEMMs: traced (torch.compile, a dispatch mode, forward AD)
    through the registered op, else straight to its Triton launcher or, off the GPU, its reference (shared
    with kernels/rowwise_input_mm.py)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or forward_ad_or_functorch_active():
        return op(x, *operands)
    if use_triton(x):
        return triton_fn(x, *operands)
    return ref_fn(x, *operands)


def check_k_bias_devices(
    op: str, x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, bias: Optional[torch.Tensor]
) -> None:
    """The checks fp8_weight_mm and fp8_rowwise_input_mm share: x's K is the weight's, the bias a contiguous
    (N,) tensor of x's dtype, one device for all operands; `ValueError` naming `op` otherwise."""
    if x.shape[1] != w_data.shape[1]:
        raise ValueError(f"{op}: x has K={x.shape[1]} but w_data has K={w_data.shape[1]}")
    if bias is not None and (bias.shape != (w_data.shape[0],) or bias.dtype != x.dtype or bias.stride(0) != 1):
        raise ValueError(
            f"{op}: bias must be a contiguous ({w_data.shape[0]},) {x.dtype} tensor, got {tuple(bias.shape)} "
            f"{bias.dtype} stride {bias.stride()}"
        )
    devices = {t.device for t in (x, w_data, w_scale_inv, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"{op}: operands on several devices: {sorted(map(str, devices))}")


def _check(x, w_data, w_scale_inv, bias):
    op = "fp8_weight_mm"
    if not supports(x, w_data, w_scale_inv):
        raise ValueError(
            f"{op}: needs x (M, K) bfloat16/float16 and w_data (N, K) FP8, both with contiguous rows, and "
            f"w_scale_inv () or contiguous (N, 1) or (N / r, K / c) blocks (c a multiple of 16) float32; got x {tuple(x.shape)} {x.dtype} strides {x.stride()}, w_data "
            f"{tuple(w_data.shape)} {w_data.dtype} strides {w_data.stride()}, w_scale_inv {tuple(w_scale_inv.shape)} "
            f"strides {w_scale_inv.stride()}"
        )
    if w_scale_inv.dtype != torch.float32:
        raise TypeError(f"{op}: w_scale_inv must be float32, got {w_scale_inv.dtype}")
    check_k_bias_devices(op, x, w_data, w_scale_inv, bias)


@triton_op("float8::fp8_weight_mm")
def fp8_weight_mm(
    x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """y (M, N) in x's dtype = x @ (w_data * w_scale_inv).t() (+ bias); see the module docstring."""
    _check(x, w_data, w_scale_inv, bias)
    if use_triton(x):  # FP8 loads need sm_89+ in Triton
        return fp8_weight_mm_triton(x, w_data, w_scale_inv, bias)
    return fp8_weight_mm_ref(x, w_data, w_scale_inv, bias)
