"""Amaxes handed from the SwiGLU fusion's kernels to the Linears that quantize their outputs (ops/known_amax.py):
the down projection's input, and the output gradients of the gate and up projections (a pair) or of the one
gate-and-up projection. The bits do not change
(every output and gradient equal to the same model without the handoff), an amax is used only for the very
tensor it was computed for, unchanged since, and the table holds nothing past its tensors."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
import torch.nn.functional as F

import float8.ops.linear_train as linear_train
from float8 import Recipe
from float8.ops.known_amax import KnownAmaxes
from float8.ops.swiglu_fusion import swiglu_fusion_of
from tests.ops.test_swiglu_fusion import MLP, _convert, _data
from tests.ops.test_swiglu_pair_fusion import PairMLP
from tests.ops.tiny_llama import tiny_llama

BF16 = torch.bfloat16


# ---- the table --------------------------------------------------------------------------------------------


def test_an_amax_is_taken_once_for_its_own_tensor_unchanged():
    table = KnownAmaxes()
    t, other = torch.randn(4, 8), torch.randn(4, 8)
    amax = t.abs().max()
    table.put(t, amax)
    assert table.take(other) is None
    assert table.take(t) is amax
    assert table.take(t) is None  # once
    table.put(t, amax)
    t.mul_(2)  # written since: its version moved
    assert table.take(t) is None
    table.put(t, amax)
    assert table.take(t.view(8, 4)) is None and table.take(t[:2]) is None  # a view is another tensor
    with torch.inference_mode():
        frozen = torch.randn(3)
    table.put(frozen, frozen.abs().max())  # no version counter: never noted
    assert len(table) <= 1 and table.take(frozen) is None


def test_entries_go_with_their_tensors_without_the_garbage_collector():
    table = KnownAmaxes()
    t = torch.randn(16)
    table.put(t, t.abs().max())
    gc.disable()
    try:
        del t
        assert len(table) == 0
        ref = weakref.ref(table)
        u = torch.randn(4)
        table.put(u, u.abs().max())
        del table
        assert ref() is None  # the entry's callback holds the table weakly
    finally:
        gc.enable()


def test_pickles_and_copies_are_empty():
    table = KnownAmaxes()
    t = torch.randn(4)
    table.put(t, t.abs().max())
    for copied in (pickle.loads(pickle.dumps(table)), copy.deepcopy(table)):
        assert isinstance(copied, KnownAmaxes) and len(copied) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_an_amax_written_on_another_stream_is_not_used():
    table = KnownAmaxes()
    t = torch.randn(64, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        table.put(t, t.abs().max())
    assert table.take(t) is None


# ---- the handoff in a converted model ---------------------------------------------------------------------


def _counting(monkeypatch):
    calls = []
    real = linear_train.quantize_tensorwise_from_amax

    def counted(x, amax, *args):
        calls.append(tuple(x.shape))
        return real(x, amax, *args)

    monkeypatch.setattr(linear_train, "quantize_tensorwise_from_amax", counted)
    return calls


def _pair_models(module):
    """(with the handoff, the same model without it): one converted model and its copy with the fusion's
    amaxes off."""
    torch.manual_seed(0)
    handed = _convert(module.to(BF16))
    plain = copy.deepcopy(handed)
    swiglu_fusion_of(plain).amaxes = None
    return handed, plain


def _grads(model, x, dy, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        y.backward(dy)
        out += [y, xi.grad] + [p.grad.clone() for p in model.parameters()]
        opt.step()
    return out


# per step: the down projection's input (256 tokens x 128), and the output gradients of the gate and the up
# projection (each 256 x 128) or of the one gate-and-up projection (256 x 256)
PAIR_CALLS = [(256, 128), (256, 128), (256, 128)]
ONE_PROJECTION_CALLS = [(256, 128), (256, 256)]


@pytest.mark.parametrize(
    "module, per_step",
    [
        (lambda: PairMLP("hf"), PAIR_CALLS),
        (lambda: MLP("chunk"), ONE_PROJECTION_CALLS),
        (lambda: MLP("reversed"), ONE_PROJECTION_CALLS),
        (lambda: MLP("slices"), ONE_PROJECTION_CALLS),
    ],
    ids=["pair", "chunk", "reversed", "slices"],
)
def test_the_amax_passes_are_skipped_and_no_bit_changes(monkeypatch, module, per_step):
    x, dy = _data()
    handed, plain = _pair_models(module())
    calls = _counting(monkeypatch)
    a = _grads(handed, x, dy)
    assert calls == per_step * 2, calls
    assert len(swiglu_fusion_of(handed).amaxes) == 0  # all taken
    calls.clear()
    b = _grads(plain, x, dy)
    assert calls == []
    for p, q in zip(a, b):
        assert torch.equal(p, q)


class _OneProjectionWritten(MLP):
    """The product scaled in place before the down projection reads it, and h's gradient scaled in place by a
    hook before the up projection's backward reads it: both amaxes are stale."""

    def forward(self, x):
        h = self.up(x)
        h.register_hook(lambda d: d.mul_(16.0))
        g, u = h.chunk(2, dim=-1)
        a = F.silu(g) * u
        a.mul_(8.0)
        return self.down(a)


