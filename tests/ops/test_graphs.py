"""ops.graphed_inference: a model's inference forward as CUDA graph replays (ops/graphs.py).

On the CPU: the calls it refuses, each with an error that names the problem, and the module snapshot that decides
whether a captured graph may be replayed (every kind of change it must see, and no false alarm after a plain
forward). On the GPU: replays equal eager to the bit (a converted Llama-style model at decode and prefill sizes,
bf16 and FP8-only weights, a Hugging Face model with keyword arguments), outputs that the next call does not
overwrite, and a fresh capture after each change of the model.
"""

import pytest
import torch

import float8.ops as ops
from benchmarks.llama import TINY, Block
from float8 import Float8Tensor
from float8.ops.graphs import ModuleSnapshot

BF16 = torch.bfloat16
gpu = pytest.mark.gpu


def _model(device="cpu", fp8_weights=True, seed=0):
    torch.manual_seed(seed)
    s = TINY
    model = torch.nn.Sequential(
        torch.nn.Embedding(s.vocab, s.d),
        *[Block(s) for _ in range(2)],
        torch.nn.RMSNorm(s.d, eps=1e-6),
        torch.nn.Linear(s.d, s.vocab, bias=False),
    )
    return ops.convert(model.to(device, BF16), fp8_weights=fp8_weights).eval()


def _first_linear(model):
    return next(m for m in model.modules() if isinstance(m, ops.Linear))


def test_refused_calls_name_the_problem():
    graphed = ops.graphed_inference(_model())
    with pytest.raises(ValueError, match=r"argument args\[0\] is on cpu"):
        graphed(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"argument kwargs\['x'\] requires grad"):
        graphed(x=torch.zeros(1, 4, requires_grad=True))
    with pytest.raises(TypeError, match=r"argument args\[0\] is a set; a graph can stand for tensors and plain"):
        graphed({1})
    with pytest.raises(TypeError, match=r"argument kwargs\['cache'\] is a object.*KV cache"):
        graphed(cache=object())
    with pytest.raises(ValueError, match="no tensor argument"):
        graphed(3)
    with pytest.raises(ValueError, match="warmup_calls must be >= 1"):
        ops.graphed_inference(_model(), warmup_calls=0)
    assert graphed.captures == 0


def test_signature_tells_plain_values_apart_and_keys_every_nan_alike():
    graphed = ops.graphed_inference(_model())
    key = lambda *args: graphed._signature(list(args), None, (args, {}))  # noqa: E731
    assert len({key(1), key(1.0), key(True)}) == 3  # equal and hashing alike, but not the same argument
    assert key(float("nan")) == key(float("nan"))  # NaN != NaN: without this, every call would capture anew


def test_snapshot_holds_across_a_forward_and_in_place_reads():
    model = _model()
    with torch.inference_mode():
        model(torch.zeros(1, 4, dtype=torch.long))  # whatever a first call makes lazily
    snap = ModuleSnapshot.of(model)
    with torch.inference_mode():
        model(torch.zeros(1, 4, dtype=torch.long))
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert snap.unchanged()
    with torch.no_grad():
        model[-2].weight.mul_(1)  # a write: the version moves, the state does not
    assert snap.state_unchanged() and not snap.unchanged()


