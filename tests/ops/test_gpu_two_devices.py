"""GPU tier, two GPUs in one process: a model on cuda:1 while cuda:0 is the current device.

That is how a model spread over GPUs runs (Hugging Face's device_map="auto": each layer on its own GPU,
the current device left at cuda:0). Triton launches a kernel on the current device's stream whatever
device its tensors are on, so every launch goes to its tensors' device (kernels/launch.py FastLauncher,
`on_device_of`). Before that, the first test failed on 2 H100s with Triton's "Pointer argument (at 0)
cannot be accessed from Triton (cpu tensor?)"; with peer access on, the launch would have raced with the
tensors' own stream. Each test runs the same seeded model on cuda:0 and on cuda:1 (cuda:0 current) and wants the same
bits.
"""

from __future__ import annotations

import pytest
import torch

import float8.ops as ops
from float8 import Recipe
from tests.ops.user_mlp import D, UserMlp, forced, ops_mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def _on_both(run) -> None:
    """run(device) -> list of tensors, on cuda:0 and on cuda:1 with cuda:0 current: equal bits."""
    with torch.cuda.device(0):
        want = [t.cpu() for t in run(torch.device("cuda", 0))]
        got = [t.cpu() for t in run(torch.device("cuda", 1))]
    torch.cuda.synchronize(1)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(
            g.view(torch.uint8) if g.dtype.itemsize == 1 else g, w.view(torch.uint8) if w.dtype.itemsize == 1 else w
        ), i


@pytest.mark.parametrize("name", ["tensorwise", "lean", "rowwise", "blockwise"])
def test_gpu_converted_training_step_on_another_device(name):
    recipe = {
        "tensorwise": Recipe(),
        "lean": Recipe(lean_activations=True),
        "rowwise": Recipe.rowwise(),
        "blockwise": Recipe.blockwise(),
    }[name]

    def run(dev):
        torch.manual_seed(0)
        model = ops.convert(torch.nn.Sequential(UserMlp(), UserMlp()).to(dev, torch.bfloat16), recipe=forced(recipe))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        x = torch.randn(2, 256, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        outs = []
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            y = model(x)
            y.float().square().mean().backward()
            outs += [y.detach(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
            opt.step()
            x.grad = None
        return outs + [p.detach() for p in model.parameters()]

    _on_both(run)


def test_gpu_sequential_training_step_on_another_device():
    def run(dev):
        torch.manual_seed(0)
        model = ops_mlp(forced(Recipe())).to(dev, torch.bfloat16)
        x = torch.randn(2, 256, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        y = model(x)
        y.float().square().mean().backward()
        return [y.detach(), x.grad] + [p.grad for p in model.parameters()]

    _on_both(run)


@pytest.mark.parametrize("fp8_input_from", [129, 33])
def test_gpu_fp8_weight_inference_on_another_device(fp8_input_from):
    def run(dev):
        torch.manual_seed(0)
        model = torch.nn.Sequential(UserMlp(), UserMlp()).to(dev, torch.bfloat16).eval()
        ops.convert(model, fp8_weights=True, recipe=Recipe(inference_fp8_input_from=fp8_input_from))
        with torch.inference_mode():
            # Each shape twice: the first call plans it, the second takes the plan where one applies.
            return [
                model(torch.randn(1, t, D, device=dev, dtype=torch.bfloat16)) for t in (1, 16, 64, 300) for _ in (0, 1)
            ]

    _on_both(run)


def test_gpu_block_scaled_weights_and_fused_head_on_another_device():
    """128x128 block-scaled FP8-only weights (the hub layout), and the fused linear + cross-entropy."""

    def run(dev):
        torch.manual_seed(0)
        model = torch.nn.Sequential(UserMlp()).to(dev, torch.bfloat16).eval()
        ops.convert(model, fp8_weights=True, recipe=Recipe.blockwise())
        with torch.inference_mode():
            ys = [model(torch.randn(1, t, D, device=dev, dtype=torch.bfloat16)) for t in (16, 300)]
        head = ops.LinearCrossEntropy(D, 1024, bias=False).to(dev, torch.bfloat16)
        h = torch.randn(512, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, 1024, (512,), device=dev)
        loss = head(h, target)
        loss.backward()
        return ys + [loss.detach(), h.grad, head.weight.grad]

    _on_both(run)


def test_gpu_a_model_across_two_gpus_keeps_a_workspace_per_device():
    """One converted model with a layer on each GPU, run stage by stage with each stage's device current (so
    both take prepared calls): its Linears share one kept workspace object (kernels/scratch.py), whose
    buffers are per device (stream handles repeat across devices), and the outputs are the bits of the same
    model on cuda:0 alone."""

    def build(devices):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False), torch.nn.Linear(4096, 1024, bias=False))
        for layer, dev in zip(model, devices):
            layer.to(dev, torch.bfloat16)
        return ops.convert(model, fp8_weights=True, recipe=Recipe(inference_fp8_input_from=33))

    def run(model, devices):
        outs = []
        with torch.inference_mode():
            for tokens in (16, 64, 16, 64):
                torch.manual_seed(tokens)
                h = torch.randn(tokens, 4096, dtype=torch.bfloat16).to(devices[0])
                for layer, dev in zip(model, devices):
                    with torch.cuda.device(dev):
                        h = layer(h.to(dev))
                outs.append(h.cpu())
        return outs

    split = build(["cuda:0", "cuda:1"])
    assert split[0]._inference_plans.scratch is split[1]._inference_plans.scratch
    got = run(split, ["cuda:0", "cuda:1"])
    want = run(build(["cuda:0", "cuda:0"]), ["cuda:0", "cuda:0"])
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    devices = {key[0][0] for key in split[0]._inference_plans.scratch.buffers}
    assert devices == {0, 1}, split[0]._inference_plans.scratch.buffers.keys()
