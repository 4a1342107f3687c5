"""The Triton kernels of kernels/weight_only.py (fp8_weight_mm) and kernels/rowwise_input_mm.py: y = x @ w.t()
for few tokens, with w FP8 and x either in high precision (_fp8_weight_mm_kernel: widened weight tiles,
bf16/fp16 MMAs) or quantized per row to E4M3 (_rowwise_input_mm_kernel: _mm_tile with X_FP8, FP8 MMAs, the
row scales applied in the epilogue). The grid, the tile orientations, the split K and its in-kernel sum
(FIXUP) are described in kernels/weight_only.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .rowwise import _quantize_rows

# int32 counters per 128-byte line: _rowwise_input_mm_kernel keeps its ticket, ready and finished counters a
# line apart, so that the programs polling the ready count do not contend with the ticket draws.
COUNTER_LINE = tl.constexpr(32)


@triton.jit
def _epilogue(
    acc,
    sx_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    rm,
    rn,
    M,
    N,
    SCALE_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    X_FP8: tl.constexpr,
):
    """acc (BLOCK_M, BLOCK_N) fp32 -> y: x's row scales (X_FP8), the weight's scale (block scales were
    applied per K step), the bias, one rounding to y's dtype."""
    if X_FP8:
        acc = acc * tl.load(sx_ptr + rm, mask=rm < M, other=1.0)[:, None]
    if SCALE_MODE == 1:
        acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=1.0)[None, :]
    elif SCALE_MODE == 0:
        acc = acc * tl.load(s_ptr)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _sum_partials(
    part_ptr,
    sx_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    rm,
    rn,
    M,
    N,
    SCALE_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    X_FP8: tl.constexpr,
):
    """The SPLIT_K partial sums of the tile (rm, rn) added in split order, then the epilogue."""
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
    for i in range(1, SPLIT_K):
        acc += tl.load(part_ptr + i * M * N + offs, mask=ok, other=0.0, cache_modifier=".cg")
    _epilogue(acc, sx_ptr, s_ptr, b_ptr, y_ptr, rm, rn, M, N, SCALE_MODE, HAS_BIAS, X_FP8)


