"""An in-place write into a Float8Tensor re-quantizes through the quantizer that made it (float8/tensor.py
`layout_quantizer`): its margin, power-of-2 scales and static scale are kept, where a quantizer guessed from
the scale's shape dropped them; no history is recorded and no collective is joined by the write."""

import warnings

import torch

from float8 import DelayedScaling, Float8FallbackWarning, Float8Tensor, RowwiseScaling, TensorwiseScaling
from float8.quantizer import DelayedScalingState
from tests.tolerances import assert_same_bits

BF16 = torch.bfloat16


def _new_values(shape=(32, 48)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=BF16) * 3


def _is_power_of_2(t: torch.Tensor) -> bool:
    return bool((torch.log2(t) == torch.log2(t).round()).all())


def _assert_same(a: Float8Tensor, b: Float8Tensor) -> None:
    assert_same_bits(a.fp8_data, b.fp8_data)
    assert_same_bits(a.scale_inv, b.scale_inv)


def test_copy_into_a_tensor_keeps_its_margin_and_power_of_2_scale():
    scaling = TensorwiseScaling(margin=1, power_of_2=True)
    t = Float8Tensor.quantize(torch.randn(32, 48, dtype=BF16), scaling=scaling)
    new = _new_values()
    t.copy_(new)
    assert _is_power_of_2(t.scale_inv)  # a scale guessed from the shape was fp8_max / amax, not a power of 2
    _assert_same(t, Float8Tensor.quantize(new, scaling=scaling))


def test_copy_into_a_statically_scaled_tensor_keeps_its_scale():
    t = Float8Tensor.quantize(torch.randn(32, 48, dtype=BF16), scale=0.25)
    new = _new_values()
    t.copy_(new)
    assert float(t.scale_inv) == 4.0
    _assert_same(t, Float8Tensor.quantize(new, scale=0.25))


def test_in_place_fallback_keeps_a_rowwise_margin():
    scaling = RowwiseScaling(margin=2, power_of_2=True)
    x = torch.randn(32, 48, dtype=BF16)
    t = Float8Tensor.quantize(x, scaling=scaling)
    expected = Float8Tensor.quantize(t.dequantize() * 0.5, scaling=scaling)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Float8FallbackWarning)
        t.mul_(0.5)
    _assert_same(t, expected)


def test_detach_clone_and_dtype_moves_carry_the_quantizer_a_parameter_too():
    scaling = TensorwiseScaling(margin=1, power_of_2=True)
    t = Float8Tensor.quantize(torch.randn(32, 48, dtype=BF16), scaling=scaling)
    new = _new_values()
    for derived in (t.detach(), t.clone(), t.to(torch.float32), torch.nn.Parameter(t, requires_grad=False)):
        with torch.no_grad():
            derived.copy_(new.to(derived.dtype))
        assert _is_power_of_2(derived.scale_inv)
    # A module's state dict loads into an FP8 parameter through copy_: the settings survive it.
    lin = torch.nn.Linear(48, 32, bias=False)
    lin.weight = torch.nn.Parameter(t.clone(), requires_grad=False)
    lin.load_state_dict({"weight": new})
    assert _is_power_of_2(lin.weight.scale_inv)
    _assert_same(lin.weight, Float8Tensor.quantize(new, scaling=scaling))


def test_a_delayed_tensor_is_rewritten_with_current_scaling_leaving_the_history_alone():
    state = DelayedScalingState(DelayedScaling(history_len=4, margin=1))
    t = Float8Tensor.quantize(torch.randn(32, 48, dtype=BF16), scaling=state)
    history = state.amax_history.clone()
    new = _new_values()
    t.copy_(new)
    assert_same_bits(state.amax_history, history)  # an in-place write is not a step of the recipe
    _assert_same(t, Float8Tensor.quantize(new, scaling=TensorwiseScaling(margin=1)))
