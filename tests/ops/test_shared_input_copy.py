"""Linears of a converted model that read the same tensor quantize it once (ops/linear_train.py
SharedInputCopy): q, k and v of an attention, gate and up of an MLP. The same bits as each quantizing its own
copy, one FP8 copy kept for the backward, and a new quantization wherever the tensor or the settings differ."""

import copy
import io
import threading
import weakref

import pytest
import torch

import float8.ops as ops
from float8 import Recipe, TensorwiseScaling
from float8.ops.linear_train import SharedInputCopy, TrainPlan
from tests.ops.tiny_llama import tiny_llama

BF16 = torch.bfloat16
RECIPE = Recipe(min_fp8_gemm_flops=0)
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


class _Block(torch.nn.Module):
    """Three projections of one input and two of another, as in a Hugging Face decoder layer; `between` runs
    on the input after the first projection (a write into it, say)."""

    def __init__(self, d=64, between=None):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, n, bias=b) for n, b in ((64, True), (32, False), (32, False)))
        self.o = torch.nn.Linear(128, d, bias=False)
        self.gate, self.up = torch.nn.Linear(d, 96, bias=False), torch.nn.Linear(d, 96, bias=False)
        self.down = torch.nn.Linear(96, d, bias=False)
        self.between = between

    def forward(self, h):
        x = h * 2  # the attention's input: a new tensor (a norm's output, in a decoder layer)
        q = self.q(x)
        if self.between is not None:
            self.between(x)
        h = h + self.o(torch.cat([q, self.k(x), self.v(x)], dim=-1))
        n = h * 0.5  # the MLP's input: a new tensor, read by gate and up
        return h + self.down(torch.nn.functional.silu(self.gate(n)) * self.up(n))


def _models(between=None, device="cpu"):
    torch.manual_seed(0)
    base = _Block(between=between).to(device, BF16)
    shared = ops.convert(copy.deepcopy(base), recipe=RECIPE)
    alone = ops.convert(copy.deepcopy(base), recipe=RECIPE)
    for m in alone.modules():
        if isinstance(m, ops.Linear):
            m._train_plans.inputs = SharedInputCopy()  # each Linear its own: every one quantizes its input
    return shared, alone


def _step(model, x, dy):
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    y.backward(dy)
    return [y, x.grad] + [p.grad for p in model.parameters()]


def _same(a, b):
    assert a.dtype == b.dtype and torch.equal(a, b), (a - b).abs().max()


@pytest.fixture
def quantized_inputs(monkeypatch):
    """The roles of the quantizations the Linears' training steps run, in order ("x" with its transpose,
    "x_rows" without)."""
    roles = []
    original = TrainPlan.quantize

    def counting(self, role, t, q, with_transpose, amax=None):
        if amax is None:  # a cast from a handed amax (ops/known_amax.py) quantizes nothing of its own
            roles.append(role)
        return original(self, role, t, q, with_transpose, amax)

    monkeypatch.setattr(TrainPlan, "quantize", counting)
    return roles


def _data(device="cpu"):
    torch.manual_seed(1)
    return (torch.randn(2, 16, 64, device=device) * 3).to(BF16), torch.randn(2, 16, 64, device=device).to(BF16)


@pytest.mark.parametrize("device", DEVICES)
def test_readers_of_one_tensor_share_one_copy_with_the_same_bits(device, quantized_inputs):
    shared, alone = _models(device=device)
    x, dy = _data(device)
    for a, b in zip(_step(alone, x, dy), _step(shared, x, dy)):
        _same(a, b)
    # alone: every one of the 7 Linears quantized its input; shared: q, o, gate and down did (k, v and up
    # took the copies of q and gate)
    inputs = [r for r in quantized_inputs if r == "x"]
    assert len(inputs) == 7 + 4


def test_the_readers_keep_one_fp8_transpose_for_the_backward():
    shared, _ = _models()
    nodes = {}
    for name in ("q", "k", "v", "gate", "up"):
        getattr(shared, name).register_forward_hook(lambda m, a, y, name=name: nodes.__setitem__(name, y.grad_fn))
    x, _ = _data()
    shared(x.requires_grad_(True))
    assert nodes["q"].state[0] is nodes["k"].state[0] is nodes["v"].state[0]  # x's transpose, (64, 32) E4M3
    assert nodes["gate"].state[0] is nodes["up"].state[0]
    assert nodes["q"].state[0] is not nodes["gate"].state[0]


def test_a_write_into_the_input_between_readers_quantizes_it_again(quantized_inputs):
    shared, alone = _models(between=lambda x: x.mul_(2))
    x, dy = _data()
    for a, b in zip(_step(alone, x, dy), _step(shared, x, dy)):
        _same(a, b)
    assert quantized_inputs.count("x") == 7 + 5  # k quantizes the written input again; v shares k's copy


