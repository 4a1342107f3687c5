"""float8::fp8_rowwise_input_mm (kernels/rowwise_input_mm.py): one launch whose first programs quantize x per
row to E4M3 and whose others then run the FP8 x FP8 GEMM (kernels/weight_only_kernel.py
_rowwise_input_mm_kernel).

Against the reference on the interpreter (CPU) and on the GPU: the row quantization is bit-exact with
quantize_rowwise's (read back from the launch's workspace), the products of two FP8 values are exact in
float32, so only the order of float32 sums differs (each K step's FP8 MMA result is added in float32: on the
GPU a long K would otherwise drift past this bound). Also: the counters are zero after each launch, launches
back to back keep their bits, non-finite rows stay in their row, bad input is refused by name, the op
compiles, and a prepared call repeats the op's bits.
"""

import pytest
import torch

import float8.kernels as K
from float8.kernels import rowwise_input_mm as R
from float8.kernels import weight_only as W

from .helpers import FP8, needs_interpreter

E4M3, E5M2 = FP8


def _operands(m, k, n, dtype=torch.bfloat16, rowwise=False, bias=False, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    x[0] *= 100  # a loud row: each row has its own scale
    w = torch.randn(n, k, generator=g) * 0.05
    if rowwise:
        d, s = K.quantize_rowwise_ref(w, E4M3, 0, False)
    else:
        d, _, s, _ = K.quantize_tensorwise_ref(w, E4M3)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(x), move(d), move(s), move(b)


def _close(got, x, d, s, b):
    """Within the float32 summation error of K exact products (2 K 2^-24 sum|x8 w| sx s, for the kernel's
    order and the reference's) plus one ulp of the output dtype: what another order may change."""
    x, d, s = x.cpu(), d.cpu(), s.cpu()
    want = R.fp8_rowwise_input_mm_ref(x, d, s, None if b is None else b.cpu()).double()
    assert got.dtype == x.dtype and got.shape == want.shape
    x8, sx = K.quantize_rowwise_ref(x, E4M3)
    scale = s.double().reshape(1, -1) if s.numel() != 1 else s.double().reshape(())
    mag = (x8.double().abs() @ d.double().abs().t()) * sx.double() * scale
    allowed = 2 * x.shape[1] * 2.0**-24 * mag + torch.finfo(got.dtype).eps * want.abs()
    g = got.double().cpu()
    bad = ~(g.isnan() & want.isnan()) & ~((g - want).abs() <= allowed)
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outputs outside the summation-order bound"


# The interpreter's tl.dot reads bfloat16 operands' raw bits (tests/kernels/test_weight_only.py): the CPU tier
# runs float16 activations; the GPU tier both.
HALF = torch.float16
TILES = [row[1:] for row in W.FP8_X_CONFIGS] + [(16, 16, 32, 4, 1, False), (16, 16, 32, 4, 1, True)]


@needs_interpreter
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (33, 128, 40), (40, 256, 64)])
@pytest.mark.parametrize("variant", ["tensor", "row-bias"])
def test_matches_reference_on_the_interpreter(m, k, n, variant):
    x, d, s, b = _operands(m, k, n, dtype=HALF, rowwise=variant == "row-bias", bias=variant == "row-bias")
    _close(R.fp8_rowwise_input_mm_triton(x, d, s, b), x, d, s, b)
    for tile in TILES[2:]:
        _close(R.fp8_rowwise_input_mm_triton(x, d, s, b, config=tile, split_k=2), x, d, s, b)


def _workspace(call, m, k):
    """The quantized rows the first programs left in a launch's workspace: (x8, sx)."""
    ws, offset = call.args[1], call.args[14]
    return ws[: m * k].view(E4M3).view(m, k), ws[offset : offset + 4 * m].view(torch.float32)


def _launch_and_check_workspace(x, d, s, b, tile=None, split=None):
    """One launch; its workspace holds quantize_rowwise's bits, its counters are back to zero; y returned."""
    m, k = x.shape
    call = R._launch_plan(x, d, s, b, tile, split)
    R._launch(call.grid, *call.args, **call.options)
    x8, sx = _workspace(call, m, k)
    want8, want_s = K.quantize_rowwise(x, E4M3)
    assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8)) and torch.equal(sx, want_s.view(-1))
    assert not call.args[7].any(), "counters left non-zero for the next launch"
    return call.y