def test_one_projection_tensors_written_after_their_amaxes_are_quantized_from_their_own_values(monkeypatch):
    x, dy = _data()
    handed, plain = _pair_models(_OneProjectionWritten())
    calls = _counting(monkeypatch)
    a = _grads(handed, x, dy)
    assert swiglu_fusion_of(handed).last_forward == {"fused": 1}
    assert calls == []  # both tensors were written: neither amax was used
    for p, q in zip(a, _grads(plain, x, dy)):
        assert torch.equal(p, q)


class _WrittenProduct(PairMLP):
    """The product scaled in place before the down projection reads it: its amax is stale."""

    def forward(self, x):
        a = F.silu(self.gate(x)) * self.up(x)
        a.mul_(8.0)
        return self.down(a)


class _GateGradWrittenInPlace(PairMLP):
    """A hook on g writes its gradient in place before the gate's backward reads it: dg's amax is stale."""

    def forward(self, x):
        g = self.gate(x)
        g.register_hook(lambda d: d.mul_(16.0))
        return self.down(F.silu(g) * self.up(x))


@pytest.mark.parametrize("module", [_WrittenProduct, _GateGradWrittenInPlace])
def test_a_tensor_written_after_its_amax_is_quantized_from_its_own_values(monkeypatch, module):
    x, dy = _data()
    handed, plain = _pair_models(module())
    calls = _counting(monkeypatch)
    a = _grads(handed, x, dy)
    assert len(calls) == 2 * 2  # one of the three tensors per step was written: its amax was not used
    for p, q in zip(a, _grads(plain, x, dy)):
        assert torch.equal(p, q)


def test_hugging_face_llama_trains_bit_for_bit_with_the_handoff(monkeypatch):
    base = tiny_llama()
    handed = _convert(copy.deepcopy(base))
    plain = copy.deepcopy(handed)
    swiglu_fusion_of(plain).amaxes = None
    assert swiglu_fusion_of(handed).amaxes is handed.model.layers[0].mlp.down_proj._train_plans.amaxes
    calls = _counting(monkeypatch)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    results = []
    for model in (handed, plain):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            opt.zero_grad()
            out = model(ids, labels=ids)
            out.loss.backward()
            results.append([out.loss] + [p.grad.clone() for p in model.parameters()])
            opt.step()
        if model is handed:
            assert len(calls) == 3 * 2 * 2, calls  # 3 per layer, 2 layers, 2 steps
    for step in range(2):
        for p, q in zip(results[step], results[2 + step]):
            assert torch.equal(p, q)


def test_copies_and_pickles_keep_the_fusion_and_the_linears_on_one_table():
    handed, _ = _pair_models(PairMLP("hf"))
    for model in (copy.deepcopy(handed), pickle.loads(pickle.dumps(handed))):
        table = swiglu_fusion_of(model).amaxes
        assert isinstance(table, KnownAmaxes) and table is not swiglu_fusion_of(handed).amaxes
        for lin in (model.gate, model.up, model.down):
            assert lin._train_plans.amaxes is table


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("module, per_step", [(PairMLP, 3), (MLP, 2)], ids=["pair", "one projection"])
def test_gpu_the_kernels_amaxes_change_no_bit(monkeypatch, module, per_step):
    torch.manual_seed(0)
    # every Linear FP8 (these GEMMs are under the small-layer line, where they would run in bf16)
    handed = _convert(module(f=2048).to(BF16).cuda(), recipe=Recipe(min_fp8_gemm_flops=0))
    plain = copy.deepcopy(handed)
    swiglu_fusion_of(plain).amaxes = None
    x = torch.randn(4096, 64, device="cuda", dtype=BF16)
    dy = torch.randn_like(x)
    calls = _counting(monkeypatch)
    a = _grads(handed, x, dy)
    assert len(calls) == per_step * 2
    for p, q in zip(a, _grads(plain, x, dy)):
        assert torch.equal(p, q)


def test_batched_gradients_are_not_handed_an_amax():
    """`torch.autograd.grad(..., is_grads_batched=True)` (jacobian's vectorized path) runs the backward under
    vmap: dg and du are batched there, their amax would mix the samples, and noting them crashed (a batched
    tensor has no data pointer). Nothing is noted; the gradients are the model's without the handoff."""
    x, dy = _data()
    handed, plain = _pair_models(PairMLP("hf"))
    grads = []
    for model in (handed, plain):
        xi = x.clone().requires_grad_(True)
        grads.append(torch.autograd.grad(model(xi), xi, torch.stack([dy, 2 * dy]), is_grads_batched=True)[0])
    assert torch.equal(grads[0], grads[1])
    assert len(swiglu_fusion_of(handed).amaxes) == 0