def test_other_quantizer_settings_quantize_again(quantized_inputs):
    shared, alone = _models()
    for model in (shared, alone):
        model.k.set_recipe(Recipe(min_fp8_gemm_flops=0, input=TensorwiseScaling(margin=1)), overwrite=True)
    x, dy = _data()
    for a, b in zip(_step(alone, x, dy), _step(shared, x, dy)):
        _same(a, b)
    # k's margin differs from q's: it quantizes x itself, and v (q's settings again) does too (the entry is k's)
    assert quantized_inputs.count("x") == 7 + 6


def test_frozen_weights_share_rows_and_a_trained_one_after_them_quantizes_with_the_transpose(quantized_inputs):
    # Fine-tuning around frozen projections: q and k frozen read x without its transpose (rows), v trained
    # needs the transpose for its weight gradient.
    shared, alone = _models()
    for model in (shared, alone):
        for name in ("q", "k"):
            getattr(model, name).weight.requires_grad_(False)
    x, dy = _data()
    expected = _step(alone, x, dy)
    alone_roles = [r for r in quantized_inputs if r.startswith("x")]
    quantized_inputs.clear()
    for a, b in zip(expected, _step(shared, x, dy)):
        assert (a is None) == (b is None)
        if a is not None:
            _same(a, b)
    assert alone_roles == ["x_rows", "x_rows", "x", "x", "x", "x", "x"]
    # shared: q's rows (k takes them), v's with the transpose, o, gate (up takes them), down
    assert [r for r in quantized_inputs if r.startswith("x")] == ["x_rows", "x", "x", "x", "x"]


def test_a_frozen_reader_then_a_trained_one_over_steps(quantized_inputs):
    # From the second step on the frozen Linear's quantization is the checked call, which hands an empty
    # placeholder for the transpose it was not asked for: the trained reader must not take it as one.
    shared, alone = _models()
    for model in (shared, alone):
        model.q.weight.requires_grad_(False)
    x, dy = _data()
    for _ in range(3):
        for a, b in zip(_step(alone, x, dy), _step(shared, x, dy)):
            assert (a is None) == (b is None)
            if a is not None:
                _same(a, b)
        for model in (shared, alone):
            model.zero_grad()


def test_an_input_made_under_inference_mode_is_quantized_by_each_reader(quantized_inputs):
    # No version counter to key on: not shared, and the readers give the unshared bits.
    shared, alone = _models()
    with torch.inference_mode():
        x, _ = _data()
    for model in (alone, shared):
        y = model.q(x) + model.k(x).repeat(1, 1, 2)
        y.float().sum().backward()
    assert quantized_inputs.count("x") == 4
    _same(alone.k.weight.grad, shared.k.weight.grad)


def test_the_copy_goes_when_its_input_dies():
    shared, _ = _models()
    inputs = shared.q._train_plans.inputs
    x, dy = _data()
    shared(x.requires_grad_(True)).backward(dy)  # down's input (the SwiGLU product) was read last: dead by now
    assert inputs.slot.copy is None
    shared.q(x)
    data = weakref.ref(inputs.slot.copy[0])
    del x  # not saved by the Linear either: its FP8 copy goes with it
    assert inputs.slot.copy is None and data() is None


def test_the_first_backward_lets_the_copy_of_a_living_input_go():
    # A leaf input lives on (autograd's graph holds it) after the forward: the first reader's backward lets the
    # entry go, and the FP8 transpose goes with the last reader's weight-gradient GEMM, not with the input.
    shared, _ = _models()
    inputs = shared.q._train_plans.inputs
    x = torch.randn(32, 64, dtype=BF16, requires_grad=True)
    y = shared.q(x) + shared.k(x).repeat(1, 2)
    x_t = weakref.ref(inputs.slot.copy[1])
    y.backward(torch.ones_like(y))
    assert inputs.slot.copy is None and x_t() is None and x.grad is not None


def test_one_object_per_model_through_copies_and_pickles():
    shared, _ = _models()
    x, _ = _data()
    shared(x)
    for clone in (copy.deepcopy(shared), _reloaded(shared)):
        objs = {id(m._train_plans.inputs) for m in clone.modules() if isinstance(m, ops.Linear)}
        assert len(objs) == 1 and id(shared.q._train_plans.inputs) not in objs
        assert clone.q._train_plans.inputs.slot.copy is None  # derived state is not carried over
        y, y_clone = shared(x), clone(x)
        _same(y, y_clone)


