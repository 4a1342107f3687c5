"""float8.ops.convert and float8.memory_footprint: plain models, a Hugging Face model built from a config,
the skip rules, FP8-only weights that free their high-precision copy."""

import gc
import weakref

import pytest
import torch

import float8
import float8.ops as ops
from float8 import Float8Tensor, Recipe, memory_footprint
from tests.tolerances import SQNR_DB, sqnr_db


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64, bias=False)).to(
        dtype
    )


def test_convert_swaps_linears_in_place_and_keeps_the_parameters():
    model = _mlp()
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64)
    ref = model(x)
    assert ops.convert(model) is model
    assert [type(m) for m in model] == [ops.Linear, torch.nn.GELU, ops.Linear]
    assert all(a is b for a, b in zip(model.parameters(), params))
    y = model(x)
    assert sqnr_db(ref.double(), y) >= SQNR_DB["linear"] - 3  # two FP8 GEMMs in a row
    y.square().mean().backward()
    before = [p.detach().clone() for p in params]
    opt.step()  # the optimizer built before conversion updates the converted layers' weights
    assert all(not torch.equal(p, b) for p, b in zip(params, before))
    assert model(x).shape == (8, 64)


def test_filter_fn_and_the_returned_root():
    model = _mlp()
    ops.convert(model, filter_fn=lambda m, fqn: fqn != "2")
    assert type(model[0]) is ops.Linear and type(model[2]) is torch.nn.Linear
    lone = torch.nn.Linear(32, 16)
    op = ops.convert(lone)
    assert type(op) is ops.Linear and op.weight is lone.weight and op.bias is lone.bias


