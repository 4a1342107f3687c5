"""ops.convert under Recipe(lean_activations=True): the converted Linears' outputs that the model's own torch
code saves for backward (a plain-torch SwiGLU's gate and up) are kept in E4M3 (ops/saved_outputs.py). The
forward is unchanged; gradients stay within the FP8 backward's own rounding of the default recipe's; nothing
is applied where it must not be (no grad, a caller's saved-tensor hooks, compile); a later convert removes
it; the model still pickles and copies; the peak memory of a step falls (GPU)."""

from __future__ import annotations

import copy
import dataclasses
import io
import pickle

import pytest
import torch
import torch.nn.functional as F

import float8.ops as ops
from float8 import Recipe
from float8.ops.saved_outputs import saved_outputs_of
from float8.ops.swiglu_fusion import SwiGLUFusion
from tests.tolerances import sqnr_db

LEAN = Recipe(lean_activations=True)
BF16 = torch.bfloat16
# What a lean MLP forward keeps in E4M3: g (silu's input, by the fused activation) and u (by the fused
# product, whose backward recomputes silu(g) from g's copy).
KEPT = 2


class MLP(torch.nn.Module):
    """The MLP half of a Llama block as users write it: a fused gate/up projection, torch's SwiGLU."""

    def __init__(self, d=256, f=512):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d)
        self.up = torch.nn.Linear(d, 2 * f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        g, u = self.up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def _model(recipe=None, seed=0, d=256, f=512):
    torch.manual_seed(seed)
    return ops.convert(MLP(d, f).to(BF16), recipe=recipe)


def _hook_owners(model):
    """The types of the objects whose bound methods are the forward (pre-)hooks of model's modules."""
    return {
        type(getattr(h, "__self__", None))
        for m in model.modules()
        for table in (m._forward_hooks, m._forward_pre_hooks)
        for h in table.values()
    }


def _step(model, x, dy):
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(dy)
    return [y, x.grad] + [p.grad for p in model.parameters()]


def _data(tokens=512, d=256):
    g = torch.Generator().manual_seed(1)
    return torch.randn(tokens, d, generator=g).to(BF16), torch.randn(tokens, d, generator=g).to(BF16)


def test_lean_convert_keeps_gate_and_up_in_e4m3_and_the_forward_unchanged():
    x, dy = _data()
    plain, lean = _model(), _model(LEAN)
    assert saved_outputs_of(plain) is None and saved_outputs_of(lean) is not None
    a, b = _step(plain, x, dy), _step(lean, x, dy)
    assert torch.equal(a[0], b[0])
    stats = saved_outputs_of(lean).last_forward
    # g and u: (512, 512) bf16 views of the up projection's output, one byte per element kept instead of two,
    # plus a float32 scale per row; silu(g) not at all
    assert stats == {"tensors": KEPT, "bytes_saved": KEPT * (512 * 512 - 4 * 512)}


def test_gradients_against_float64_within_a_db_of_the_default():
    # Measured here (CPU, 512 tokens, d 256, f 512): SQNR of the lean gradients against the default recipe's
    # 42.0 dB for dx, 26.5 dB for the up projection's weight; against float64 each stays within 1.25 dB of
    # the default's (the bound of tests/ops/test_lean_activations.py for ops.SwiGLU under lean activations).
    x, dy = _data()
    plain, lean = _model(), _model(LEAN)
    ref = copy.deepcopy(MLP()).double()
    ref.load_state_dict({k: v.double() for k, v in _model().state_dict().items()})
    xd = x.double().requires_grad_(True)
    ref(xd).backward(dy.double())
    want = [xd.grad] + [p.grad for p in ref.parameters()]
    a, b = _step(plain, x, dy)[1:], _step(lean, x, dy)[1:]
    for r, p, q in zip(want, a, b):
        assert sqnr_db(r, q) >= sqnr_db(r, p) - 1.25


def test_not_applied_without_grad_or_inside_the_callers_saved_tensor_hooks():
    x, dy = _data()
    lean = _model(LEAN)
    so = saved_outputs_of(lean)
    with torch.no_grad():
        lean(x)
    assert so.last_forward["tensors"] == 0
    seen = []

    def pack(t):
        seen.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _step(lean, x, dy)
    assert so.last_forward["tensors"] == 0 and BF16 in seen  # the caller's hooks saw the bf16 outputs
    _step(lean, x, dy)
    assert so.last_forward["tensors"] == KEPT


def test_an_in_place_write_after_the_save_does_not_reach_the_backward():
    # Plain autograd refuses a backward whose saved tensor was written in place; here the copy was made at
    # the save, so the backward reads the values the forward used: the gradients of the unwritten model.
    class Writes(MLP):
        def forward(self, x):
            h = self.up(self.norm(x))
            g, u = h.chunk(2, dim=-1)
            y = x + self.down(F.silu(g) * u)
            h.mul_(2.0)  # after silu and the product saved g and u
            return y

    x, dy = _data()
    torch.manual_seed(0)
    writes = ops.convert(Writes().to(BF16), recipe=LEAN)
    got, want = _step(writes, x, dy), _step(_model(LEAN), x, dy)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_convert_with_another_recipe_removes_it_and_the_model_pickles_and_copies():
    lean = _model(LEAN)
    clone = copy.deepcopy(lean)
    x, dy = _data()
    _step(clone, x, dy)
    assert saved_outputs_of(clone).last_forward["tensors"] == KEPT
    buf = io.BytesIO()
    torch.save(lean, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    _step(loaded, x, dy)
    assert saved_outputs_of(loaded).last_forward["tensors"] == KEPT
    assert pickle.loads(pickle.dumps(saved_outputs_of(lean))).last_forward == {"tensors": 0, "bytes_saved": 0}
    ops.convert(lean, recipe=Recipe())
    assert saved_outputs_of(lean) is None
    assert _hook_owners(lean) == {SwiGLUFusion}  # the default recipe's (tests/ops/test_swiglu_fusion.py)
    ops.convert(lean, recipe=LEAN)
    _step(lean, x, dy)
    assert saved_outputs_of(lean).last_forward["tensors"] == KEPT
    assert sum(len(m._forward_hooks) for m in lean.modules()) == 3  # the model's, up's and down's: not twice


def test_an_exception_in_the_forward_leaves_no_hooks_behind():
    lean = _model(LEAN)
    with pytest.raises(RuntimeError):
        lean(torch.randn(4, 7, dtype=BF16, requires_grad=True))  # 7 features: the norm refuses it
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    x, dy = _data()
    _step(lean, x, dy)
    assert saved_outputs_of(lean).last_forward["tensors"] == KEPT


def test_compiles_with_the_compilers_own_saves():
    x, dy = _data(64)
    lean = _model(LEAN)
    want = _step(_model(LEAN), x, dy)
    torch._dynamo.reset()
    compiled = torch.compile(lean, backend="aot_eager", fullgraph=True)
    got = _step(compiled, x, dy)
    assert torch.equal(got[0], want[0])
    assert saved_outputs_of(lean).last_forward["tensors"] == 0  # not applied under compile
    torch._dynamo.reset()


class Net(torch.nn.Module):
    """Two MLPs: submodules to convert apart."""

    def __init__(self):
        super().__init__()
        self.a, self.b = MLP(), MLP()

    def forward(self, x):
        return self.b(self.a(x))


def _kept(model, root=None):
    x, dy = _data()
    _step(model, x, dy)
    return saved_outputs_of(root or model).last_forward["tensors"]


def test_only_elementwise_functions_saves_are_kept_in_e4m3():
    """A norm or attention saves statistics of its exact input with it: a rounded input would not match them
    (a LayerNorm weight's gradient fell from 23.0 to 3.9 dB against float64 when it was rounded). Only
    silu, gelu and products keep a Linear's output in E4M3; the rest is saved as it is, with the default
    recipe's bits."""

    class Others(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(256, 768, bias=False)
            self.norm = torch.nn.LayerNorm(256)

        def forward(self, x):
            q, k, v = self.up(x).view(1, 512, 3, 4, 64).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            h = self.up(x)[..., :256]
            return self.norm(h) + a.transpose(1, 2).reshape(1, 512, 256) + h.expand(1, 512, 256)

    x, dy = _data()
    torch.manual_seed(0)
    plain = ops.convert(Others().to(BF16), recipe=Recipe(lean_activations=False))
    lean = ops.convert(copy.deepcopy(plain), recipe=LEAN)
    a, b = _step(plain, x[None], dy[None]), _step(lean, x[None], dy[None])
    assert saved_outputs_of(lean).last_forward["tensors"] == 0
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_a_write_into_a_tensor_saved_as_it_is_is_still_refused():
    """Saved-tensor hooks turn autograd's in-place check off; it is made for the tensors saved as they are."""

    class Writes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(256, 256)

        def forward(self, x):
            h = torch.tanh(self.up(x))  # tanh saves its output h
            h.mul_(2)
            return h

    model = ops.convert(Writes().to(BF16), recipe=LEAN)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(64, 256, dtype=BF16, requires_grad=True)).sum().backward()


def test_expanded_views_and_small_tensors_are_saved_as_they_are():
    class Expands(MLP):
        def forward(self, x):
            g, u = self.up(self.norm(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(g[:1].expand_as(g)) * u)  # an expanded view: its copy would be larger

    torch.manual_seed(0)
    assert _kept(ops.convert(Expands().to(BF16), recipe=LEAN)) == 1  # u only
    assert _kept(ops.convert(MLP(256, 64).to(BF16), recipe=LEAN)) == 0  # g, u 512 x 64: below MIN_NUMEL


def test_recipes_and_hooks_stay_in_step_across_converts_and_copies():
    net = Net().to(BF16)
    ops.convert(net.a, recipe=LEAN)
    assert _kept(net, net.a) == KEPT
    ops.convert(net, recipe=Recipe())  # no Linear lean any more: no SavedOutputs hooks left anywhere
    assert _hook_owners(net) == {SwiGLUFusion}
    ops.convert(net, recipe=LEAN)
    assert _kept(net) == 2 * KEPT
    ops.convert(net.a, recipe=Recipe())  # a's Linears are not lean now: their outputs are saved as they are
    assert _kept(net) == KEPT
    clone = copy.deepcopy(net)
    assert _kept(clone) == KEPT
    ops.convert(clone, recipe=Recipe())  # a copy's hooks are found and removed as well
    assert saved_outputs_of(clone) is None and _hook_owners(clone) == {SwiGLUFusion}
    ops.convert(clone, recipe=LEAN)
    ops.convert(clone, recipe=LEAN)
    assert len(clone._forward_pre_hooks) == 1 and _kept(clone) == 2 * KEPT
    with torch.no_grad():
        clone(_data()[0])
    assert saved_outputs_of(clone).last_forward["tensors"] == 0  # the last forward kept nothing


def test_a_compiled_block_inside_a_lean_model():
    x, dy = _data(64)
    net = ops.convert(Net().to(BF16), recipe=LEAN)
    want = _step(copy.deepcopy(net), x, dy)
    torch._dynamo.reset()
    net.a.compile(backend="aot_eager", fullgraph=True)
    got = _step(net, x, dy)
    assert torch.equal(got[0], want[0])
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lean_convert_holds_less_from_forward_to_backward():
    # 8192 tokens, f 4096, the GEMMs forced to FP8 (a layer this small runs in bf16 under the small-layer
    # policy, and then keeps its outputs exact): the up projection's output (128 MiB of bf16) was held through
    # its halves g and u, and silu(g) (64 MiB); their E4M3 copies take 96 MiB (and a scale per row), so 96 MiB
    # less is held between forward and backward. (Over a model's blocks what is held adds up:
    # benchmarks.peak --case converted.)
    def held(recipe):
        recipe = dataclasses.replace(recipe, min_fp8_gemm_flops=0)
        torch.manual_seed(0)
        # the default without ops.convert's SwiGLU fusion (which holds 128 MiB: h alone; tests/ops/test_swiglu_fusion.py)
        model = ops.convert(MLP(1024, 4096).to(BF16).cuda(), recipe=recipe, fuse_swiglu=False)
        x = torch.randn(8192, 1024, device="cuda", dtype=BF16)
        dy = torch.randn_like(x)
        _step(model, x, dy)  # warm-up
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        xr = x.clone().requires_grad_(True)
        y = model(xr)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - base
        y.backward(dy)
        return kept, [y, xr.grad] + [p.grad for p in model.parameters()]

    plain_kept, plain = held(Recipe())
    lean_kept, lean = held(LEAN)
    assert lean_kept <= plain_kept - 90 * 2**20, (plain_kept / 2**20, lean_kept / 2**20)
    assert torch.equal(plain[0], lean[0])
    for a, b in zip(plain[1:], lean[1:]):
        assert sqnr_db(a, b) >= 20


def test_a_lean_model_is_freed_without_the_garbage_collector_after_a_step_that_kept_outputs():
    from tests.ops.test_no_reference_cycles import _freed_without_gc

    def step(model):
        x, dy = _data()
        _step(model, x, dy)
        assert saved_outputs_of(model).last_forward["tensors"] == KEPT  # the copies were made
        return None

    assert _freed_without_gc(lambda: _model(LEAN), step) == []


class GeluFFN(torch.nn.Module):
    """The seed #1119 layer's FFN as users write it: F.gelu on a whole Linear output (optionally tanh)."""

    def __init__(self, d=256, f=512, approximate="none"):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, f), torch.nn.Linear(f, d)
        self.approximate = approximate

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class SiluGLU(MLP):
    """A Hugging Face-style MLP: separate gate and up Linears, so silu's input is a whole output."""

    def __init__(self, d=256, f=512):
        super().__init__(d, f)
        self.gate = torch.nn.Linear(d, f, bias=False)
        self.up = torch.nn.Linear(d, f, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _saved_dtypes(y: torch.Tensor, name: str) -> set:
    """dtypes of the saved tensors of the first node named `name` in y's backward graph."""
    todo, seen = [y.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if name in type(fn).__name__:
            return {t.dtype for t in fn.saved_tensors}
        todo.extend(f for f, _ in fn.next_functions)
    raise AssertionError(f"no {name} node in the graph")


def _default_and_lean(base: torch.nn.Module, x, dy):
    """(default recipe's step, lean recipe's step, the lean model): copies of `base` converted each way."""
    plain = ops.convert(copy.deepcopy(base), recipe=Recipe())
    lean = ops.convert(copy.deepcopy(base), recipe=LEAN)
    a, b = _step(plain, x, dy), _step(lean, x, dy)
    assert torch.equal(a[0], b[0])  # torch's own activation in the forward: the same bits
    return a, b, lean


def _assert_lean_within_default_of_float64(base: torch.nn.Module, x, dy, a, b) -> None:
    """Each lean gradient within 1.25 dB of the default's, both against float64 (the bound of
    tests/ops/test_lean_activations.py)."""
    ref = copy.deepcopy(base).double()
    xd = x.double().requires_grad_(True)
    ref(xd).backward(dy.double())
    for r, p, q in zip([xd.grad] + [p.grad for p in ref.parameters()], a[1:], b[1:]):
        assert sqnr_db(r, q) >= sqnr_db(r, p) - 1.25


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_of_a_whole_output_keeps_one_e4m3_copy_read_by_the_backward_kernel(approximate):
    """F.gelu of a whole lean Linear output runs as _LeanActivation: torch's forward bits, its input kept as
    an E4M3 copy that the backward kernel reads without a widened bf16 copy (the backward's peak of the
    lean converted seed #1119 layer); gradients within the default recipe's rounding against float64."""
    x, dy = _data()
    torch.manual_seed(0)
    base = GeluFFN(approximate=approximate).to(BF16)
    a, b, lean = _default_and_lean(base, x, dy)
    assert saved_outputs_of(lean).last_forward == {"tensors": 1, "bytes_saved": 512 * 512 - 4 * 512}
    xr = x.clone().requires_grad_(True)
    assert _saved_dtypes(lean(xr), "_LeanActivation") == {torch.float8_e4m3fn, torch.float32}
    _assert_lean_within_default_of_float64(base, x, dy, a, b)


def test_silu_of_a_whole_output_and_the_product_of_another():
    # silu(gate) runs as _LeanActivation (a per-row E4M3 copy of gate's output), the product as
    # _LeanSiluProduct (a per-row copy of up's output; silu(gate) recomputed in the backward).
    x, dy = _data()
    torch.manual_seed(0)
    base = SiluGLU().to(BF16)
    a, b, lean = _default_and_lean(base, x, dy)
    assert saved_outputs_of(lean).last_forward["tensors"] == KEPT
    _assert_lean_within_default_of_float64(base, x, dy, a, b)


@pytest.mark.parametrize("penalty_on", ["h", "fc1.weight"])
def test_a_double_backward_through_the_fused_activation_is_refused_by_name(penalty_on):
    # A gradient penalty needs second derivatives through the activation, which its kernel does not have.
    # Refused even where the incoming gradient needs none (a penalty on dL/dh: fc2's FP8 backward gives a
    # constant dy), where its terms through h would otherwise be dropped without a word.
    x, dy = _data()
    torch.manual_seed(0)
    lean = ops.convert(GeluFFN().to(BF16), recipe=LEAN)
    h = {}
    lean.fc1.register_forward_hook(lambda m, a, out: h.setdefault("h", out))
    y = lean(x.clone().requires_grad_(True))
    wrt = h["h"] if penalty_on == "h" else lean.fc1.weight
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad((y.float() * dy.float()).sum(), wrt, create_graph=True)


def test_a_loud_row_does_not_coarsen_the_others_gradients():
    # One scale per row: a row holding 1e5 (a "massive activation") keeps its own scale. With one scale for
    # the tensor the other rows' dL/dh fell to 17.7 dB against float64 (39.8 dB per row; CPU, 2026-11-27).
    from float8.ops.saved_outputs import _LeanActivation

    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 512, generator=g).to(BF16)
    h[0, 0] = 1e5
    dy = torch.randn(64, 512, generator=g).to(BF16)
    hl = h.clone().requires_grad_(True)
    _LeanActivation.apply(hl, F.gelu, {}, "gelu").backward(dy)
    hd = h.double().requires_grad_(True)
    F.gelu(hd).backward(dy.double())
    assert sqnr_db(hd.grad[1:], hl.grad[1:]) >= 35


def test_linears_run_in_high_precision_keep_their_outputs_exact():
    # Under ops.high_precision (or the small-layer policy on a GPU) the Linears' GEMMs run in bf16: nothing is
    # kept in E4M3, and the lean model's gradients are the default recipe's, bit for bit.
    x, dy = _data()
    torch.manual_seed(0)
    base = SiluGLU().to(BF16)
    plain = ops.convert(copy.deepcopy(base), recipe=Recipe())
    lean = ops.convert(copy.deepcopy(base), recipe=LEAN)
    with ops.high_precision(plain), ops.high_precision(lean):
        a, b = _step(plain, x, dy), _step(lean, x, dy)
    assert saved_outputs_of(lean).last_forward["tensors"] == 0
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_a_product_that_does_not_fuse_keeps_its_own_saves():
    """silu(g) written in place before the product (with or without grad), or a product that broadcasts, is
    torch's own product: its saves go through the hooks (silu(g), a lean output, and u kept per row); the
    forward is unchanged and the gradients stay within the default's rounding against float64."""

    class InPlace(SiluGLU):
        def forward(self, x):
            h = self.norm(x)
            a = F.silu(self.gate(h))
            a.mul_(0.5)
            return x + self.down(a * self.up(h))

    class InPlaceNoGrad(SiluGLU):  # the write moves the version, not the grad_fn: the backward must see it
        def forward(self, x):
            h = self.norm(x)
            a = F.silu(self.gate(h))
            with torch.no_grad():
                a.clamp_(max=0.5)
            return x + self.down(a * self.up(h))

    class Broadcast(SiluGLU):
        def forward(self, x):
            h = self.norm(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h)[:1])

    x, dy = _data()
    # Broadcast: g, and silu(g) (u[:1] is below MIN_NUMEL)
    for cls, kept in ((InPlace, 3), (InPlaceNoGrad, 3), (Broadcast, 2)):
        torch.manual_seed(0)
        base = cls().to(BF16)
        a, b, lean = _default_and_lean(base, x, dy)
        assert saved_outputs_of(lean).last_forward["tensors"] == kept, cls.__name__
        _assert_lean_within_default_of_float64(base, x, dy, a, b)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_inside_a_lean_model(reentrant):
    """Inside a checkpointed block the checkpoint's hooks are innermost: its activation stays torch's, so the
    recomputation (which runs without this mode) saves what the forward saved; the other block fuses."""
    from torch.utils.checkpoint import checkpoint

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = GeluFFN(), GeluFFN()

        def forward(self, x):
            return self.b(checkpoint(self.a, x, use_reentrant=reentrant))

    x, dy = _data()
    torch.manual_seed(0)
    base = Two().to(BF16)
    lean = ops.convert(copy.deepcopy(base), recipe=LEAN)
    got = _step(lean, x, dy)
    assert saved_outputs_of(lean).last_forward["tensors"] == 1  # b's gelu input
    want = _step(ops.convert(copy.deepcopy(base), recipe=Recipe()), x, dy)
    assert torch.equal(got[0], want[0])
    for a, b in zip(want[1:], got[1:]):
        assert sqnr_db(a, b) >= 20


def test_activations_that_do_not_fuse_keep_their_own_saves():
    """An in-place silu and an input that needs no gradient run torch's own functions, a view (of a
    Linear's output) the fused one; each still gives the default's forward."""

    class Variants(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(256, 512)

        def forward(self, x):
            h = self.fc(x)
            a = F.silu(h.clone(), inplace=True)  # a clone is not a Linear output; in place
            b = F.gelu(h[:, :256])  # a view
            with torch.no_grad():
                c = F.gelu(self.fc(x))  # no gradient
            return a[:, :256] + b + c[:, 256:]

    x, dy = _data()
    torch.manual_seed(0)
    a, b, lean = _default_and_lean(Variants().to(BF16), x, dy)
    assert saved_outputs_of(lean).last_forward["tensors"] == 1  # the view
    for p, q in zip(a[1:], b[1:]):
        assert sqnr_db(p, q) >= 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gelu_of_a_whole_output_backward_reads_its_e4m3_copy(monkeypatch):
    # 16384 tokens, d 256, f 8192, the GEMMs forced to FP8: gelu's input h is 256 MiB of bf16, kept as a
    # 128 MiB E4M3 copy either way. Without the fused activation (its kind lookup turned off here) the
    # backward widened the copy to a 256 MiB bf16 tensor for torch's gelu backward, next to dy and dh (256 MiB
    # each); the fused backward kernel reads the copy as it is, so the backward's peak is lower by most of
    # that (the narrow d keeps the Linears' own backward transients below it), at the same forward bits and
    # gradients within the FP8 rounding.
    import float8.ops.saved_outputs as saved_outputs

    def run():
        torch.manual_seed(0)
        recipe = dataclasses.replace(LEAN, min_fp8_gemm_flops=0)
        model = ops.convert(GeluFFN(256, 8192).to(BF16).cuda(), recipe=recipe)
        x = torch.randn(16384, 256, device="cuda", dtype=BF16)
        dy = torch.randn_like(x)
        _step(model, x, dy)  # warm-up
        model.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_(True)
        y = model(xr)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        y.backward(dy)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), [y, xr.grad] + [p.grad for p in model.parameters()]

    fused_peak, fused = run()
    monkeypatch.setattr(saved_outputs, "_activation_kind", lambda *args: None)
    widened_peak, widened = run()
    assert fused_peak <= widened_peak - 192 * 2**20, (widened_peak / 2**20, fused_peak / 2**20)
    assert torch.equal(fused[0], widened[0])
    for a, b in zip(fused[1:], widened[1:]):
        assert sqnr_db(a, b) >= 20
