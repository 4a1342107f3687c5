"""float8.ops.functional.linear_cross_entropy and ops.LinearCrossEntropy against the unfused
F.cross_entropy(F.linear(x, w, b).float(), t) in float64, the FP8 path within the tolerance table, no
full float32 logits, and the bad-input errors."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import float8.ops as ops
from float8 import Float8Tensor, Recipe
from float8.ops.functional import linear_cross_entropy
from tests.tolerances import SQNR_DB, sqnr_db

N, H, V = 96, 64, 1000


def _data(dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, N // 4, H, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.2).to(dtype).requires_grad_(True)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_(True) if bias else None
    t = torch.randint(0, V, (4, N // 4), generator=g)
    t[0, :5] = -100
    return x, w, b, t


def _reference(x, w, b, t, **kw):
    xd, wd = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    bd = None if b is None else b.detach().double().requires_grad_(True)
    loss = F.cross_entropy(F.linear(xd, wd, bd).reshape(-1, V), t.reshape(-1), **kw)
    loss = loss.reshape(t.shape) if kw.get("reduction") == "none" else loss
    return loss, xd, wd, bd


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk", [None, 16, 48])
def test_matches_the_unfused_loss_and_gradients(reduction, smoothing, chunk):
    x, w, b, t = _data()
    ref, xd, wd, bd = _reference(x, w, b, t, reduction=reduction, label_smoothing=smoothing)
    go = torch.rand_like(ref) + 0.5
    ref.backward(go)
    loss = linear_cross_entropy(x, w, t, b, reduction=reduction, label_smoothing=smoothing, chunk_tokens=chunk)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    loss.backward(go.float())
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    for ours, theirs in ((x.grad, xd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-6)


def test_bfloat16_within_the_tolerance_table():
    x, w, b, t = _data(torch.bfloat16)
    ref, xd, wd, bd = _reference(x, w, b, t)
    ref.backward()
    loss = linear_cross_entropy(x, w, t, b)
    loss.backward()
    assert abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item())
    assert w.grad.dtype == b.grad.dtype == x.grad.dtype == torch.bfloat16
    for ours, theirs in ((x.grad, xd.grad), (w.grad, wd.grad), (b.grad, bd.grad)):
        assert sqnr_db(theirs, ours) >= 35  # bf16 rounding of the logits and of the outputs


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp8_gemms_within_the_tolerance_table(reduction):
    x, w, b, t = _data(torch.bfloat16, bias=False)
    ref, xd, wd, _ = _reference(x, w, None, t, reduction=reduction)
    ref.sum().backward()
    loss = linear_cross_entropy(x, w, t, reduction=reduction, recipe=Recipe(), chunk_tokens=32)
    loss.sum().backward()
    assert sqnr_db(ref, loss) >= SQNR_DB["linear"]
    assert sqnr_db(xd.grad, x.grad) >= SQNR_DB["grad"]
    assert sqnr_db(wd.grad, w.grad) >= SQNR_DB["grad"]


def test_fp8_only_weight_frozen():
    x, w, _, t = _data(torch.bfloat16, bias=False)
    w8 = Float8Tensor.quantize(w.detach())
    ref, xd, _, _ = _reference(x, w, None, t)
    ref.backward()
    loss = linear_cross_entropy(x, w8, t)
    loss.backward()
    assert sqnr_db(ref, loss) >= SQNR_DB["linear"]
    assert sqnr_db(xd.grad, x.grad) >= SQNR_DB["grad"]


class _Outputs(TorchDispatchMode):
    """Per dtype, how many tensors the ops under it made and the largest one's element count."""

    def __init__(self):
        super().__init__()
        self.count, self.largest_of = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.count[o.dtype] = self.count.get(o.dtype, 0) + 1
                self.largest_of[o.dtype] = max(self.largest_of.get(o.dtype, 0), o.numel())
        return out

    @property
    def largest(self) -> int:
        """The largest float32 tensor made."""
        return self.largest_of.get(torch.float32, 0)


def test_never_materializes_float32_logits():
    x, w, _, t = _data(torch.bfloat16, bias=False)
    with _Outputs() as mode:
        linear_cross_entropy(x, w, t, chunk_tokens=16).backward()
    # The weight gradient's float32 accumulator (V x H) is the largest; the logits (N x V) never exist in
    # float32, and a chunk of them is 16 x V in bf16.
    assert mode.largest == V * H < N * V