def _reloaded(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_each_thread_has_its_own_entry():
    shared, _ = _models()
    x, _ = _data()
    seen = []
    worker = threading.Thread(target=lambda: (shared.q(x), seen.append(shared.q._train_plans.inputs.slot.copy)))
    worker.start()
    worker.join()
    assert seen[0] is not None  # the worker's own entry: x read by q
    assert shared.q._train_plans.inputs.lookup(x, shared.k.input_quantizer, True) is None  # not this thread's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_a_small_reader_of_a_shared_copy_runs_fp8():
    """The small-layer policy's exception (ops/linear_train.py SHARED_COPY_FLOPS_FRACTION): k, under the
    threshold but above the fraction of it, runs FP8 after q made its input's copy, in bf16 without q before;
    its FP8 bits are those of a recipe that sends every Linear to FP8."""
    d, tokens = 256, 256
    q_flops = 2 * tokens * d * 256  # 3.4e7: over the threshold below; k's (N=128) 1.7e7: under it, over 0.4x
    recipe = Recipe(min_fp8_gemm_flops=q_flops * 0.9)
    torch.manual_seed(0)
    q, k = torch.nn.Linear(d, 256, bias=False), torch.nn.Linear(d, 128, bias=False)
    pair = ops.convert(torch.nn.ModuleDict({"q": q, "k": k}).to("cuda", BF16), recipe=recipe)
    every = ops.convert(copy.deepcopy(pair), recipe=Recipe(min_fp8_gemm_flops=0))
    x = torch.randn(tokens, d, device="cuda", dtype=BF16, requires_grad=True)
    h = x * 2
    assert type(pair["k"](h).grad_fn).__name__ != "_TrainLinearBackward"  # alone: under the policy, bf16
    pair["q"](h)
    y = pair["k"](h)
    assert type(y.grad_fn).__name__ == "_TrainLinearBackward"
    every["q"](h)
    _same(y, every["k"](h))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_a_checkpointed_small_reader_keeps_its_precision_in_the_recompute():
    """Under saved-tensor hooks (a non-reentrant checkpoint around k alone, q outside it) the exception is off:
    k runs as its layer alone decides, in the forward and in the recompute, which finds no shared entry."""
    from torch.utils.checkpoint import checkpoint

    d, tokens = 256, 256
    recipe = Recipe(min_fp8_gemm_flops=2 * tokens * d * 256 * 0.9)  # q over the line, k (N=128) over 0.4x of it
    torch.manual_seed(0)
    q, k = torch.nn.Linear(d, 256, bias=False), torch.nn.Linear(d, 128, bias=False)
    pair = ops.convert(torch.nn.ModuleDict({"q": q, "k": k}).to("cuda", BF16), recipe=recipe)
    x = torch.randn(tokens, d, device="cuda", dtype=BF16, requires_grad=True)
    h = x * 2
    a = pair["q"](h)
    b = checkpoint(pair["k"], h, use_reentrant=False)
    torch.cat([a, b], dim=-1).float().sum().backward()  # a CheckpointError if the recompute ran otherwise
    assert pair["k"].weight.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_a_reader_on_another_stream_quantizes_itself(quantized_inputs):
    shared, alone = _models(device="cuda")
    x, _ = _data("cuda")
    side = torch.cuda.Stream()
    outs = []
    for model in (alone, shared):
        h = x * 2
        model.q(h)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            outs.append(model.k(h))
        torch.cuda.current_stream().wait_stream(side)
    assert quantized_inputs.count("x") == 4  # k did not take q's copy, written on the other stream
    _same(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_a_reentrant_checkpoints_recompute_keeps_the_forwards_precision():
    """A reentrant checkpoint runs its first forward without grad (no shared copy is made then, k runs as its
    layer alone decides); its recompute, inside the backward, must run k the same way."""
    from torch.utils.checkpoint import checkpoint

    d, tokens = 256, 256
    recipe = Recipe(min_fp8_gemm_flops=2 * tokens * d * 256 * 0.9)
    torch.manual_seed(0)
    q, k = torch.nn.Linear(d, 256, bias=False), torch.nn.Linear(d, 128, bias=False)
    pair = ops.convert(torch.nn.ModuleDict({"q": q, "k": k}).to("cuda", BF16), recipe=recipe)
    nodes = []
    pair["k"].register_forward_hook(lambda m, a, y: nodes.append(type(y.grad_fn).__name__ if y.grad_fn else None))

    def block(h):
        return torch.cat([pair["q"](h), pair["k"](h)], dim=-1)

    x = torch.randn(tokens, d, device="cuda", dtype=BF16, requires_grad=True)
    checkpoint(block, x * 2, use_reentrant=True).float().sum().backward()
    assert nodes[0] is None and nodes[1] != "_TrainLinearBackward"  # the forward without grad; the recompute


def test_hugging_face_llama_shares_the_norms_copies_with_the_same_loss(quantized_inputs):
    """The user path: a Hugging Face LlamaForCausalLM converted. Per layer q, k and v read the first norm's
    output and gate and up the second's: 4 quantizations of inputs instead of 7 (q, o, gate, down, plus
    lm_head once), and the loss and every gradient of the unshared model, bit for bit."""
    base = tiny_llama()
    shared = ops.convert(copy.deepcopy(base))
    alone = ops.convert(copy.deepcopy(base))
    for m in alone.modules():
        if isinstance(m, ops.Linear):
            m._train_plans.inputs = SharedInputCopy()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    counts, losses = [], []
    for model in (alone, shared):
        quantized_inputs.clear()
        out = model(ids, labels=ids)
        out.loss.backward()
        counts.append(quantized_inputs.count("x"))
        losses.append(out.loss)
    assert counts == [2 * 7 + 1, 2 * 4 + 1]
    assert torch.equal(losses[0], losses[1])
    for p, q in zip(alone.parameters(), shared.parameters()):
        _same(p.grad, q.grad)
