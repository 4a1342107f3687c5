"""A deleted model, optimizer and loss are freed at once, without the garbage collector.

Reference cycles keep a model's memory (its GPU memory, on a GPU) alive until Python's cycle collector runs.
Each case runs with the collector off: after a training step (or an inference forward) and `del`, no
parameter or module of the model may still be alive. A cycle that comes back fails here. A model under
torch.compile waits for one full collection (dynamo's compile-time state holds its modules in cycles that
dynamo's own post-compile collection moves into the oldest generation: docs/bad_input.md); the compiled
cases check that one `gc.collect()` frees it, so that nothing holds it for good.
"""

import gc
import weakref

import pytest
import torch

import float8.ops as ops
from float8 import Recipe

BF16 = torch.bfloat16
RECIPES = {
    "tensorwise": None,
    "delayed": Recipe.delayed(),
    "lean": Recipe(lean_activations=True),
    "rowwise": Recipe.rowwise(),
    "blockwise": Recipe.blockwise(),
}


def _converted(recipe, fp8_weights=False):
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.SiLU(), torch.nn.Linear(256, 128, bias=False))
    return ops.convert(model.to(BF16), recipe=recipe, fp8_weights=fp8_weights)


def _block(recipe):
    return ops.Sequential(
        ops.Residual(),
        ops.RMSNorm(64),
        ops.Linear(64, (4 + 2 * 2) * 16, bias=False),
        ops.Attention(4, 16, num_kv_heads=2),
        ops.Linear(64, 64, bias=False),
        ops.AddResidual(),
        ops.Residual(),
        ops.LayerNorm(64),
        ops.Linear(64, 256),
        ops.SwiGLU(),
        ops.Linear(128, 64),
        ops.AddResidual(),
        recipe=recipe,
    ).to(BF16)


def _freed_without_gc(build, step, collect_once=False):
    """Build a model, run `step(model)` (which may return an optimizer to drop too), delete everything and
    count what is still alive with the cycle collector off (collect_once: after one full collection, for a
    compiled model; dynamo's caches are reset first)."""
    gc.collect()
    gc.disable()
    try:
        if collect_once:
            torch._dynamo.reset()
        torch.manual_seed(0)
        model = build()
        refs = [weakref.ref(t) for t in model.parameters()] + [weakref.ref(m) for m in model.modules()]
        keep = step(model)
        del model, keep
        if collect_once:
            gc.collect()
        alive = [r() for r in refs if r() is not None]
        return [type(a).__name__ for a in alive]
    finally:
        gc.enable()


def _train_step(model, x_shape=(2, 16, 128)):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loss = model(torch.randn(x_shape, dtype=BF16)).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return opt


@pytest.mark.parametrize("recipe", RECIPES, ids=list(RECIPES))
def test_converted_model_after_a_training_step(recipe):
    assert _freed_without_gc(lambda: _converted(RECIPES[recipe]), _train_step) == []


@pytest.mark.parametrize("tokens", [16, 200], ids=["weight-only", "fp8-gemm"])
def test_fp8_weights_after_inference(tokens):
    def infer(model):
        with torch.inference_mode():
            model(torch.randn(tokens, 128, dtype=BF16))

    assert _freed_without_gc(lambda: _converted(None, fp8_weights=True), infer) == []


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "lean"])
def test_sequential_block_with_attention_after_a_training_step(recipe):
    assert _freed_without_gc(lambda: _block(RECIPES[recipe]), lambda m: _train_step(m, (2, 16, 64))) == []


class _TwoReaders(torch.nn.Module):
    """Two Linears reading one tensor: they share its FP8 copy (ops/linear_train.py SharedInputCopy)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(128, 128), torch.nn.Linear(128, 128, bias=False)

    def forward(self, x):
        return self.a(x) * self.b(x)


def test_linears_sharing_an_input_copy_while_the_input_lives():
    kept = []

    def step(model):
        x = torch.randn(2, 16, 128, dtype=BF16, requires_grad=True)
        model(x).float().sum().backward()  # the backward lets the entry go
        model(x)  # a forward whose output is dropped: the entry stays while x lives
        kept.append(weakref.ref(model.a._train_plans.inputs.slot.copy[0]))
        return x  # the input outlives the step, so the model's entry holds its copy when the model goes

    assert _freed_without_gc(lambda: ops.convert(_TwoReaders().to(BF16)), step) == []
    assert kept[0]() is None


def test_a_forward_whose_output_is_dropped_before_backward():
    def forward_only(model):
        model(torch.randn(2, 16, 128, dtype=BF16, requires_grad=True))  # the graph dies with the output

    assert _freed_without_gc(lambda: _converted(None), forward_only) == []


def test_linear_cross_entropy_after_a_training_step():
    def step(model):
        x = torch.randn(32, 64, dtype=BF16, requires_grad=True)
        model(x, torch.randint(0, 512, (32,))).backward()

    build = lambda: ops.LinearCrossEntropy(64, 512, recipe=Recipe()).to(BF16)  # noqa: E731
    assert _freed_without_gc(build, step) == []


def test_a_lone_linear():
    assert _freed_without_gc(lambda: ops.Linear(64, 64), lambda m: None) == []


@pytest.mark.parametrize("recipe", ["tensorwise", "lean"])
def test_compiled_converted_model_is_freed_by_one_collection(recipe):
    def compiled_step(model):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        return _train_step(compiled), compiled

    assert _freed_without_gc(lambda: _converted(RECIPES[recipe]), compiled_step, collect_once=True) == []


def test_compiled_inference_with_fp8_weights_is_freed_by_one_collection():
    def infer(model):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            compiled(torch.randn(16, 128, dtype=BF16))
        return compiled

    assert _freed_without_gc(lambda: _converted(None, fp8_weights=True), infer, collect_once=True) == []


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [None, Recipe(inference_fp8_input_from=33)], ids=["weight-only", "fp8-input"])
def test_gpu_prepared_inference_state_is_freed_without_gc(recipe):
    """Prepared decode-size calls keep plans, tile counters and a workspace shared by the model's Linears
    (kernels/weight_only.py, kernels/scratch.py): they go with the model, without the collector."""
    gc.collect()
    gc.disable()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4096, 1024), torch.nn.SiLU(), torch.nn.Linear(1024, 4096))
        model = ops.convert(model.to("cuda", BF16), recipe=recipe, fp8_weights=True)
        with torch.inference_mode():
            x = torch.randn(64, 4096, device="cuda", dtype=BF16)
            for _ in range(3):  # the first call of a shape plans it, the later ones take the prepared launch
                model(x)
        plans = model[0]._inference_plans
        kept = plans.scratch.tensors() + [c for p in plans.values() for c in p.counts.values()]
        assert kept, "a 4096->1024 layer at 64 tokens splits K: its calls keep a workspace and counters"
        refs = [weakref.ref(t) for t in (*kept, *model.parameters())] + [weakref.ref(m) for m in model.modules()]
        del model, plans, kept
        assert [type(r()).__name__ for r in refs if r() is not None] == []
    finally:
        gc.enable()