@pytest.mark.parametrize(
    "change",
    [
        "weight rebound",
        "weight written in place",
        "fp8 bits re-pointed",
        "norm weight .data",
        "norm weight written",
        "submodule replaced",
        "submodule added",
        "buffer added",
        "a submodule in train mode",
        "forward hook",
        "forward pre-hook",
        "ops.high_precision",
        "a submodule replaced by one at the same address",
        "weight .data re-shaped over the same storage",
    ],
)
def test_snapshot_sees_every_change(change):
    model = _model()
    lin = _first_linear(model)
    snap = ModuleSnapshot.of(model)
    with torch.no_grad():
        if change == "weight rebound":
            lin.weight = torch.nn.Parameter(lin.weight.detach().clone(), requires_grad=False)
        elif change == "weight written in place":
            lin.weight.copy_(Float8Tensor.quantize(torch.randn(lin.out_features, lin.in_features, dtype=BF16)))
        elif change == "fp8 bits re-pointed":
            lin.weight._data = lin.weight._data.clone()
        elif change == "norm weight .data":
            model[-2].weight.data = torch.ones_like(model[-2].weight)
        elif change == "norm weight written":
            model[-2].weight.mul_(2)
        elif change == "submodule replaced":
            model[1] = Block(TINY).to(BF16)
        elif change == "submodule added":
            model[1].extra = torch.nn.ReLU()
        elif change == "buffer added":
            model[1].register_buffer("extra", torch.zeros(1))
        elif change == "a submodule in train mode":
            model[1].train()
        elif change == "forward hook":
            model[1].register_forward_hook(lambda *a: None)
        elif change == "forward pre-hook":
            lin.register_forward_pre_hook(lambda *a: None)
        elif change == "ops.high_precision":
            with ops.high_precision(model):
                assert not snap.unchanged()
            return
        elif change == "a submodule replaced by one at the same address":
            model[1] = None  # the old block is freed; a new one may get its address (the snapshot holds it)
            model[1] = Block(TINY).to(BF16)
        elif change == "weight .data re-shaped over the same storage":
            emb = model[0]  # the same storage, the same address, another shape
            emb.weight.data = emb.weight.data.view(emb.weight.shape[1], -1)
    assert not snap.unchanged()


@gpu
@pytest.mark.parametrize("fp8_weights", [True, False])
def test_gpu_replays_equal_eager_at_every_size(fp8_weights):
    model = _model("cuda", fp8_weights=fp8_weights)
    graphed = ops.graphed_inference(model)
    for tokens in (1, 16, 128, 300):
        for seed in range(2):
            ids = torch.randint(
                0, TINY.vocab, (1, tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(seed)
            )
            with torch.inference_mode():
                want = model(ids)
            got = graphed(ids)
            assert torch.equal(got, want), (tokens, seed)
    assert graphed.captures == 4  # one per shape; the second call of a shape replays


@gpu
def test_gpu_outputs_survive_the_next_call():
    model = _model("cuda")
    graphed = ops.graphed_inference(model)
    a = torch.randint(0, TINY.vocab, (1, 16), device="cuda")
    b = torch.randint(0, TINY.vocab, (1, 16), device="cuda")
    out_a = graphed(a)
    kept = out_a.clone()
    out_b = graphed(b)
    assert torch.equal(out_a, kept) and not torch.equal(out_a, out_b)
    assert out_a.requires_grad is False and not out_a.is_inference()


@gpu
@pytest.mark.parametrize("fp8_weights", [True, False])
def test_gpu_a_changed_model_is_captured_again(fp8_weights):
    model = _model("cuda", fp8_weights=fp8_weights)
    graphed = ops.graphed_inference(model)
    ids = torch.randint(0, TINY.vocab, (1, 16), device="cuda")
    graphed(ids)
    lin = _first_linear(model)
    torch.manual_seed(1)
    new = torch.randn(lin.out_features, lin.in_features, device="cuda", dtype=BF16)
    with torch.no_grad():  # in place: bf16 weights keep an FP8 copy made from them on the host's say-so
        lin.weight.copy_(Float8Tensor.quantize(new) if fp8_weights else new)
    with torch.inference_mode():
        want = model(ids)
    assert torch.equal(graphed(ids), want)
    assert graphed.captures == 2
    model[1] = Block(TINY).to("cuda", BF16)  # a new submodule, plain bf16
    with torch.inference_mode():
        want = model(ids)
    assert torch.equal(graphed(ids), want)
    assert graphed.captures == 3
    graphed(ids)
    assert graphed.captures == 3


@gpu
def test_gpu_hugging_face_model_with_keyword_arguments():
    pytest.importorskip("transformers")
    from tests.float8.test_checkpoint import _tiny_hf_llama

    model = _tiny_hf_llama(0, device="cuda").eval()  # width 128, vocabulary 256, FP8-only weights
    graphed = ops.graphed_inference(model)
    ids = torch.randint(0, 256, (2, 16), device="cuda")
    with torch.inference_mode():
        want = model(input_ids=ids, use_cache=False).logits
    got = graphed(input_ids=ids, use_cache=False)
    assert torch.equal(got.logits, want)
    assert graphed.captures == 1
    # With a cache the output holds a DynamicCache, an object the warm-ups fill and no replay would.
    with pytest.raises(TypeError, match="returns a DynamicCache"):
        graphed(input_ids=ids, use_cache=True)
    assert graphed.captures == 1


class _Counting(torch.nn.Module):
    """Adds its input's sum to a buffer in place, as a delayed-scaling history is written."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros((), device="cuda"))

    def forward(self, x):
        self.seen.add_(x.sum())
        return x * 2


@gpu
def test_gpu_buffers_written_in_place_advance_once_per_call_as_eagerly():
    eager, graphed_model = _Counting(), _Counting()
    graphed = ops.graphed_inference(graphed_model)
    for i in range(4):
        x = torch.full((8,), float(i + 1), device="cuda")
        with torch.inference_mode():
            eager(x)
        graphed(x)
        assert torch.equal(graphed_model.seen, eager.seen), i  # the warm-up calls are undone
    assert graphed.captures == 1


@gpu
def test_gpu_forwards_a_graph_cannot_replay_are_refused():
    class Rebinding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("step", torch.zeros((), device="cuda"))

        def forward(self, x):
            self.step = self.step + 1  # a new tensor per call: a graph would keep reading the first
            return x + self.step

    class WritingItsInput(torch.nn.Module):
        def forward(self, x):
            return x.add_(1)

    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match="rebinds module state"):
        ops.graphed_inference(Rebinding())(x)
    with pytest.raises(RuntimeError, match=r"writes into its tensor argument\(s\) args\[0\] in place"):
        ops.graphed_inference(WritingItsInput())(x)


class _GrowingCache(torch.nn.Module):
    """Rebinds its buffer when an input is longer than it (as a rotary cache grown for a longer sequence)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(4.0, device="cuda"))

    def forward(self, x):
        if x.shape[-1] > self.table.numel():
            self.table = torch.arange(float(x.shape[-1]), device="cuda")
        return x * self.table[: x.shape[-1]]


