"""ops.requantize_weights: the FP8 weights of the next forward, written after the optimizer step.

A model trained with it must follow the same trajectory, bit for bit, as its twin that quantizes lazily in
each forward; its copies are consumed by the training forward (nothing FP8 outlives the step) and never
read once the weight changed.
"""

import copy

import pytest
import torch

import float8.ops as ops
from float8 import DelayedScaling, Float8Tensor, Recipe, RowwiseScaling, memory_footprint
from float8.ops.functional import quantize_weight

from ..kernels.helpers import assert_bits


class Net(torch.nn.Module):
    """A Sequential and a lone Linear, as a converted model mixes them."""

    def __init__(self, recipe=None, dims=(32, 64, 48, 16)):
        super().__init__()
        a, b, c, d = dims
        self.seq = ops.Sequential(ops.Linear(a, b, bias=False), ops.GELU(), ops.Linear(b, c, bias=True), recipe=recipe)
        self.head = ops.Linear(c, d, bias=False, recipe=recipe)
        self.to(torch.bfloat16)

    def forward(self, x):
        return self.head(self.seq(x))


def _linears(m):
    return [op for op in m.modules() if isinstance(op, ops.Linear)]


def _train(model, steps, requantize, device="cpu", d_in=32):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator(device=device).manual_seed(0)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, d_in, generator=g, device=device).to(torch.bfloat16)
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if requantize:
            assert ops.requantize_weights(model) == 3
            assert all(op.cached_fp8_tensors() for op in _linears(model))
    return losses


@pytest.mark.parametrize(
    "recipe",
    [
        None,
        Recipe(weight=DelayedScaling()),
        Recipe(input=RowwiseScaling(), weight=RowwiseScaling(), grad=RowwiseScaling()),
    ],
    ids=["tensorwise", "delayed-weight", "rowwise"],
)
def test_training_matches_lazy_quantization(recipe):
    torch.manual_seed(0)
    lazy = Net(recipe)
    eager = copy.deepcopy(lazy)
    assert _train(lazy, 4, requantize=False) == _train(eager, 4, requantize=True)
    for a, b in zip(lazy.parameters(), eager.parameters()):
        assert torch.equal(a, b)


def test_copies_are_the_forward_copies_and_are_consumed():
    torch.manual_seed(0)
    model = Net()
    _train(model, 1, requantize=True)
    for op in _linears(model):
        # No transpose: under per-tensor current scaling the backward quantizes a trained weight again.
        assert op._weight_cache.lookup(op.weight, for_backward=True) is None
        w8, wd = op._weight_cache.lookup(op.weight, for_backward=False)
        ref, _ = quantize_weight(op.weight, op.weight_quantizer, False)
        assert_bits(w8.fp8_data, ref.fp8_data, "data")
        assert_bits(w8.scale_inv, ref.scale_inv, "scale_inv")
        assert w8.transpose_cache is None and wd is None
    # The training forward takes them: nothing FP8 is held after the step.
    model(torch.randn(2, 32, dtype=torch.bfloat16)).float().sum().backward()
    assert all(op.cached_fp8_tensors() == [] for op in _linears(model))


def test_bytes_are_counted_and_freed():
    torch.manual_seed(0)
    model = Net()
    base = memory_footprint(model)
    ops.requantize_weights(model)
    params = sum(op.weight.numel() for op in _linears(model))
    held = memory_footprint(model) - base
    # The data, 1 byte per parameter (no transpose: the backward quantizes the weight again), and three
    # scale-inverses of 4 bytes (one storage).
    assert held == params + 3 * 4
    model(torch.randn(2, 32, dtype=torch.bfloat16)).float().sum().backward()
    assert memory_footprint(model) == base


def test_stale_copy_is_never_read():
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    ops.requantize_weights(model)
    with torch.no_grad():  # the weights change after the re-quantize (a second optimizer, a manual edit)
        for m in (model, twin):
            for op in _linears(m):
                op.weight.mul_(-3.0)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.equal(model(x), twin(x))


def test_frozen_weights_get_no_transpose_and_stay_cached():
    torch.manual_seed(0)
    model = Net()
    for p in model.parameters():
        p.requires_grad_(False)
    assert ops.requantize_weights(model) == 3
    for op in _linears(model):
        (w8,) = op.cached_fp8_tensors()
        assert w8.transpose_cache is None
    with torch.inference_mode():
        first = [op.cached_fp8_tensors()[0] for op in _linears(model)]
        model(torch.randn(2, 32, dtype=torch.bfloat16))
        assert [op.cached_fp8_tensors()[0] for op in _linears(model)] == first  # read, and kept


def test_fp8_only_and_meta_weights_are_left_alone():
    model = Net()
    head = model.head
    head.weight = torch.nn.Parameter(Float8Tensor.quantize(head.weight.detach()), requires_grad=False)
    with torch.device("meta"):
        meta = ops.Linear(16, 16, dtype=torch.bfloat16)
    model.add_module("meta", meta)
    assert ops.requantize_weights(model) == 2
    assert head.cached_fp8_tensors() == [] and meta.cached_fp8_tensors() == []


def test_bad_input():
    with pytest.raises(TypeError, match="nn.Module"):
        ops.requantize_weights([ops.Linear(16, 16)])


@pytest.mark.gpu
def test_gpu_training_matches_lazy_quantization():
    # On the GPU the fused kernel writes the copies; the trajectory must still be the lazy one, bit for bit.
    recipe = Recipe(min_fp8_gemm_flops=0)
    torch.manual_seed(0)
    with torch.device("cuda"):
        lazy = Net(recipe, dims=(128, 256, 128, 64))
    eager = copy.deepcopy(lazy)
    assert _train(lazy, 4, False, "cuda", 128) == _train(eager, 4, True, "cuda", 128)
    for a, b in zip(lazy.parameters(), eager.parameters()):
        assert torch.equal(a, b)


def test_a_trained_weight_whose_backward_reads_the_forwards_transpose_gets_it():
    """Delayed weight scaling keeps its FP8 transpose from the forward to the backward: requantize_weights
    writes it, and the training forward takes both copies."""
    torch.manual_seed(0)
    model = Net(Recipe(weight=DelayedScaling()))
    ops.requantize_weights(model)
    for op in _linears(model):
        w8, wd = op._weight_cache.lookup(op.weight, for_backward=True)
        assert wd is not None
