"""float8::fp8_weight_mm (kernels/weight_only.py): few-token activations times an FP8 weight, one launch.

The kernel against its reference on the interpreter (CPU) and on the GPU: the widening of the weight and the
products are exact, so only the order of float32 sums differs and outputs agree to a few float32 ulps before
the one rounding to x's dtype (compared after that rounding: at most one ulp of x's dtype apart). Also the
reference against float64 (it is what it says), non-finite propagation, the launcher's cache key, bad input.
"""

import pytest
import torch

import float8.kernels as K
from float8.kernels import weight_only as W
from float8.kernels.launch import FastLauncher, _arg_key

from .helpers import FP8, needs_interpreter

E4M3, E5M2 = FP8


def _operands(m, k, n, dtype=torch.bfloat16, fp8=E4M3, rowwise=False, bias=False, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g)).to(dtype)
    w = torch.randn(n, k, generator=g) * 0.05
    if rowwise:
        d, s = K.quantize_rowwise_ref(w, fp8, 0, False)
    else:
        d, _, s, _ = K.quantize_tensorwise_ref(w, fp8)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(x), move(d), move(s), move(b)


def _close_in_dtype(got, want, x, d, s):
    """Within the float32 summation error of K products (2 K 2^-24 sum|x w s|, for the two orders of the
    kernel and the reference) plus one ulp of the output dtype (the one rounding): what summing in
    another order may change, and nothing more."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double().cpu(), want.double().cpu()
    mode, _, s_rows, s_cols = W.scale_mode(d, s)
    if mode == 2:  # block scales: the magnitude of each product, scale included
        wd = d.cpu().double().abs() * s.double().cpu().repeat_interleave(s_rows, 0).repeat_interleave(s_cols, 1)
        mag = x.double().cpu().abs() @ wd.t()
    else:
        scale = s.double().cpu().reshape(1, -1) if s.numel() != 1 else s.double().cpu().reshape(())
        mag = (x.double().cpu().abs() @ d.cpu().double().abs().t()) * scale
    k = x.shape[1]
    allowed = 2 * k * 2.0**-24 * mag + torch.finfo(got.dtype).eps * w.abs()
    both_nan = g.isnan() & w.isnan()
    bad = ~both_nan & ~((g - w).abs() <= allowed)
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outputs outside the summation-order bound"


# Every tile the plan can pick: the table's rows (both orientations) and the wide layers' tile.
ALL_TILES = [row[1:] for row in W.CONFIGS] + [W.WIDE_CONFIG]
SHAPES = [(1, 64, 48), (3, 128, 40), (16, 256, 64), (17, 96, 32), (64, 128, 96), (100, 64, 130)]


# The interpreter's tl.dot computes on the raw bits of bfloat16 operands (pinned below), so the CPU tier runs
# the kernel with float16 activations; the GPU tier runs both.
HALF = torch.float16


@needs_interpreter
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("variant", ["e4m3", "e5m2", "rowwise-bias"])
def test_kernel_matches_reference_on_the_interpreter(m, k, n, variant):
    kw = {"e4m3": {}, "e5m2": dict(fp8=E5M2), "rowwise-bias": dict(rowwise=True, bias=True)}
    x, d, s, b = _operands(m, k, n, dtype=HALF, **kw[variant])
    _close_in_dtype(W.fp8_weight_mm_triton(x, d, s, b), W.fp8_weight_mm_ref(x, d, s, b), x, d, s)


@needs_interpreter
def test_strided_rows_of_x_and_every_config_row():
    x, d, s, _ = _operands(8, 128, 64, dtype=HALF)
    wide = torch.zeros(8, 256, dtype=x.dtype)
    wide[:, 64:192] = x
    xv = wide[:, 64:192]  # rows 256 apart, offset 64
    want = W.fp8_weight_mm_ref(x, d, s)
    for tile in ALL_TILES:
        _close_in_dtype(W.fp8_weight_mm_triton(xv, d, s, config=tile), want, x, d, s)


@needs_interpreter
def test_interpreter_dot_on_bfloat16_is_still_wrong():
    """Why the interpreter tier uses float16: if this starts failing, the interpreter got bfloat16 dots
    right and the tests above can take bfloat16 too."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot16(a_ptr, o_ptr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        tl.store(o_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, a))

    ones, out = torch.ones(16, 16, dtype=torch.bfloat16), torch.empty(16, 16)
    dot16[(1,)](ones, out)
    assert out[0, 0] != 16.0