def test_weight_dtype_accumulation_holds_no_float32_weight_buffer():
    x, w, _, t = _data(torch.bfloat16, bias=False)
    ref, xd, wd, _ = _reference(x, w, None, t)
    ref.backward()
    with _Outputs() as mode:
        loss = linear_cross_entropy(x, w, t, chunk_tokens=16, dw_accumulation="weight_dtype")
        loss.backward()
    assert mode.largest < V * H  # per-row losses and statistics only
    assert w.grad.dtype == torch.bfloat16
    assert abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item())
    # Six chunks, so six roundings of the running sum to bf16: still within bf16's reach of the float64 sum.
    assert sqnr_db(wd.grad, w.grad) >= 35
    assert sqnr_db(xd.grad, x.grad) >= 35


def test_weight_dtype_accumulation_of_a_float32_weight_is_exact():
    x, w, b, t = _data()
    ref, xd, wd, _ = _reference(x, w, b, t)
    ref.backward()
    linear_cross_entropy(x, w, t, b, chunk_tokens=16, dw_accumulation="weight_dtype").backward()
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=1e-4, atol=1e-6)


def test_fp8_weight_gradient_in_vocabulary_slabs(monkeypatch):
    # The FP8 weight-gradient product goes through a float32 temporary one slab of vocabulary rows at a
    # time; slabs that do not divide V must give the product of one whole GEMM.
    import float8.ops.cross_entropy as lce

    grads = []
    for slab in (lce.FP8_DW_SLAB, 96):
        monkeypatch.setattr(lce, "FP8_DW_SLAB", slab)
        x, w, _, t = _data(torch.bfloat16, bias=False)
        linear_cross_entropy(x, w, t, recipe=Recipe(), chunk_tokens=32, dw_accumulation="float32").backward()
        grads.append(w.grad)
    assert V % 96 and torch.equal(grads[0], grads[1])


def test_fp8_with_weight_dtype_accumulation_runs_the_weight_gradient_in_x_dtype():
    """A recipe with dw_accumulation="weight_dtype": FP8 logits and input-gradient GEMMs (the input gradient
    is the float32 accumulation's, bit for bit), and the weight gradient's GEMM in bf16 on the logits'
    gradient before quantization, added into the gradient by its epilogue: no float32 (V, H) buffer or
    slab, and a weight gradient nearer float64's than the FP8 GEMM's."""
    x, w, _, t = _data(torch.bfloat16, bias=False)
    ref, xd, wd, _ = _reference(x, w, None, t)
    ref.backward()
    got = {}
    for acc in ("float32", "weight_dtype"):
        w.grad = x.grad = None
        with _Outputs() as mode:
            linear_cross_entropy(x, w, t, recipe=Recipe(), chunk_tokens=32, dw_accumulation=acc).backward()
        got[acc] = (w.grad, x.grad, mode.largest, sqnr_db(wd.grad, w.grad))
    assert got["weight_dtype"][2] < V * H <= got["float32"][2]
    assert torch.equal(got["weight_dtype"][1], got["float32"][1])
    assert got["weight_dtype"][0].dtype == torch.bfloat16
    assert got["weight_dtype"][3] >= got["float32"][3] + 6, (got["weight_dtype"][3], got["float32"][3])
    # The default with a recipe: weight_dtype (the same call, bit for bit).
    w.grad = x.grad = None
    linear_cross_entropy(x, w, t, recipe=Recipe(), chunk_tokens=32).backward()
    assert torch.equal(w.grad, got["weight_dtype"][0]) and torch.equal(x.grad, got["weight_dtype"][1])


def test_default_chunks():
    from float8.ops.cross_entropy import default_chunk_tokens

    assert default_chunk_tokens(16384, 4096, 128256) == 4096  # float32: as many tokens as H
    assert default_chunk_tokens(16384, 4096, 128256, "weight_dtype") == 512  # a logits chunk the size of x
    assert default_chunk_tokens(100, 4096, 128256, "weight_dtype") == 112  # never more than the input
    assert default_chunk_tokens(16384, 512, 128256, "weight_dtype") == 256  # at least 256
    # FP8 logits and input-gradient GEMMs: chunks twice as large
    assert default_chunk_tokens(16384, 4096, 128256, "weight_dtype", fp8=True) == 1040
    assert default_chunk_tokens(16384, 4096, 32768, "weight_dtype", fp8=True) == 4096