@needs_interpreter
@pytest.mark.parametrize("k", [128, 5000], ids=["row-in-registers", "row-read-twice"])
@pytest.mark.parametrize("swap", [False, True], ids=["weight-as-B", "swapped"])
@pytest.mark.parametrize("split", [1, 3])
def test_first_programs_quantize_x_as_quantize_rowwise_does(k, swap, split):
    """The one launch's first programs write quantize_rowwise's bits (x8 and the row scales) before any GEMM
    program reads them, and the last GEMM program zeroes the counters; its y is the two-launch path's (row
    quantization, then the kernel without quantizing programs) to the bit, and a split K (summed in the
    launch) stays within the summation-order bound."""
    x, d, s, b = _operands(40, k, 48, dtype=HALF, rowwise=True, bias=True)
    tile = (16, 16, 32, 4, 1, swap)
    y = _launch_and_check_workspace(x, d, s, b, tile, split)
    assert torch.equal(y, R.fp8_rowwise_input_mm_triton(x, d, s, b, tile, split))
    _close(y, x, d, s, b)


@needs_interpreter
@pytest.mark.parametrize("m,k,n", [(0, 64, 16), (3, 64, 0), (3, 0, 16)])
def test_empty_operands_give_the_references_result_and_leave_no_count(m, k, n):
    """No rows, no columns or no K: the reference's result (empty, or the bias alone), one launch or two; a
    launch without GEMM programs quantizes nothing (nothing would reset its counters)."""
    x, d, s, b = _operands(max(m, 1), max(k, 1), max(n, 1), dtype=HALF, bias=True)
    x, d, b = x[:m, :k].contiguous(), d[:n, :k].contiguous(), b[:n].contiguous()
    want = R.fp8_rowwise_input_mm_ref(x, d, s, b)
    call = R._launch_plan(x, d, s, b)
    R._launch(call.grid, *call.args, **call.options)
    assert call.args[7] is call.y or not call.args[7].any()
    for got in (call.y, R.fp8_rowwise_input_mm_triton(x, d, s, b), K.fp8_rowwise_input_mm(x, d, s, b)):
        assert got.shape == want.shape and torch.equal(got, want)


def test_reference_is_the_fp8_product_of_the_row_quantized_input():
    x, d, s, b = _operands(5, 64, 24, rowwise=True, bias=True)
    x8, sx = K.quantize_rowwise_ref(x, E4M3)
    exact = (x8.double() * sx.double()) @ (d.double() * s.double()).t() + b.double()
    got = R.fp8_rowwise_input_mm_ref(x, d, s, b).double()
    assert torch.allclose(got, exact, rtol=2.0**-7, atol=1e-6)


def test_a_non_finite_row_stays_in_its_row():
    x, d, s, _ = _operands(4, 64, 16)
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    y = K.fp8_rowwise_input_mm(x, d, s)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert torch.isfinite(y[[0, 3]]).all()
    poisoned = K.fp8_rowwise_input_mm(x[[0]], d, torch.tensor(float("nan")))
    assert poisoned.isnan().all()


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda x, d, s, b: (x.float(), d, s, b), "bfloat16/float16"),
        (lambda x, d, s, b: (x, d.to(E5M2), s, b), "float8_e4m3fn"),
        (lambda x, d, s, b: (x.t().contiguous().t(), d, s, b), "contiguous rows"),
        (lambda x, d, s, b: (x, d, torch.ones(3, 1), b), "w_scale_inv"),
        (lambda x, d, s, b: (x[:, :32], d, s, b), "K=32"),
        (lambda x, d, s, b: (x, d, s, torch.zeros(5, dtype=x.dtype)), "bias"),
    ],
)
def test_bad_input_is_refused_by_name(bad, match):
    x, d, s, b = _operands(4, 64, 16)
    with pytest.raises(ValueError, match=match):
        K.fp8_rowwise_input_mm(*bad(x, d, s, b))