@needs_interpreter
@pytest.mark.parametrize("swap", [False, True], ids=["weight-as-B", "swapped"])
@pytest.mark.parametrize("split_k,k", [(2, 256), (3, 384), (4, 200), (8, 1024)])
def test_split_k_sums_in_a_fixed_order(split_k, k, swap):
    """Narrow layers split K; the partial sums are added by a second kernel in split order: the result is
    within the summation bound and the same bits on every call."""
    x, d, s, b = _operands(16, k, 96, dtype=HALF, rowwise=True, bias=True)
    tile = (16, 32, 64, 4, 2, swap)
    got = W.fp8_weight_mm_triton(x, d, s, b, config=tile, split_k=split_k)
    _close_in_dtype(got, W.fp8_weight_mm_ref(x, d, s, b), x, d, s)
    assert torch.equal(got, W.fp8_weight_mm_triton(x, d, s, b, config=tile, split_k=split_k))


@needs_interpreter
@pytest.mark.parametrize("swap", [False, True], ids=["weight-as-B", "swapped"])
@pytest.mark.parametrize("scale", ["tensor", "row", "block"])
@pytest.mark.parametrize("m", [5, 40])  # one row tile, three
def test_one_launch_split_k_gives_the_two_launch_bits(scale, m, swap):
    """A prepared call's split K sums in its one kernel (FIXUP: the tile's last program adds the partials in
    split order): the bits of the two-launch path, and every tile counter back at zero after the launch."""
    g = torch.Generator().manual_seed(0)
    n, k = 48, 256
    x = torch.randn(m, k, generator=g).to(HALF)
    d = (torch.randn(n, k, generator=g) * 0.5).to(E4M3)
    s = {"tensor": torch.tensor(0.37), "row": torch.rand(n, 1, generator=g) + 0.5}.get(scale)
    s = torch.rand(n // 16, k // 32, generator=g) + 0.5 if s is None else s
    b = torch.randn(n, generator=g).to(HALF)
    tile = (16, 16, 32, 4, 1, swap)
    two = W._launch_plan(x, d, s, b, tile, 4, one_launch=False)
    W._launch(two.grid, *two.args, **two.options)
    W._launch_sum(two.sum_grid, *two.sum_args, **W._SUM_OPTIONS)
    one = W._launch_plan(x, d, s, b, tile, 4, one_launch=True)
    counts = one.args[7]
    assert one.sum_args is None and counts.numel() == one.grid[0] * one.grid[1]
    W._launch(one.grid, *one.args, **one.options)
    assert torch.equal(one.y, two.y)
    assert not counts.any()


def _block_operands(m, k, n, s_rows, s_cols, dtype=HALF, bias=False, device="cpu", seed=0):
    """x, FP8 weight bytes and one scale-inverse per (s_rows, s_cols) block, as a hub checkpoint holds them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    d = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(E4M3)  # no NaN codes (overflow casts to NaN)
    s = torch.rand(n // s_rows, k // s_cols, generator=g) * 1e-3 + 1e-4
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(x), move(d), move(s), move(b)


# 128x128 blocks; a hub checkpoint's ragged dims refined to blocks of gcd(dim, 128) (272 rows: 16, 576
# columns: 64); blocks narrower than the config's BLOCK_K (which the plan cuts to the block's width).
BLOCK_SHAPES = [(5, 256, 256, 128, 128), (3, 576, 272, 16, 64), (16, 128, 96, 32, 32), (17, 384, 64, 64, 128)]


@needs_interpreter
@pytest.mark.parametrize("m,k,n,s_rows,s_cols", BLOCK_SHAPES)
def test_block_scaled_weight_matches_reference_on_the_interpreter(m, k, n, s_rows, s_cols):
    x, d, s, b = _block_operands(m, k, n, s_rows, s_cols, bias=True)
    assert W.supports(x, d, s) and W.scale_mode(d, s)[0] == 2
    _close_in_dtype(W.fp8_weight_mm_triton(x, d, s, b), W.fp8_weight_mm_ref(x, d, s, b), x, d, s)
    for swap in (False, True):  # split K as a narrow layer would, block scales applied before the fixed-order sum
        tile = (16, 32, 64, 4, 2, swap)
        if k >= 256:
            _close_in_dtype(
                W.fp8_weight_mm_triton(x, d, s, b, config=tile, split_k=2), W.fp8_weight_mm_ref(x, d, s, b), x, d, s
            )


def test_block_scale_reference_is_the_blockwise_dequantized_product():
    x, d, s, _ = _block_operands(4, 576, 272, 16, 64, dtype=torch.float32)
    rows, cols = torch.arange(272) // 16, torch.arange(576) // 64
    w = d.double() * s.double()[rows][:, cols]
    assert torch.allclose(W.fp8_weight_mm_ref(x, d, s).double(), x.double() @ w.t(), rtol=1e-5, atol=1e-6)
    assert not W.supports(x.half(), d, torch.ones(17, 8))  # 576 / 8 = 72 columns a block: not a multiple of 16
    assert not W.supports(x.half(), d, torch.ones(272, 5))  # 5 does not divide 576
    # A hub checkpoint's ceil-div grid for 200 rows divides 200, but is not blocks of 100 rows: refused.
    assert not W.supports(x.half()[:, :256], torch.zeros(200, 256, dtype=E4M3), torch.ones(2, 2))


def test_split_k_only_for_layers_too_narrow_to_fill_the_gpu():
    assert W.split_k_for(1024, 4096, 32, 256, 132) == 4  # GQA k/v: 32 tiles -> 128 programs
    assert W.split_k_for(4096, 4096, 32, 256, 132) == 1  # 128 tiles: one wave already
    assert W.split_k_for(14336, 4096, 32, 256, 132) == 1
    assert W.split_k_for(1024, 4096, 64, 128, 132) == 8  # capped at MAX_SPLIT_K
    assert W.split_k_for(64, 512, 32, 256, 132) == 1  # each split keeps two BLOCK_K steps or more


def test_decode_sizes_split_a_long_k_too():
    """At <= 16 tokens a long K is split into ranges of about DECODE_STEPS_PER_SPLIT steps (the 14336->4096
    down projection into 3); K = 4096 layers stay whole; above 16 tokens only narrow layers split."""
    steps = W.DECODE_STEPS_PER_SPLIT
    assert W.split_k_for(4096, 14336, 32, 256, 132, steps) == 3
    assert W.split_k_for(4096, 4096, 32, 256, 132, steps) == 1
    assert W.split_k_for(1024, 4096, 32, 256, 132, steps) == 4  # narrow: the fill rule still decides
    assert W.split_k_for(4096, 14336 * 4, 32, 256, 132, steps) == W.MAX_SPLIT_K
    assert [W.plan(m, 4096, 14336, None)[1] for m in (1, 16, 17)] == [1, 1, 1]  # no GPU: never split


def test_tile_orientation_follows_tokens_and_layer_width():
    """Up to 16 tokens the widened weight is the MMA's B operand; at 17-128 tokens it is A (swapped), except
    above 64 tokens on a layer whose 128-column tiles alone fill the GPU (the WIDE_CONFIG tile)."""
    assert [W.config_for(m, 4096, 132)[5] for m in (1, 16, 17, 32, 64, 65, 128)] == [False, False] + [True] * 5
    assert W.config_for(128, 14336, 132)[5] and W.config_for(128, 28672, 132) == W.WIDE_CONFIG
    assert W.config_for(64, 28672, 132)[5] and W.config_for(128, 32768, 0)[5]  # no GPU: no wide rule
    assert W.plan(128, 28672, 4096, None, W.WIDE_CONFIG)[1] == 1 and W.plan(128, 4096, 4096, None)[0][5]


def test_plan_takes_a_symbolic_token_count():
    """Under torch.compile with dynamic shapes the token count is a SymInt, which cannot key the plan's
    cache (the GPU tier's compiled model failed on its second shape: 'unhashable type: non-nested SymInt').
    The plan is then worked out afresh, with the same values as the cached one at a concrete count."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    m = env.create_symintnode(env.create_symbol(16, torch._dynamo.source.ConstantSource("m")), hint=16)
    with pytest.raises(TypeError, match="unhashable"):
        hash(m)
    symbolic = W.plan(m, 512, 256, None)
    concrete = W.plan(16, 512, 256, None)
    assert symbolic[:3] == concrete[:3]
    assert [int(v) for v in symbolic[3]] == list(concrete[3]) and [int(v) for v in symbolic[4]] == list(concrete[4])


def test_reference_is_the_dequantized_product():
    x, d, s, b = _operands(5, 64, 32, rowwise=True, bias=True)
    want = (x.double() @ (d.double() * s.double()).t() + b.double()).to(x.dtype)
    _close_in_dtype(W.fp8_weight_mm_ref(x, d, s, b), want, x, d, s)


def test_non_finite_propagates():
    x, d, s, _ = _operands(4, 64, 32)
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    y = K.fp8_weight_mm(x, d, s)
    assert y[1].isinf().any() or y[1].isnan().any()
    assert y[2].isnan().all()
    assert torch.isfinite(y[[0, 3]]).all()
    poisoned = K.fp8_weight_mm(x[[0]], d, torch.tensor(float("nan")))
    assert poisoned.isnan().all()


def test_op_on_cpu_is_the_reference_and_passes_opcheck():
    x, d, s, b = _operands(6, 64, 32, bias=True)
    assert torch.equal(K.fp8_weight_mm(x, d, s, b), W.fp8_weight_mm_ref(x, d, s, b))
    tests = ["test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    torch.library.opcheck(torch.ops.float8.fp8_weight_mm.default, (x, d, s, b), test_utils=tests)


def test_compiles_fullgraph_aot_eager():
    x, d, s, b = _operands(6, 64, 32, bias=True)
    f = torch.compile(lambda x: K.fp8_weight_mm(x, d, s, b), fullgraph=True, backend="aot_eager")
    assert torch.equal(f(x), K.fp8_weight_mm(x, d, s, b))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda x, d, s, b: (x.float(), d, s, b), "bfloat16/float16"),
        (lambda x, d, s, b: (x, d.float(), s, b), "FP8"),
        (lambda x, d, s, b: (x, d.t(), s, b), "contiguous rows"),
        (lambda x, d, s, b: (x[:, :32], d, s, b), "K=32"),
        (lambda x, d, s, b: (x, d, s.double(), b), "float32"),
        (lambda x, d, s, b: (x, d, torch.ones(3, 1), b), r"w_scale_inv \(3, 1\)"),
        (lambda x, d, s, b: (x, d, s, torch.ones(5, dtype=x.dtype)), "bias must be"),
        (lambda x, d, s, b: (x.t().contiguous().t(), d, s, b), r"strides \(1, 6\)"),
    ],
)
def test_bad_input_names_the_problem(change, match):
    x, d, s, b = change(*_operands(6, 64, 64))
    with pytest.raises((ValueError, TypeError), match=match):
        K.fp8_weight_mm(x, d, s, b)