@triton.jit
def _mm_tile(
    x_ptr,  # (M, K) bf16/fp16, or with X_FP8 E4M3, stride (stride_xm, 1)
    sx_ptr,  # X_FP8: (M,) fp32, x's row scale_inv; else not read
    w_ptr,  # (N, K) fp8, stride (stride_wn, 1)
    s_ptr,  # () or (N,) or (N / s_rows, K / s_cols) fp32: scale_inv of the weight
    b_ptr,  # (N,) x dtype, or x_ptr when there is no bias (not read)
    y_ptr,  # (M, N) x dtype, contiguous; with SPLIT_K > 1 (SPLIT_K, M, N) fp32 partial sums instead
    out_ptr,  # FIXUP: (M, N) x dtype, contiguous, the output (y_ptr holds the partial sums); else not read
    count_ptr,  # FIXUP: int32, one per output tile, 0 between launches; else not read
    pid_n,  # this program's tile: its BLOCK_N columns of num_n, BLOCK_M rows, K range
    pid_m,
    pid_k,
    num_n,
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K: the K range of one split
    stride_xm,
    stride_wn,
    stride_s,  # SCALE_MODE 2: the scale's row stride
    s_rows,  # SCALE_MODE 2: rows of the weight per scale block
    s_cols,  # SCALE_MODE 2: columns per scale block, a multiple of BLOCK_K
    SCALE_MODE: tl.constexpr,  # 0: one scale, 1: one per row, 2: one per (s_rows, s_cols) block
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FIXUP: tl.constexpr,  # SPLIT_K > 1: the last program of a tile sums its partials (no second launch)
    SWAP: tl.constexpr,  # the widened weight as the MMA's A operand (registers), x as B: y's tile transposed
    X_FP8: tl.constexpr,  # x is FP8 (row scales sx_ptr): FP8 MMAs, each K step's product added in fp32
):
    """One program's output tile of _fp8_weight_mm_kernel (its parameters, and which tile)."""
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = pid_k * k_per_split
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm[:, None] < M
    n_ok = rn[None, :] < N
    k_end = tl.minimum(K, k0 + k_per_split)
    if SWAP:  # y.t()'s tile = w's (BLOCK_N, BLOCK_K) tile widened @ x.t()'s (BLOCK_K, BLOCK_M) tile
        x_ptrs = x_ptr + rm[None, :].to(tl.int64) * stride_xm + (k0 + rk)[:, None]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :]
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in range(k0, k_end, BLOCK_K):
            k_ok = rk < k_end - k
            a = tl.load(w_ptrs, mask=(rn[:, None] < N) & k_ok[None, :], other=0.0)
            b = tl.load(x_ptrs, mask=(rm[None, :] < M) & k_ok[:, None], other=0.0)
            if SCALE_MODE == 2:  # this K step lies in one block column: each weight row has one scale
                s = tl.load(s_ptr + (rn // s_rows).to(tl.int64) * stride_s + k // s_cols, mask=rn < N, other=1.0)
                acc_t += tl.dot(a.to(b.dtype), b) * s[:, None]
            elif X_FP8:  # a fresh product per step: the tensor cores' FP8 sum is narrower than fp32
                acc_t += tl.dot(a, b)
            else:
                acc_t = tl.dot(a.to(b.dtype), b, acc_t)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc = tl.trans(acc_t)
    else:
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :]
        w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None]  # (BLOCK_K, BLOCK_N) of w.t()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k0, k_end, BLOCK_K):
            k_ok = rk < k_end - k
            a = tl.load(x_ptrs, mask=m_ok & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok, other=0.0)
            if SCALE_MODE == 2:  # this K step lies in one block column: each output column has one scale
                s = tl.load(s_ptr + (rn // s_rows).to(tl.int64) * stride_s + k // s_cols, mask=rn < N, other=1.0)
                acc += tl.dot(a, b.to(a.dtype)) * s[None, :]
            elif X_FP8:
                acc += tl.dot(a, b)
            else:
                acc = tl.dot(a, b.to(a.dtype), acc)  # FP8 -> bf16/fp16 is exact; so are the products in fp32
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if SPLIT_K == 1:
        _epilogue(acc, sx_ptr, s_ptr, b_ptr, y_ptr, rm, rn, M, N, SCALE_MODE, HAS_BIAS, X_FP8)
    else:
        part = y_ptr + pid_k.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(part, acc, mask=m_ok & n_ok)
        if FIXUP:
            # Each program counts itself in after its partial is stored (release); the one that counts last
            # (acquire: it sees every partial) adds them in split order, as _split_k_sum_kernel does, so the
            # bits do not depend on which program finished last, and resets the counter for the next launch
            # on this stream. Loads bypass L1 (.cg), which another SM's stores do not update.
            tile = count_ptr + pid_m * num_n + pid_n
            tl.debug_barrier()  # every thread's part of the partial stored before the count (one thread's)
            if tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                tl.debug_barrier()
                _sum_partials(y_ptr, sx_ptr, s_ptr, b_ptr, out_ptr, rm, rn, M, N, SCALE_MODE, HAS_BIAS, SPLIT_K, X_FP8)
                tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _fp8_weight_mm_kernel(
    # fmt: off
    x_ptr,
    sx_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    out_ptr,
    count_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_s,
    s_rows,
    s_cols,
    SCALE_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FIXUP: tl.constexpr,
    SWAP: tl.constexpr,
    # fmt: on
):
    """kernels/weight_only.py's fp8_weight_mm: one program per output tile and K range (the grid), x in high
    precision; the parameters are _mm_tile's (sx_ptr not read: the slot of _rowwise_input_mm_kernel's
    workspace, one call layout in weight_only.PreparedMM)."""
    # fmt: off
    _mm_tile(
        x_ptr, sx_ptr, w_ptr, s_ptr, b_ptr, y_ptr, out_ptr, count_ptr,
        tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0),
        M, N, K, k_per_split, stride_xm, stride_wn, stride_s, s_rows, s_cols,
        SCALE_MODE, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, FIXUP, SWAP, False,
    )
    # fmt: on


@triton.jit
def _rowwise_input_mm_kernel(
    x_ptr,  # (M, K) bf16/fp16, stride (stride_xm, 1): the input, quantized here
    ws_ptr,  # uint8 workspace: x8 (M, K) E4M3 contiguous at 0, its (M,) fp32 row scale_inv at sx_offset
    w_ptr,  # (N, K) E4M3, stride (stride_wn, 1)
    s_ptr,  # () or (N,) fp32: scale_inv of the weight
    b_ptr,  # (N,) x dtype, or x_ptr when there is no bias (not read)
    y_ptr,  # as _fp8_weight_mm_kernel's (the partial sums when SPLIT_K > 1)
    out_ptr,  # SPLIT_K > 1: (M, N) x dtype, the output
    count_ptr,  # int32, 0 between launches, a COUNTER_LINE each: tickets, quantized row blocks, finished GEMM
    # programs; then one per split tile
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    sx_offset,  # a multiple of 16 bytes
    Q,  # QUANTIZE: programs quantizing x, Q_ROWS rows each; else 0
    NUM_N,  # the GEMM's tiles: NUM_N along N, NUM_M along M, SPLIT_K along K; one program each
    NUM_M,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    Q_ROWS: tl.constexpr,  # _quantize_rows' ROWS, BLOCK_K, SINGLE (kernels/rowwise.py row_blocks)
    Q_BLOCK_K: tl.constexpr,
    Q_SINGLE: tl.constexpr,
    SCALE_MODE: tl.constexpr,  # 0 or 1 (no block scales)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWAP: tl.constexpr,
    QUANTIZE: tl.constexpr,  # False: the workspace was filled before the launch (Q = 0), no counters but a split K's
):
    """kernels/rowwise_input_mm.py, one program per (1-D) grid entry. With QUANTIZE, in one launch: each
    program draws a ticket (an atomic counter); tickets 0..Q-1 quantize x per row into the workspace
    (kernels/rowwise.py's code: its bits) and count themselves in (release); every later ticket waits until
    all Q have (acquire), then runs the GEMM tile its ticket names (_mm_tile with X_FP8 on the workspace).
    The GEMM program that finishes last resets the counters for the next launch.

    Why tickets, not program ids: a program waits only for tickets drawn before its own, by programs that
    are already running and wait on nothing, so the wait ends whatever order the GPU starts programs in
    (CUDA promises none; the lowest program ids first is only what it does). Without QUANTIZE the program id
    names the tile and nothing waits."""
    x8_ptr = ws_ptr.to(tl.pointer_type(tl.float8e4nv))
    sx_ptr = (ws_ptr + sx_offset).to(tl.pointer_type(tl.float32))
    if QUANTIZE:
        pid = tl.atomic_add(count_ptr, 1, sem="relaxed", scope="gpu")
    else:
        pid = tl.program_id(0)
    if QUANTIZE and pid < Q:  # QUANTIZE False: no quantizing code compiled at all
        # fmt: off
        _quantize_rows(
            x_ptr, x8_ptr, sx_ptr, pid, M, K, stride_xm, tl.full((), 1.0, tl.float32),
            FP8_MAX, MIN_SCALE, False, Q_ROWS, Q_BLOCK_K, Q_SINGLE,
        )
        # fmt: on
        tl.debug_barrier()  # every thread's rows stored before the count (one thread's)
        tl.atomic_add(count_ptr + COUNTER_LINE, 1, sem="release", scope="gpu")
    else:
        if QUANTIZE:
            while tl.load(count_ptr + COUNTER_LINE, volatile=True) < Q:
                pass
            tl.atomic_add(count_ptr + COUNTER_LINE, 0, sem="acquire", scope="gpu")  # the quantized rows visible now
            tl.debug_barrier()
        tile = pid - Q
        # fmt: off
        _mm_tile(
            x8_ptr, sx_ptr, w_ptr, s_ptr, b_ptr, y_ptr, out_ptr, count_ptr + 3 * COUNTER_LINE,
            tile % NUM_N, (tile // NUM_N) % NUM_M, tile // (NUM_N * NUM_M), NUM_N,
            M, N, K, k_per_split, K, stride_wn, 0, 1, 1,
            SCALE_MODE, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, SPLIT_K > 1, SWAP, True,
        )
        # fmt: on
        if QUANTIZE:
            tl.debug_barrier()
            # Every program drew its ticket before this count completes (each GEMM program waited for all Q
            # quantizing ones): the last one may reset all three counters.
            done = count_ptr + 2 * COUNTER_LINE
            if tl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == NUM_N * NUM_M * SPLIT_K - 1:
                tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(count_ptr + COUNTER_LINE, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(done, 0, sem="relaxed", scope="gpu")


@triton.jit
def _quantize_into_workspace_kernel(
    x_ptr,  # (M, K) hp, unit column stride, row stride stride_xm
    ws_ptr,  # uint8 workspace of _rowwise_input_mm_kernel: x8 (M, K) E4M3 at 0, its (M,) fp32 scales at sx_offset
    sx_offset,
    M,
    K,
    stride_xm,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE: tl.constexpr,
):
    """The first of the two launches (kernels/rowwise_input_mm.py): x's rows quantized into the workspace,
    which the launch takes whole; the FP8 and float32 parts are addressed here, not through dtype views of
    its slices. Traced, such a view of the scales' slice made inductor (torch 2.11) copy the whole workspace's
    worth of float32 out of the 64-element view: a read past its end, which failed the GPU tier with an
    illegal address where the allocation ended there (2026-11-27). _rowwise_kernel's bits (the same body)."""
    # fmt: off
    _quantize_rows(
        x_ptr, ws_ptr.to(tl.pointer_type(tl.float8e4nv)), (ws_ptr + sx_offset).to(tl.pointer_type(tl.float32)),
        tl.program_id(0), M, K, stride_xm, tl.full((), 1.0, tl.float32),
        FP8_MAX, MIN_SCALE, False, ROWS, BLOCK_K, SINGLE,
    )
    # fmt: on


@triton.jit
def _split_k_sum_kernel(
    part_ptr,  # (SPLIT_K, M, N) fp32
    s_ptr,
    b_ptr,
    y_ptr,  # (M, N) x dtype
    M,
    N,
    SCALE_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # The partial sums in split order, always: the result does not depend on which program ran first.
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    _sum_partials(part_ptr, part_ptr, s_ptr, b_ptr, y_ptr, rm, rn, M, N, SCALE_MODE, HAS_BIAS, SPLIT_K, False)