def test_op_ends_a_sequential_and_inference_computes_no_gradients():
    torch.manual_seed(0)
    head = ops.LinearCrossEntropy(H, V, bias=True)
    seq = ops.Sequential(ops.RMSNorm(H), head)
    x = torch.randn(2, 8, H)
    t = torch.randint(0, V, (2, 8))
    loss = seq(x, target=t)
    ref = F.cross_entropy(
        F.linear(F.rms_norm(x, (H,), seq[0].weight, seq[0].eps), head.weight, head.bias).reshape(-1, V), t.reshape(-1)
    )
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert head.weight.grad is not None and seq[0].weight.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(seq(x, target=t), ref.detach(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs target="):
        seq(x)
    with pytest.raises(ValueError, match="only taken by"):
        ops.Sequential(ops.RMSNorm(H))(x, target=t)


@pytest.mark.parametrize(
    "acc_dtype,dz_dtype,backend",
    [
        (torch.bfloat16, torch.bfloat16, None),
        (torch.float32, torch.bfloat16, None),
        (torch.float32, torch.float32, None),
        (torch.float32, torch.bfloat16, "aot_eager"),  # traced: the opaque float32 op with beta 0
        (torch.bfloat16, torch.bfloat16, "inductor"),  # inductor's addmm would compute acc * 0: NaN from NaN
    ],
)
def test_first_chunk_writes_the_weight_gradient_without_reading_it(acc_dtype, dz_dtype, backend):
    """The weight gradient starts uninitialized (no zero fill): the first chunk's GEMM must not read it, or NaN
    and inf left there by earlier tensors would reach the gradient. One token in the chunk too, the shape that
    inductor decomposes into a product and a sum."""
    import types

    import float8.ops.cross_entropy as lce

    plan = types.SimpleNamespace(fp8_dw=False)
    for tokens in (32, 1):
        g = torch.Generator().manual_seed(tokens)
        dz, xc = torch.randn(tokens, 40, generator=g).to(dz_dtype), torch.randn(tokens, 24, generator=g).to(dz_dtype)
        acc = torch.full((40, 24), float("nan"), dtype=acc_dtype)
        acc[0, 0] = float("inf")
        run = lambda acc, dz, xc: lce._accumulate_dw(acc, dz, xc, None, plan, first=True)  # noqa: E731
        if backend is not None:
            torch._dynamo.reset()
            run = torch.compile(run, backend=backend, fullgraph=True)
        run(acc, dz, xc)
        want = dz.t().to(torch.float64) @ xc.to(torch.float64)
        assert torch.isfinite(acc).all()
        torch.testing.assert_close(acc.double(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gradient_through_the_incoming_gradient_create_graph(device):
    """autograd.grad(s * loss, x, create_graph=True), then the gradient of that with respect to s: the
    backward's scaling by the incoming gradient is recorded (on CUDA it leaves the kernel for the reference)."""
    x, w, _, t = _data(torch.float32, bias=False)
    x, w, t = x.detach().to(device).requires_grad_(), w.detach().to(device), t.to(device)
    s = torch.tensor(0.7, device=device, requires_grad=True)
    (gx,) = torch.autograd.grad(s * linear_cross_entropy(x, w, t, chunk_tokens=32), x, create_graph=True)
    (ds,) = torch.autograd.grad(gx.sum(), s)
    (want,) = torch.autograd.grad(F.cross_entropy(F.linear(x, w).flatten(0, 1), t.flatten()), x)
    torch.testing.assert_close(ds, want.sum(), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_bad_label_on_cuda_raises_after_queueing_and_reads_nothing_gpu():
    """On CUDA the label check answers without a host sync before the GEMMs (ops/cross_entropy.py
    _check_labels): a bad label still raises ValueError naming it, a huge one reads no memory (the kernel masks
    it), and the device stays usable: the next call with good labels gives the right loss and gradients."""
    x, w, b, t = _data(torch.bfloat16)
    x, w, t = x.detach().cuda().requires_grad_(), w.detach().cuda().requires_grad_(), t.cuda()
    for label in (V, -3, 2**40):
        bad = t.clone()
        bad[1, 2] = label
        with pytest.raises(ValueError, match=f"label {label} is outside the vocabulary"):
            linear_cross_entropy(x, w, bad, chunk_tokens=32)
        with pytest.raises(ValueError, match=f"label {label} is outside the vocabulary"):
            linear_cross_entropy(x, w, bad, chunk_tokens=32, recipe=Recipe())
    torch.cuda.synchronize()  # a kernel that read out of bounds would fail here
    ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w).float().flatten(0, 1), t.flatten())
    loss = linear_cross_entropy(x, w, t, chunk_tokens=32)
    torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-3)
    loss.backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()


def test_bad_input_names_the_problem():
    x, w, b, t = _data()
    bad = t.clone()
    bad[1, 2] = V
    with pytest.raises(ValueError, match=f"label {V} is outside the vocabulary"):
        linear_cross_entropy(x, w, bad)
    bad[1, 2] = -3
    with pytest.raises(ValueError, match="label -3 is outside"):
        linear_cross_entropy(x, w, bad)
    with pytest.raises(TypeError, match="target must hold class indices"):
        linear_cross_entropy(x, w, t.float())
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16, got torch.float64"):
        linear_cross_entropy(x.double(), w, t)
    with pytest.raises(ValueError, match=r"must agree on H, got x \(4, 24, 64\) and weight \(1000, 32\)"):
        linear_cross_entropy(x, w[:, :32], t)
    with pytest.raises(ValueError, match=r"target must have x's leading shape \(4, 24\), got \(4, 23\)"):
        linear_cross_entropy(x, w, t[:, :23])
    with pytest.raises(ValueError, match="bias must be"):
        linear_cross_entropy(x, w, t, b[:10])
    with pytest.raises(ValueError, match="reduction must be"):
        linear_cross_entropy(x, w, t, reduction="avg")
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(x, w, t, chunk_tokens=10)
    with pytest.raises(ValueError, match="dw_accumulation must be one of"):
        linear_cross_entropy(x, w, t, dw_accumulation="bfloat16")
    with pytest.raises(ValueError, match="no amax history"):
        linear_cross_entropy(x, w, t, recipe=Recipe.delayed())
    w8 = Float8Tensor.quantize(w.detach()).requires_grad_(True)
    with pytest.raises(ValueError, match="no master weight"):
        linear_cross_entropy(x, w8, t)


@pytest.mark.parametrize(
    "x_dtype, w_dtype",
    [(torch.float16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)]
    + [(torch.bfloat16, torch.float32)],
)
def test_mixed_dtypes_take_the_float32_addmm_only_where_cuda_takes_it(x_dtype, w_dtype, monkeypatch):
    """The weight gradient's GEMM adds into the sum with out_dtype only for half-precision operands and a
    float32 sum (CUDA's addmm refuses the other mixes, a bf16 sum of fp16 or fp32 operands): traced (aot_eager,
    where that branch is taken off CUDA too), every mix of x and weight dtypes with a recipe keeps to it, and
    the gradients agree with float64."""
    import float8.ops.cross_entropy as lce

    real = lce._addmm_float32_

    def checked(acc, a, b, beta):
        assert acc.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16), (acc.dtype, a.dtype)
        return real(acc, a, b, beta)

    monkeypatch.setattr(lce, "_addmm_float32_", checked)
    x, w, _, t = _data(bias=False)
    x = x.detach().to(x_dtype).requires_grad_(True)
    w = w.detach().to(w_dtype).requires_grad_(True)
    ref, xd, wd, _ = _reference(x, w, None, t)
    ref.backward()
    torch._dynamo.reset()
    run = torch.compile(lambda *a: linear_cross_entropy(*a, recipe=Recipe(), chunk_tokens=32), backend="aot_eager")
    run(x, w, t).backward()
    assert w.grad.dtype == w_dtype and sqnr_db(wd.grad, w.grad) >= SQNR_DB["grad"]


def test_fp8_logits_gradient_is_quantized_only_for_an_fp8_gemm_that_reads_it():
    """x that takes no gradient and the weight gradient's GEMM in bf16: no E5M2 copy of the logits' gradient."""

    counts = []
    for x_grad in (False, True):
        x, w, _, t = _data(torch.bfloat16, bias=False)
        x.requires_grad_(x_grad)
        with _Outputs() as mode:
            linear_cross_entropy(x, w, t, recipe=Recipe(), chunk_tokens=32).backward()
        counts.append(mode.count.get(torch.float8_e5m2, 0))
    assert counts[0] == 0 < counts[1]


def test_default_accumulation_is_float32_without_a_half_precision_weight_gradient():
    """The default sums in the weight's dtype only where the weight takes a gradient and x is bf16/fp16: a
    frozen weight and float32 x get what dw_accumulation="float32" gives, bit for bit."""
    x, w, _, t = _data(bias=False)  # float32 x and weight
    got = []
    for acc in (None, "float32"):
        w.grad = x.grad = None
        linear_cross_entropy(x, w, t, recipe=Recipe(), dw_accumulation=acc).backward()
        got.append((w.grad, x.grad))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    x, w, _, t = _data(torch.bfloat16, bias=False)
    w8 = Float8Tensor.quantize(w.detach())  # frozen, FP8-only
    grads = []
    for acc in (None, "float32"):
        x.grad = None
        linear_cross_entropy(x, w8, t, dw_accumulation=acc).backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])