@gpu
def test_gpu_a_capture_that_rebinds_state_drops_the_graphs_that_read_the_old_state():
    eager, model = _GrowingCache(), _GrowingCache()
    graphed = ops.graphed_inference(model)
    short, long = torch.ones(4, device="cuda"), torch.ones(16, device="cuda")
    for x in (short, long, short, long):
        with torch.inference_mode():
            want = eager(x)
        assert torch.equal(graphed(x), want)
    assert graphed.captures == 3  # short, long (its first call grew the table: short's graph went), short


@gpu
def test_gpu_a_first_call_under_inference_mode_then_calls_in_other_modes():
    model = _model("cuda")
    graphed = ops.graphed_inference(model)
    ids = torch.randint(0, TINY.vocab, (1, 16), device="cuda")
    with torch.inference_mode():
        first = graphed(ids)
    with torch.no_grad():
        assert torch.equal(graphed(ids), first)
    assert torch.equal(graphed(ids), first)
    assert graphed.captures == 1


@gpu
def test_gpu_split_k_layers_replay_their_eager_bits():
    """A narrow layer with a long K splits K at decode sizes (its partials summed in the kernel, with
    counters the graph zeroes): replays keep eager's bits, call after call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8192, 128), torch.nn.GELU(), torch.nn.Linear(128, 14336 // 2))
    model = ops.convert(model.to("cuda", BF16), fp8_weights=True).eval()
    graphed = ops.graphed_inference(model)
    for i in range(5):
        x = torch.randn(16, 8192, device="cuda", dtype=BF16)
        with torch.inference_mode():
            want = model(x)
        assert torch.equal(graphed(x), want), i
    assert graphed.captures == 1
