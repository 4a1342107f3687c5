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
    with pytest.raises(ValueError, match="tensor argument 0 is on cpu"):
        graphed(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="requires grad"):
        graphed(torch.zeros(1, 4, requires_grad=True))
    with pytest.raises(TypeError, match=r"argument 0 \(set\) is neither a tensor nor hashable"):
        graphed({1})
    with pytest.raises(ValueError, match="no tensor argument"):
        graphed(3)
    with pytest.raises(ValueError, match="warmup_calls must be >= 1"):
        ops.graphed_inference(_model(), warmup_calls=0)
    assert graphed.captures == 0


def test_snapshot_holds_across_a_forward_and_in_place_reads():
    model = _model()
    snap = ModuleSnapshot.of(model)
    with torch.inference_mode():
        model(torch.zeros(1, 4, dtype=torch.long))
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert snap.unchanged()


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
    graphed(input_ids=ids, use_cache=True)  # another value of a non-tensor argument: another graph
    assert graphed.captures == 2