def test_layers_fp8_cannot_serve_stay_with_a_warning_listing_them():
    class Sub(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(
        torch.nn.Linear(64, 10), torch.nn.Linear(10, 64), Sub(64, 64), torch.nn.Linear(64, 64).double()
    )
    with pytest.warns(ops.ConversionWarning) as record:
        ops.convert(model)
    text = str(record[0].message)
    assert "4 layer(s)" in text
    for expected in (
        "0: in_features=64, out_features=10",
        "1: in_features=10",
        "2: Sub is a subclass",
        "3: weight dtype torch.float64",
    ):
        assert expected in text
    assert all(type(m) is not ops.Linear for m in model)
    # They keep working as they were.
    assert model[0](torch.randn(2, 64)).shape == (2, 10)


def test_fp8_weights_are_one_byte_and_free_the_high_precision_copy():
    model = _mlp(torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
    bf16_bytes = memory_footprint(model)
    w0 = weakref.ref(model[0].weight)
    ops.convert(model, fp8_weights=True)
    gc.collect()
    assert w0() is None  # the bf16 weight is gone
    for lin in (model[0], model[2]):
        w = lin.weight
        assert isinstance(w, Float8Tensor) and not w.requires_grad and w.transpose_cache is None
        assert w.dtype == torch.bfloat16  # nominal: element_size() reports 2 (documented)
    linear_params = 64 * 128 * 2
    # 1 byte per weight element + a 4-byte scale each; the bias stays bf16.
    assert memory_footprint(model) == linear_params + 2 * 4 + 128 * 2
    assert bf16_bytes == linear_params * 2 + 128 * 2
    with torch.no_grad():
        y = model(x)
    assert sqnr_db(ref.double(), y) >= SQNR_DB["linear"] - 3
    assert memory_footprint(model) == linear_params + 2 * 4 + 128 * 2  # inference made no transpose and no cache


def test_converted_op_gets_fp8_weights_later_and_tied_weights_are_kept_tied():
    model = _mlp()
    ops.convert(model)
    ops.convert(model, fp8_weights=True)
    assert isinstance(model[0].weight, Float8Tensor)
    emb = torch.nn.Embedding(64, 32)
    head = torch.nn.Linear(32, 64, bias=False)
    head.weight = emb.weight
    tied = torch.nn.ModuleDict({"emb": emb, "head": head})
    ops.convert(tied)
    assert tied["head"].weight is tied["emb"].weight  # same Parameter: still tied
    tied2 = torch.nn.ModuleDict({"emb": torch.nn.Embedding(64, 32), "head": torch.nn.Linear(32, 64, bias=False)})
    tied2["head"].weight = tied2["emb"].weight
    with pytest.warns(ops.ConversionWarning, match="shared with emb.weight"):
        ops.convert(tied2, fp8_weights=True)
    assert type(tied2["head"]) is torch.nn.Linear


def test_fp8_only_weight_that_requires_grad_is_refused():
    model = ops.convert(_mlp(), fp8_weights=True)
    model[0].weight.requires_grad_(True)
    with pytest.raises(ValueError, match="no high-precision master"):
        model(torch.randn(4, 64)).sum().backward()


def test_meta_device_conversion_then_materialize():
    with torch.device("meta"):
        model = _mlp()
    ops.convert(model)
    model.to_empty(device="cpu")
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    assert model(torch.randn(2, 64)).isfinite().all()
    with torch.device("meta"):
        meta = _mlp()
    with pytest.warns(ops.ConversionWarning, match="meta device"):
        ops.convert(meta, fp8_weights=True)


def test_memory_footprint_counts_caches_and_shared_storage_once():
    lin = ops.Linear(64, 32, bias=False)
    assert memory_footprint(lin) == 64 * 32 * 4
    with torch.no_grad():
        lin(torch.randn(4, 64))  # inference caches the weight's FP8 copy: a later forward reads it
    assert memory_footprint(lin) == 64 * 32 * 4 + 64 * 32 + 4
    assert memory_footprint(lin, caches=False) == 64 * 32 * 4
    lin(torch.randn(4, 64)).sum().backward()  # a training step keeps no copy
    assert memory_footprint(lin) == 64 * 32 * 4
    assert float8.memory.tensor_bytes(Float8Tensor.quantize(torch.randn(16, 16))) == 256 + 4


_HF_SCRIPT = r"""
import torch, transformers
import float8.ops as ops
from float8 import Recipe, memory_footprint
from tests.tolerances import sqnr_db

cfg = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
ids = torch.randint(0, 256, (2, 16))
with torch.no_grad():
    ref = model(ids).logits
ops.convert(model, recipe=Recipe(min_fp8_gemm_flops=0))
linears = [m for m in model.modules() if isinstance(m, ops.Linear)]
assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
out = model(ids, labels=ids)
out.loss.backward()
assert all(m.weight.grad is not None for m in linears)
with torch.no_grad():
    y = model(ids).logits
assert sqnr_db(ref.double(), y) >= 20, sqnr_db(ref.double(), y)
hf_bytes = model.get_memory_footprint()
ops.convert(model, fp8_weights=True)
model.requires_grad_(False)
with torch.no_grad():
    assert sqnr_db(ref.double(), model(ids).logits) >= 20
linear_elems = sum(m.weight.numel() for m in linears)
# HF counts the nominal dtype (2 bytes); the real footprint saves 1 byte per Linear weight element.
assert model.get_memory_footprint() == hf_bytes
assert memory_footprint(model) == hf_bytes - linear_elems + 4 * len(linears), (memory_footprint(model), hf_bytes)
print("ok")
"""


def test_hugging_face_model_from_a_config():
    pytest.importorskip("transformers", reason="transformers is in the test extra; not installed here")
    # In its own process: after a transformers model ran in the pytest process, a later, unrelated test
    # crashed natively in 2 of 7 runs of tests/ops (never without this test; not reproduced in smaller sets).
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run(
        [sys.executable, "-c", _HF_SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def test_a_second_convert_with_a_recipe_applies_it_and_without_one_keeps_the_first():
    """It used to keep the first recipe silently (issue 23 item 8)."""
    model = ops.convert(_mlp(torch.bfloat16))
    ops.convert(model, recipe=Recipe.rowwise())
    linears = [m for m in model.modules() if isinstance(m, ops.Linear)]
    assert linears and all(m.recipe == Recipe.rowwise() for m in linears)
    assert all(type(m.input_quantizer).__name__ == "RowwiseQuantizer" for m in linears)
    ops.convert(model)  # no recipe: nothing changes
    assert all(m.recipe == Recipe.rowwise() for m in linears)
    ops.convert(model, recipe=Recipe(), filter_fn=lambda m, fqn: fqn == "0")
    assert linears[0].recipe == Recipe() and linears[1].recipe == Recipe.rowwise()  # fqn "2" kept its own


def test_a_converted_linear_respects_autocast_like_nn_linear():
    """Under torch.autocast(dtype=bfloat16) nn.Linear returns bfloat16 from float32 inputs and weights; a
    converted one returned float32 (issue 23 item 5)."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 32)
    conv = ops.convert(torch.nn.Sequential(torch.nn.Linear(64, 32)))[0]
    conv.load_state_dict(ref.state_dict())
    x = torch.randn(16, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = ref(x), conv(x)
    assert want.dtype == got.dtype == torch.bfloat16
    assert sqnr_db(want.double(), got.double()) >= SQNR_DB["linear"]
    got.float().sum().backward()
    assert x.grad.dtype == torch.float32 and conv.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("recipe", [None, Recipe(min_fp8_gemm_flops=0)], ids=["policy", "fp8"])
@pytest.mark.parametrize("lead", [(64,), (2, 32)])
def test_an_in_place_activation_after_a_converted_linear_trains(recipe, lead):
    """nn.ReLU(inplace=True) after a converted Linear failed in training ('Output 0 of View is a view and is
    being modified inplace'): the op's output was a view made inside its autograd Function. It trains now,
    with the bits of the same model with an out-of-place ReLU."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256), torch.nn.ReLU(inplace=True), torch.nn.Linear(256, 256)]
    in_place = torch.nn.Sequential(*layers).to(torch.bfloat16)
    out_of_place = torch.nn.Sequential(in_place[0], torch.nn.ReLU(), in_place[2])
    in_place, out_of_place = ops.convert(in_place, recipe=recipe), ops.convert(out_of_place, recipe=recipe)
    x = torch.randn(*lead, 256, dtype=torch.bfloat16)
    grads = []
    for model in (in_place, out_of_place):
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        y.float().square().sum().backward()
        grads.append([y, xi.grad, in_place[0].weight.grad.clone()])
        model.zero_grad(set_to_none=True)
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_an_in_place_write_into_an_output_a_backward_reads_is_refused():
    """ops.Attention keeps its output for its backward: writing into the run's output then raises at backward,
    as torch's own ops do, instead of computing gradients from the written values."""
    seq = ops.Sequential(ops.Linear(64, (4 + 2 * 2) * 16, bias=False), ops.Attention(4, 16, num_kv_heads=2))
    y = seq.to(torch.bfloat16)(torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True))
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()


def test_an_in_place_write_into_an_output_that_is_a_view_of_the_input_is_refused():
    """ops.Identity hands out a view of its input: a write into it writes the input, which autograd must see.
    It is refused (as before in-place writes into other outputs were allowed), never differentiated wrongly."""
    a = torch.randn(2, 8, 64, requires_grad=True)
    x = a * 1
    y = ops.Sequential(ops.Identity())(x)
    with pytest.raises(RuntimeError, match="view"):
        y.mul_(3)