def test_launcher_key_tells_apart_what_triton_specializes():
    t = torch.zeros(64, dtype=torch.bfloat16)
    assert _arg_key(t) != _arg_key(t[1:])  # 16-byte alignment
    assert _arg_key(t) != _arg_key(t.float())  # dtype
    assert len({_arg_key(v) for v in (1, 16, 17, 2**31)}) == 4  # ==1, %16, neither, beyond int32
    assert _arg_key(True) != _arg_key(1)
    launcher = FastLauncher(W._fp8_weight_mm_kernel)
    assert launcher.constexpr == frozenset(range(17, 25))  # SCALE_MODE ... SPLIT_K, FIXUP, SWAP
    args = (t, t, t, t, t, t, t, t, 1, 16, 32, 32, 32, 32, 0, 1, 1, 1, False, 16, 32, 64, 1, False, False)
    other = args[:19] + (32,) + args[20:]  # BLOCK_M 16 -> 32: a constexpr, keyed by value
    assert launcher._key(args, (4, 3)) != launcher._key(other, (4, 3))
    assert launcher._key(args, (4, 3)) != launcher._key(args[:24] + (True,), (4, 3))  # the orientation
    assert launcher._key(args, (4, 3)) != launcher._key(args, (8, 3))
    # Constexprs by value, every other argument by _arg_key, the options last: the key's whole definition.
    want = tuple(a if i in launcher.constexpr else _arg_key(a) for i, a in enumerate(args)) + (4, 3)
    assert launcher._key(args, (4, 3)) == want
    assert _arg_key(torch.nn.Parameter(t)) == _arg_key(t) and _arg_key(None) == (type(None), None)
    assert _arg_key(1.5) == "f" and _arg_key(False) == ("b", False)


