"""GPU tier: the steps users run never make the host wait for the GPU.

A call that synchronizes the stream (a blocking copy from pageable memory, `.item()`, `bool(tensor)`, a
`.tolist()`) empties the queue the host had built ahead of the GPU: the next kernels start only once the
host has launched them again. One such copy in ops.requantize_weights cost 10% of a small training step on
the H100 (benchmarks/results/profile_multi_quantize.txt). `torch.cuda.set_sync_debug_mode("error")` raises
on any synchronizing call, so each test below runs its steps under it, after warm-up calls (the first call of
a kernel compiles it; the first call of a shape plans it).
"""

from __future__ import annotations

import pytest
import torch

import float8.ops as ops
from float8 import Recipe
from tests.ops.user_mlp import D, UserMlp, forced, ops_mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


RECIPES = {
    "tensorwise": forced(Recipe()),
    "lean": forced(Recipe(lean_activations=True)),
    "delayed": forced(Recipe.delayed()),
    "rowwise": forced(Recipe.rowwise()),
}


def _without_sync(fn) -> None:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_gpu_the_detector_catches_a_blocking_copy():
    """The tests below mean something only if the debug mode raises on what they guard against: here a
    pageable host-to-device copy, the form that ops.requantize_weights' table once took."""
    with pytest.raises(RuntimeError, match="synchroniz"):
        _without_sync(lambda: torch.tensor([1, 2, 3]).to("cuda"))


def _train(model, steps: int, requantize: bool) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(4, 128, D, device="cuda", dtype=torch.bfloat16)

    def step(requantize_now):
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()
        if requantize_now:
            ops.requantize_weights(model)

    for r in (False, requantize):  # warm-up: kernels compiled, optimizer state made
        step(r)
    _without_sync(lambda: [step(requantize) for _ in range(steps)])
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("requantize", [False, True])
def test_gpu_converted_training_steps_never_synchronize(name, requantize):
    torch.manual_seed(0)
    model = ops.convert(torch.nn.Sequential(UserMlp(), UserMlp()).to("cuda", torch.bfloat16), recipe=RECIPES[name])
    _train(model, 3, requantize)


@pytest.mark.parametrize("name", ["tensorwise", "lean"])
def test_gpu_sequential_training_steps_never_synchronize(name):
    torch.manual_seed(0)
    model = ops_mlp(RECIPES[name]).to("cuda", torch.bfloat16)
    _train(model, 3, requantize=False)


@pytest.mark.parametrize("fp8_input_from", [129, 33])
def test_gpu_fp8_weight_inference_never_synchronizes(fp8_input_from):
    """Decode sizes (prepared weight-only or FP8-input calls), a prefill size, and a calibrated model."""
    torch.manual_seed(0)
    recipe = Recipe(inference_fp8_input_from=fp8_input_from)
    model = torch.nn.Sequential(UserMlp(), UserMlp()).to("cuda", torch.bfloat16).eval()
    ops.convert(model, fp8_weights=True, recipe=recipe)
    inputs = [torch.randn(1, t, D, device="cuda", dtype=torch.bfloat16) for t in (1, 16, 64, 300)]
    with torch.inference_mode():
        for x in inputs * 2:  # warm-up: each shape planned
            model(x)
        _without_sync(lambda: [model(x) for x in inputs for _ in range(2)])
        ops.calibrate(model, [inputs[-1]])
        for x in inputs:
            model(x)
        _without_sync(lambda: [model(x) for x in inputs])


def test_gpu_graphed_inference_replays_never_synchronize():
    """ops.graphed_inference checks the module tree before each replay without reading the GPU."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(UserMlp(), UserMlp()).to("cuda", torch.bfloat16).eval()
    ops.convert(model, fp8_weights=True)
    fast = ops.graphed_inference(model)
    x = torch.randn(1, 16, D, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        want = model(x)
        for _ in range(3):  # two warm-up calls, then the capture
            fast(x)
        out = []
        _without_sync(lambda: out.extend(fast(x) for _ in range(3)))
    assert all(torch.equal(o, want) for o in out)
