"""ops.convert fuses the SwiGLU of separate gate and up projections (ops/swiglu_fusion.py, `_SwiGLUPairProduct`):
`F.silu(gate(x)) * up(x)`, as Hugging Face's Llama and torchtitan write it, keeps g and u for the backward but not
silu(g), and one pass (kernels/swiglu_pair.py) writes both gradients. The forward's bits do not change; the
gradients of g and u are the kernel's (one rounding of the float32 formula); every spelling that is not exactly
this pattern runs torch's own code."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import float8.ops as ops
from float8.kernels.activation import act_bwd
from float8.kernels.swiglu_pair import swiglu_pair_bwd_ref
from float8.ops.swiglu_fusion import swiglu_fusion_of
from tests.ops.test_swiglu_fusion import _bytes_saved_by_forward, _convert, _data
from tests.ops.tiny_llama import tiny_llama
from tests.tolerances import sqnr_db

BF16 = torch.bfloat16
D, F_ = 64, 128


class PairMLP(torch.nn.Module):
    """A Llama MLP with separate gate and up projections; `pattern` picks the spelling; g.grad and u.grad kept."""

    def __init__(self, pattern="hf", f=F_):
        super().__init__()
        self.pattern = pattern
        self.gate = torch.nn.Linear(D, f, bias=False)
        self.up = torch.nn.Linear(D, f, bias=False)
        self.down = torch.nn.Linear(f, D, bias=False)
        self.act = torch.nn.SiLU()  # Hugging Face's ACT2FN["silu"]

    def _keep(self, g, u):
        if g.requires_grad and not torch.compiler.is_compiling():
            g.retain_grad()  # on g and u themselves: the fused product's inputs, so their gradients are exact
            u.retain_grad()
        self.g, self.u = g, u

    def forward(self, x):
        p = self.pattern
        if p == "up first":  # u exists before the gate's window: not fused
            u = self.up(x)
            g = self.gate(x)
            self._keep(g, u)
            return self.down(F.silu(g) * u)
        g = self.gate(x)
        if p == "silu of silu":
            return self.down(F.silu(F.silu(g)) * self.up(x))
        s = self.act(g) if p == "hf" else F.silu(g)
        if p == "hook on silu":
            s.register_hook(lambda d: d * 0.5)
        elif p == "gate written after silu":
            g.mul_(1.0)
        elif p == "silu detached in place":
            s.detach_()
        u = self.up(x)
        self._keep(g, u)
        if p == "hooks on g and u":  # the fused product's own inputs: autograd runs their hooks
            g.register_hook(lambda d: d * 0.5)
            u.register_hook(lambda d: d * 0.25)
        if p in ("hf", "torchtitan", "hooks on g and u"):
            a = s * u
        elif p == "reversed factors":
            a = u * s
        elif p == "torch.mul":
            a = torch.mul(s, u)
        elif p == "times g":  # silu(g) * g: the gate output twice, not the pattern
            a = s * g
        elif p == "u transposed":  # another view of u
            a = s * u.t().t().contiguous().view_as(u) + 0
        else:
            a = s * u
        return self.down(a)


def _models(pattern="hf", dtype=BF16, f=F_):
    torch.manual_seed(0)
    base = PairMLP(pattern, f).to(dtype)
    return _convert(copy.deepcopy(base)), ops.convert(copy.deepcopy(base), fuse_swiglu=False)


def _step(model, x, dy, create_graph=False):
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(dy, create_graph=create_graph)
    return [y, x.grad, model.g.grad, model.u.grad] + [p.grad for p in model.parameters()]


def _incoming(model, g, u, dy):
    """The gradient arriving at the product's output (the down projection's dx), recomputed from g and u."""
    a = (F.silu(g) * u).requires_grad_(True)
    return torch.autograd.grad(model.down(a), a, dy)[0]


@pytest.mark.parametrize("pattern", ["hf", "torchtitan", "reversed factors", "torch.mul"])
def test_fused_forward_bits_unchanged_and_the_gradients_are_one_rounding(pattern):
    x, dy = _data()
    fused, plain = _models(pattern)
    a, b = _step(fused, x, dy), _step(plain, x, dy)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 1}
    assert torch.equal(a[0], b[0])  # torch's silu and product
    assert torch.equal(a[-1], b[-1])  # the down projection's weight gradient: the same forward bits
    g, u = fused.g.detach(), fused.u.detach()
    incoming = _incoming(fused, g, u, dy)
    dg, du = swiglu_pair_bwd_ref(incoming, g, u)
    assert torch.equal(a[2], dg) and torch.equal(a[3], du)
    # at least as close to float64 as torch's two roundings
    g64, u64, d64 = g.double().requires_grad_(True), u.double().requires_grad_(True), incoming.double()
    (F.silu(g64) * u64).backward(d64)
    for ours, theirs, want in ((a[2], b[2], g64.grad), (a[3], b[3], u64.grad)):
        assert sqnr_db(want, ours) >= sqnr_db(want, theirs) - 0.05
    for p, q in zip(a[1:], b[1:]):
        assert sqnr_db(q, p) >= 25


def test_hooks_and_retain_grad_on_g_and_u_are_kept():
    x, dy = _data()
    fused, plain = _models("hooks on g and u")
    a, b = _step(fused, x, dy), _step(plain, x, dy)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 1}
    g, u = fused.g.detach(), fused.u.detach()
    dg, du = swiglu_pair_bwd_ref(_incoming(fused, g, u, dy), g, u)
    assert torch.equal(a[2], dg * 0.5) and torch.equal(a[3], du * 0.25)  # retain_grad sees the hooked gradient
    for p, q in zip(a[1:], b[1:]):
        assert sqnr_db(q, p) >= 25


@pytest.mark.parametrize(
    "pattern",
    ["up first", "silu of silu", "hook on silu", "silu detached in place", "times g", "u transposed"],
)
def test_what_is_not_exactly_the_pattern_keeps_torchs_gradients(pattern):
    x, dy = _data()
    fused, plain = _models(pattern)
    if pattern in ("silu of silu", "times g"):
        fused.g = plain.g = None
    y_f, y_p = fused(x), plain(x)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 0}
    assert torch.equal(y_f, y_p)
    y_f.backward(dy)
    y_p.backward(dy)
    for p, q in zip(fused.parameters(), plain.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


def test_a_gate_written_in_place_after_its_silu_is_refused_as_torch_refuses_it():
    x, dy = _data()
    for model in _models("gate written after silu"):
        y = model(x)
        assert swiglu_fusion_of(model) is None or swiglu_fusion_of(model).last_forward == {"fused": 0}
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward(dy)


def test_u_written_in_place_after_the_product_is_refused_by_the_fused_save():
    x, dy = _data()
    for model in _models():
        y = model(x)
        with torch.no_grad():
            model.u.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward(dy)


def test_module_backward_hooks_on_the_up_projection_still_fire():
    # register_full_backward_hook wraps the Linear's output after its forward hooks ran: u is not the noted
    # output, nothing is fused, and the hook sees u's gradient.
    x, dy = _data()
    seen = {}
    fused, plain = _models()
    for name, model in (("fused", fused), ("plain", plain)):
        model.up.register_full_backward_hook(lambda m, gi, go, name=name: seen.__setitem__(name, go[0].clone()))
        model(x.clone().requires_grad_(True)).backward(dy)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 0}
    assert torch.equal(seen["fused"], seen["plain"])


def test_the_forward_keeps_g_and_u_and_not_silu_g():
    # What autograd holds at the end of the forward: g and u, without silu(g).
    x, _ = _data()
    fused, plain = _models()
    held = [_bytes_saved_by_forward(model, x)[0] for model in (plain, fused)]
    assert held[0] - held[1] == 256 * F_ * 2  # silu(g): (256, 128) of bf16
    assert swiglu_fusion_of(fused).last_forward == {"fused": 1}


def test_double_backward_through_the_fused_product_matches_torch():
    x, _ = _data(dtype=torch.float32)
    fused, plain = _models(dtype=torch.float32)
    w = torch.randn(x.shape[0], D, generator=torch.Generator().manual_seed(2))

    def penalty(model):
        y = model(x)
        gg, gu = torch.autograd.grad((y * w).sum(), [model.g, model.u], create_graph=True)
        (gg.square().sum() + gu.square().sum()).backward()
        return [gg, gu, model.gate.weight.grad, model.up.weight.grad]

    got, want = penalty(fused), penalty(plain)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 1}
    for p, q in zip(got, want):
        assert sqnr_db(q, p) >= 60


def test_below_the_size_threshold_nothing_is_fused():
    x, dy = _data()
    torch.manual_seed(0)
    model = ops.convert(PairMLP().to(BF16))  # g: 256 x 128 elements, far below MIN_NUMEL
    _step(model, x, dy)
    assert swiglu_fusion_of(model).last_forward == {"fused": 0}


def test_hugging_face_llama_is_fused_in_every_layer_and_trains_like_unfused():
    base = tiny_llama()
    exact = copy.deepcopy(base).float()
    fused = _convert(copy.deepcopy(base))
    plain = ops.convert(copy.deepcopy(base), fuse_swiglu=False)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    losses = []
    for model in (exact, fused, plain):
        out = model(ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 2}
    assert torch.equal(losses[1], losses[2])
    # Every parameter's gradient as close to float32's as unfused (19-27 dB for both on this tiny model, the
    # FP8 GEMMs' noise; fused minus unfused measured -0.45 dB at worst)
    for (name, e), p, q in zip(exact.named_parameters(), fused.parameters(), plain.parameters()):
        want = e.grad.double()
        assert sqnr_db(want, p.grad) >= sqnr_db(want, q.grad) - 1.0, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_fused_holds_less_and_takes_the_kernel():
    # 8192 tokens, f 4096: silu(g) (64 MiB of bf16) is not kept between forward and backward; g's and u's
    # gradients are the Triton kernel's.
    def held(fuse):
        torch.manual_seed(0)
        model = ops.convert(PairMLP(f=4096).to(BF16).cuda(), fuse_swiglu=fuse)  # g: 33M elements
        x = torch.randn(8192, D, device="cuda", dtype=BF16)
        dy = torch.randn_like(x)
        _step(model, x, dy)  # warm-up: cuBLAS's workspace is allocated by the first GEMM
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        xr = x.clone().requires_grad_(True)
        y = model(xr)
        kept = torch.cuda.memory_allocated() - base
        y.backward(dy)
        return kept, model, dy

    fused_kept, fused, dy = held(True)
    plain_kept, plain, _ = held(False)
    assert swiglu_fusion_of(fused).last_forward == {"fused": 1}
    assert abs(plain_kept - fused_kept - 64 * 2**20) < 2**20, (plain_kept / 2**20, fused_kept / 2**20)
    g, u = fused.g.detach(), fused.u.detach()
    assert torch.equal(g, plain.g.detach()) and torch.equal(u, plain.u.detach())
    # act_bwd's bits (the same math; on the GPU both use Triton's exp, not torch's)
    dg, du = act_bwd(_incoming(fused, g, u, dy), torch.cat([g, u], dim=-1), "swiglu").chunk(2, dim=-1)
    assert torch.equal(fused.g.grad, dg) and torch.equal(fused.u.grad, du)


class _AnyMode(torch.overrides.TorchFunctionMode):
    """A user's function mode that changes nothing (it keeps every window of the fusion shut)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _CheckpointedMLP(torch.nn.Module):
    """A projection, then an MLP (separate projections or one) under a non-reentrant checkpoint."""

    def __init__(self, pair):
        super().__init__()
        self.proj = torch.nn.Linear(D, D, bias=False)
        self.mlp = PairMLP("torchtitan") if pair else _ChunkMLP()

    def forward(self, x):
        h = self.proj(x)  # the outer fusion's window is open when the checkpoint starts
        return h + checkpoint(self.mlp, h, use_reentrant=False)