# ---- GPU tier ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 16, 32, 33, 64, 100, 128])
@pytest.mark.parametrize("variant", ["e4m3", "e5m2-fp16", "rowwise-bias"])
def test_gpu_matches_reference(m, variant):
    kw = {"e4m3": {}, "e5m2-fp16": dict(fp8=E5M2, dtype=torch.float16), "rowwise-bias": dict(rowwise=True, bias=True)}
    x, d, s, b = _operands(m, 512, 384, device="cuda", **kw[variant])
    got = K.fp8_weight_mm(x, d, s, b)
    want = W.fp8_weight_mm_ref(x.cpu(), d.cpu(), s.cpu(), None if b is None else b.cpu())
    _close_in_dtype(got, want, x, d, s)
    again = K.fp8_weight_mm(x, d, s, b)  # the launcher's cached path
    assert torch.equal(got, again)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,s_rows,s_cols", BLOCK_SHAPES + [(16, 4096, 1024, 128, 128), (1, 4096, 14336, 128, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_block_scaled_weight_matches_reference(m, k, n, s_rows, s_cols, dtype):
    x, d, s, b = _block_operands(m, k, n, s_rows, s_cols, dtype=dtype, bias=True, device="cuda")
    got = K.fp8_weight_mm(x, d, s, b)
    _close_in_dtype(got, W.fp8_weight_mm_ref(x.cpu(), d.cpu(), s.cpu(), b.cpu()), x, d, s)
    assert torch.equal(got, K.fp8_weight_mm(x, d, s, b))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1024, 4096])