def test_registered_op_and_compiles_without_a_graph_break():
    x, d, s, b = _operands(6, 64, 32, rowwise=True, bias=True)
    assert torch.equal(K.fp8_rowwise_input_mm(x, d, s, b), R.fp8_rowwise_input_mm_ref(x, d, s, b))
    tests = ["test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    torch.library.opcheck(torch.ops.float8.fp8_rowwise_input_mm.default, (x, d, s, b), test_utils=tests)
    f = torch.compile(lambda x: K.fp8_rowwise_input_mm(x, d, s, b), fullgraph=True, backend="aot_eager")
    assert torch.equal(f(x), K.fp8_rowwise_input_mm(x, d, s, b))


# ---- GPU tier ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m", [33, 64, 100, 128])
@pytest.mark.parametrize("k,n", [(4096, 1024), (4096, 6144), (14336, 4096)])
@pytest.mark.parametrize("variant", ["bf16", "fp16-row-bias"])
def test_gpu_matches_reference(m, k, n, variant):
    """The model shapes at the table's token counts: split-K layers (1024 and 4096 columns) and a 14336-long K
    (FP8 MMAs left to sum over it drift past the bound)."""
    kw = {"bf16": {}, "fp16-row-bias": dict(dtype=torch.float16, rowwise=True, bias=True)}[variant]
    x, d, s, b = _operands(m, k, n, device="cuda", **kw)
    got = K.fp8_rowwise_input_mm(x, d, s, b)
    _close(got, x, d, s, b)
    assert torch.equal(got, K.fp8_rowwise_input_mm(x, d, s, b))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 33, 128])
@pytest.mark.parametrize("k,n,split", [(4096, 1024, None), (14336, 4096, None), (4096, 28672, 1), (4096, 4096, 8)])
def test_gpu_one_launch_quantizes_then_multiplies_launch_after_launch(m, k, n, split):
    """On the GPU the first programs' x8 and row scales are quantize_rowwise's bits and reach every GEMM
    program (the y of 30 back-to-back launches, each on fresh x, is within the reference's bound and has the
    op's bits, which come from two launches), and the counters are zero after each: no launch reads a row
    before it is written, or a stale one."""
    x, d, s, b = _operands(m, k, n, device="cuda", rowwise=True, bias=True)
    _close(_launch_and_check_workspace(x, d, s, b, split=split), x, d, s, b)
    xs = [torch.randn_like(x) * (1 + i) for i in range(30)]  # fresh rows: a stale x8 would show
    calls = [R._launch_plan(v, d, s, b, None, split) for v in xs]
    for call in calls:
        R._launch(call.grid, *call.args, **call.options)
    for v, call in zip(xs, calls):
        assert torch.equal(call.y, K.fp8_rowwise_input_mm(v, d, s, b)) and not call.args[7].any()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [40, 128])
def test_gpu_prepared_call_repeats_the_ops_bits(m):
    """A prepared call (one launch, kept counters) on fresh inputs, call after call: the op's bits (two
    launches), and its counters back to zero after each."""
    x, d, s, b = _operands(m, 4096, 1024, device="cuda", bias=True)  # a split K: the one-launch sum
    y, prepared = R.prepare(x, d, s, b)
    assert prepared is not None and torch.equal(y, K.fp8_rowwise_input_mm(x, d, s, b))
    for i in range(6):
        v = torch.randn_like(x) * (1 + i)
        assert torch.equal(prepared(v, d, s, b), K.fp8_rowwise_input_mm(v, d, s, b))
        torch.cuda.synchronize()
        assert all(not c.any() for c in prepared.counts.values())


@pytest.mark.gpu
def test_gpu_inductor_gives_the_eager_bits():
    """Compiled (inductor launches the triton_op's kernel with its own code): eager's bits, and no dtype view of
    a slice of the workspace in the graph: from one, inductor (torch 2.11) copied the whole workspace's worth
    of float32 out of a 64-element view, reading past its end (an illegal address in the GPU tier when the
    allocation ended there; kernels/weight_only_kernel.py _quantize_into_workspace_kernel)."""
    from torch._inductor.utils import run_and_get_code

    x, d, s, b = _operands(64, 4096, 1024, device="cuda", bias=True)
    torch._dynamo.reset()
    f = torch.compile(lambda x: K.fp8_rowwise_input_mm(x, d, s, b), fullgraph=True)
    y, codes = run_and_get_code(f, x)
    assert torch.equal(y, K.fp8_rowwise_input_mm(x, d, s, b))
    assert not any("view.dtype" in code for code in codes), "a dtype view in the compiled graph"
