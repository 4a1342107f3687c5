"""ops.convert under Recipe(lean_activations=True): the converted Linears' outputs that the model's own torch
code saves for backward (a plain-torch SwiGLU's gate and up) are kept in E4M3 (ops/saved_outputs.py). The
forward is unchanged; gradients stay within the FP8 backward's own rounding of the default recipe's; nothing
is applied where it must not be (no grad, a caller's saved-tensor hooks, compile); a later convert removes
it; the model still pickles and copies; the peak memory of a step falls (GPU)."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F

import float8.ops as ops
from float8 import Recipe
from float8.ops.saved_outputs import saved_outputs_of
from tests.tolerances import sqnr_db

LEAN = Recipe(lean_activations=True)
BF16 = torch.bfloat16


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
    # g and u: two (512, 512) bf16 views of the up projection's output, one byte per element kept instead of
    # two, plus a float32 scale per row
    assert stats == {"tensors": 2, "bytes_saved": 2 * (512 * 512 - 4 * 512)}


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
    assert so.last_forward["tensors"] == 2


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
    assert saved_outputs_of(clone).last_forward["tensors"] == 2
    buf = io.BytesIO()
    torch.save(lean, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    _step(loaded, x, dy)
    assert saved_outputs_of(loaded).last_forward["tensors"] == 2
    assert pickle.loads(pickle.dumps(saved_outputs_of(lean))).last_forward == {"tensors": 0, "bytes_saved": 0}
    ops.convert(lean, recipe=Recipe())
    assert saved_outputs_of(lean) is None
    assert not any(m._forward_hooks for m in lean.modules())
    ops.convert(lean, recipe=LEAN)
    _step(lean, x, dy)
    assert saved_outputs_of(lean).last_forward["tensors"] == 2
    assert sum(len(m._forward_hooks) for m in lean.modules()) == 3  # the model's, up's and down's: not twice


def test_an_exception_in_the_forward_leaves_no_hooks_behind():
    lean = _model(LEAN)
    with pytest.raises(RuntimeError):
        lean(torch.randn(4, 7, dtype=BF16, requires_grad=True))  # 7 features: the norm refuses it
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    x, dy = _data()
    _step(lean, x, dy)
    assert saved_outputs_of(lean).last_forward["tensors"] == 2


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lean_convert_holds_less_from_forward_to_backward():
    # 8192 tokens, f 4096: the up projection's output (128 MiB of bf16) was held through its halves g and u;
    # their E4M3 copies take 64 MiB (and a scale per row), so 64 MiB less is held between forward and
    # backward. (A lone block's step peak is set inside its forward, where the copies are made while the
    # output is still alive; over a model's blocks what is held adds up: benchmarks.peak --case converted.)
    def held(recipe):
        torch.manual_seed(0)
        model = ops.convert(MLP(1024, 4096).to(BF16).cuda(), recipe=recipe)
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
    assert lean_kept <= plain_kept - 63 * 2**20, (plain_kept / 2**20, lean_kept / 2**20)
    assert torch.equal(plain[0], lean[0])
    for a, b in zip(plain[1:], lean[1:]):
        assert sqnr_db(a, b) >= 20