def test_gpu_split_k_on_narrow_layers(n):
    x, d, s, b = _operands(16, 4096, n, device="cuda", bias=True)
    assert W.split_k_for(n, 4096, 32, 256, W._sm_count(0)) > 1 or n == 4096
    got = K.fp8_weight_mm(x, d, s, b)
    _close_in_dtype(got, W.fp8_weight_mm_ref(x.cpu(), d.cpu(), s.cpu(), b.cpu()), x, d, s)
    assert torch.equal(got, K.fp8_weight_mm(x, d, s, b))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ALL_TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("m", [1, 33, 100, 128])
@pytest.mark.parametrize("n", [1000, 6144])
def test_gpu_every_tile_matches_reference(tile, m, n):
    """Each tile the plan can pick, at ragged token counts and a ragged, split-K layer, both scale kinds."""
    for rowwise in (False, True):
        x, d, s, b = _operands(m, 4096, n, device="cuda", rowwise=rowwise, bias=rowwise)
        got = W.fp8_weight_mm_triton(x, d, s, b, config=tile)
        _close_in_dtype(got, W.fp8_weight_mm_ref(x.cpu(), d.cpu(), s.cpu(), None if b is None else b.cpu()), x, d, s)
    x, d, s, b = _block_operands(m, 4096, 1024, 128, 128, dtype=torch.bfloat16, bias=True, device="cuda")
    got = W.fp8_weight_mm_triton(x, d, s, b, config=tile)
    _close_in_dtype(got, W.fp8_weight_mm_ref(x.cpu(), d.cpu(), s.cpu(), b.cpu()), x, d, s)


@pytest.mark.gpu
def test_gpu_launcher_cache_respects_alignment():
    """The launcher's cache keys on 16-byte alignment as Triton does: an x 16 bytes into a buffer and one 2
    bytes in (separate buffers) each get a kernel compiled for them, in any order of calls."""
    x, d, s, _ = _operands(16, 256, 64, device="cuda")
    views = {}
    for name, offset in (("aligned", 8), ("odd", 1)):
        base = torch.zeros(16 * 256 + offset, dtype=x.dtype, device="cuda")
        views[name] = base[offset:].view(16, 256)
        views[name].copy_(x)
    assert views["aligned"].data_ptr() % 16 == 0 and views["odd"].data_ptr() % 16 != 0
    want = W.fp8_weight_mm_ref(x.cpu(), d.cpu(), s.cpu())
    for xv in (x, views["aligned"], views["odd"], x, views["odd"], views["aligned"]):
        _close_in_dtype(K.fp8_weight_mm(xv, d, s), want, x, d, s)
