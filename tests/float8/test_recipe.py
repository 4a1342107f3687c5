"""Recipes are frozen and validated; delayed scaling keeps its state on the device, with no host sync."""

import dataclasses
import math

import pytest
import torch

from float8 import (
    DelayedScaling,
    DelayedScalingState,
    Float8Tensor,
    Format,
    Recipe,
    RowwiseScaling,
    TensorwiseScaling,
)
from float8.kernels.reference import scale_from_amax
from tests.tolerances import assert_same_bits

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_formats():
    assert Format.HYBRID.forward_dtype == E4M3 and Format.HYBRID.backward_dtype == E5M2
    assert Format.E4M3.backward_dtype == E4M3 and Format.E5M2.forward_dtype == E5M2


def test_recipes_are_frozen_and_validated():
    r = Recipe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.format = Format.E4M3
    with pytest.raises(TypeError, match="Recipe.weight"):
        Recipe(weight="tensorwise")
    with pytest.raises(TypeError, match="format"):
        Recipe(format="hybrid")
    assert isinstance(Recipe.rowwise().input, RowwiseScaling)
    assert Recipe.blockwise().weight.block == (128, 128)
    assert isinstance(Recipe.delayed().grad, DelayedScaling)
    with pytest.raises(ValueError, match="history_len"):
        DelayedScaling(history_len=0)


def test_delayed_scaling_uses_the_previous_scale_and_records_amax():
    state = DelayedScalingState(DelayedScaling(history_len=3, amax_compute_algo="max"))
    x1, x2, x3 = torch.randn(8, 8) * 2, torch.randn(8, 8) * 10, torch.randn(8, 8) * 0.5
    q1 = Float8Tensor.quantize(x1, scaling=state)
    # First step, empty history: current scaling (not scale 1), and its amax is recorded.
    first = 1 / scale_from_amax(x1.abs().amax(), E4M3)
    assert_same_bits(q1.scale_inv, first)
    assert_same_bits(q1.fp8_data, Float8Tensor.quantize(x1).fp8_data)
    assert state.amax_history[0] == x1.abs().amax()
    q2 = Float8Tensor.quantize(x2, scaling=state)
    assert_same_bits(q2.scale_inv, 1 / scale_from_amax(x1.abs().amax(), E4M3))
    q3 = Float8Tensor.quantize(x3, scaling=state)
    # "max" over the history: x2's amax still rules at step 3
    assert_same_bits(q3.scale_inv, 1 / scale_from_amax(x2.abs().amax(), E4M3))
    # The scale belongs to the data: updating the state changed no existing tensor.
    assert_same_bits(q1.scale_inv, first)
    assert torch.equal(state.amax_history, torch.stack([x3, x2, x1]).abs().amax(dim=(1, 2)))


def test_delayed_most_recent_and_nonfinite_amax_keeps_the_scale():
    state = DelayedScalingState(DelayedScaling(history_len=4, amax_compute_algo="most_recent"))
    Float8Tensor.quantize(torch.full((4, 4), 10.0), scaling=state)
    good = state.scale.clone()
    assert_same_bits(good, scale_from_amax(torch.tensor(10.0), E4M3))
    history = state.amax_history.clone()
    for poison in (math.nan, math.inf, -math.inf):
        bad = torch.full((4, 4), 1.0)
        bad[0, 0] = poison
        q = Float8Tensor.quantize(bad, scaling=state)
        assert_same_bits(state.scale, good)  # a non-finite amax is not recorded: the previous scale stays
        assert_same_bits(state.amax_history, history)
        assert q.dequantize().isnan().all()  # and the tensor of that step is not finite
    Float8Tensor.quantize(torch.full((4, 4), 2.0), scaling=state)
    assert_same_bits(state.scale, scale_from_amax(torch.tensor(2.0), E4M3))


def test_delayed_state_is_a_module_with_buffers():
    state = DelayedScalingState(DelayedScaling(history_len=5))
    assert set(state.state_dict()) == {"amax_history", "scale", "_extra_state"}
    assert state.amax_history.shape == (5,)


def test_delayed_record_compiles_without_graph_breaks():
    # fullgraph=True fails on any .item() or data-dependent branch: recording an amax is device-only.
    state = DelayedScalingState(DelayedScaling(history_len=4))
    state.bind(E4M3)
    torch._dynamo.reset()
    step = torch.compile(lambda amax: state.record(amax), backend="eager", fullgraph=True)
    step(torch.tensor(3.0))
    assert state.amax_history[0] == 3.0


def test_delayed_with_transpose():
    state = DelayedScalingState(DelayedScaling())
    q = Float8Tensor.quantize(torch.randn(16, 32), scaling=state, with_transpose=True)
    assert_same_bits(q.transpose_cache, q.fp8_data.t())
    assert state.amax_history[0] > 0


def test_static_scale():
    x = torch.randn(16, 32)
    q = Float8Tensor.quantize(x, scale=4.0)
    assert q.scale_inv.item() == 0.25
    assert_same_bits(q.fp8_data, Float8Tensor.quantize(x, scale=torch.tensor(4.0)).fp8_data)
    assert TensorwiseScaling().margin == 0