class _ChunkMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(D, 2 * F_, bias=False), torch.nn.Linear(F_, D, bias=False)

    def forward(self, x):
        g, u = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


@pytest.mark.parametrize("pair", [True, False], ids=["gate and up", "one projection"])
@pytest.mark.parametrize("how", ["submodule converted again", "under a user's mode"])
def test_a_non_reentrant_checkpoint_never_fuses_in_one_run_and_not_the_other(pair, how):
    # Its recompute runs the MLP again in the backward with no function mode on, and hands what it saves to
    # the forward's nodes by their order: had the recompute fused where the forward did not, the product's
    # node would get g for silu(g) (gate and up: wrong gradients, relative error 1.5-2.3) or a different
    # count of tensors (one projection: CheckpointError). Under checkpoint's hooks neither run fuses.
    torch.manual_seed(0)
    nested = how == "submodule converted again"
    base = _CheckpointedMLP(pair) if nested else (PairMLP("torchtitan") if pair else _ChunkMLP())
    x, dy = torch.randn(256, D), torch.randn(256, D)
    grads = []
    for fuse in (True, False):
        model = ops.convert(copy.deepcopy(base), fuse_swiglu=fuse)
        if nested:
            ops.convert(model.mlp, fuse_swiglu=fuse)  # its own fusion; the outer window is open around it
        for m in model.modules():
            if swiglu_fusion_of(m) is not None:
                swiglu_fusion_of(m).min_numel = 1
        if nested:
            y = model(x)
        else:
            with _AnyMode():  # the forward under the mode, the recompute without it
                y = checkpoint(model, x, use_reentrant=False)
        y.backward(dy)
        grads.append([p.grad for p in model.parameters()])
    for p, q in zip(*grads):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tier", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_checkpoints_hooks_are_recognized_on_this_torch(tier):
    # ops/swiglu_fusion.py `_checkpoint_hooks` knows them by name: a torch that renames them fails here
    # (the GPU tier runs the other torch version).
    from float8.ops.swiglu_fusion import _checkpoint_hooks

    seen = []

    def probe(t):
        seen.append(_checkpoint_hooks(torch._C._autograd._top_saved_tensors_default_hooks(False)))
        return t * t  # saves t: the backward unpacks it, which runs the recompute

    t = torch.randn(4, requires_grad=True)
    checkpoint(probe, t, use_reentrant=False).sum().backward()  # forward, then the recompute
    assert seen == [True, True]
    assert not _checkpoint_hooks(torch._C._autograd._top_saved_tensors_default_hooks(False))


def test_gate_outputs_are_not_held_past_their_product():
    # Under saved-tensor hooks that copy what is saved (offloading, as save_on_cpu does on a GPU) a gate
    # output is freed once its block is done, fused or not: the note holds it only until the product.
    refs = []

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(PairMLP() for _ in range(4))

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
                refs.append(weakref.ref(block.g))
                block.g = block.u = None
            self.alive = sum(r() is not None for r in refs)
            return x

    torch.manual_seed(0)
    x = torch.randn(256, D, dtype=BF16)
    for fuse in (True, False):
        refs.clear()
        model = _convert(Net().to(BF16)) if fuse else ops.convert(Net().to(BF16), fuse_swiglu=False)
        for block in model.blocks:
            block._keep = lambda g, u, block=block: setattr(block, "g", g) or setattr(block, "u", u)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            y = model(x)
        assert model.alive == 0, (fuse, model.alive)
        if fuse:
            assert swiglu_fusion_of(model).last_forward == {"fused": 4}
        y.float().sum().backward()
