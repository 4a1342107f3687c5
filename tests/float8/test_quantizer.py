"""Quantizers (float8/quantizer.py): one object per scaling kind answers quantize, the fused-kernel request,
the operand layout and the amax bookkeeping; recipes build them; Float8Tensor.quantize goes through them."""

import os
import socket

import pytest
import torch
import torch.distributed as dist

from float8 import (
    BlockwiseQuantizer,
    BlockwiseScaling,
    DelayedScaling,
    DelayedScalingState,
    Float8Tensor,
    Recipe,
    RowwiseQuantizer,
    RowwiseScaling,
    ScaleLayout,
    StaticQuantizer,
    TensorwiseQuantizer,
    TensorwiseScaling,
)
from float8.kernels import quantize_tensorwise
from float8.kernels.reference import scale_from_amax
from float8.quantizer import QuantRequest
from tests.tolerances import assert_same_bits

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def same(a: Float8Tensor, b: Float8Tensor) -> None:
    assert_same_bits(a.fp8_data, b.fp8_data)
    assert_same_bits(a.scale_inv, b.scale_inv)


@pytest.mark.parametrize(
    "quantizer, scaling",
    [
        (TensorwiseQuantizer(E5M2, margin=2, power_of_2=True), TensorwiseScaling(2, True)),
        (RowwiseQuantizer(E4M3), RowwiseScaling()),
        (BlockwiseQuantizer(E4M3, block=(1, 128)), BlockwiseScaling((1, 128))),
        (BlockwiseQuantizer(E4M3, block=(128, 128)), BlockwiseScaling((128, 128))),
    ],
    ids=["tensor", "row", "1x128", "128x128"],
)
def test_float8_tensor_quantize_goes_through_the_quantizer(quantizer, scaling):
    x = torch.randn(256, 384) * 3
    same(quantizer.quantize(x), Float8Tensor.quantize(x, quantizer.fp8_dtype, scaling=scaling))
    same(quantizer.quantize(x), Float8Tensor.quantize(x, scaling=quantizer))


def test_layouts_and_fusion_answers():
    assert TensorwiseQuantizer().layout is ScaleLayout.TENSOR and TensorwiseQuantizer().fuses
    assert TensorwiseQuantizer().kernel_scale() is None  # the kernel computes the amax
    assert RowwiseQuantizer().layout is ScaleLayout.ROW and not RowwiseQuantizer().fuses
    assert BlockwiseQuantizer().layout is ScaleLayout.BLOCK and not BlockwiseQuantizer().fuses
    static = StaticQuantizer(4.0)
    assert static.fuses and float(static.kernel_scale()) == 4.0


def test_recipe_builds_the_quantizers_of_each_role():
    q = Recipe().quantizers()
    assert isinstance(q.input, TensorwiseQuantizer) and q.input.fp8_dtype == E4M3
    assert q.grad.fp8_dtype == E5M2  # HYBRID: gradients in E5M2
    d = Recipe.delayed().quantizers()
    assert all(isinstance(s, DelayedScalingState) for s in d)
    assert len({id(s) for s in d}) == 3  # one history per role
    r = Recipe.rowwise().quantizers()
    assert all(s.layout is ScaleLayout.ROW for s in r)


def test_kernel_request_round_trip_equals_quantize():
    x = torch.randn(64, 48)
    req = QuantRequest(TensorwiseQuantizer(E4M3), with_transpose=True)
    data, data_t, scale_inv, amax = quantize_tensorwise(
        x, req.fp8_dtype, req.kernel_scale(), req.margin, req.power_of_2, True
    )
    t = req.finish(data, data_t, scale_inv, amax, x.dtype)
    same(t, TensorwiseQuantizer(E4M3).quantize(x))
    assert_same_bits(t.transpose_cache, t.fp8_data.t())


def test_straight_through_gradients():
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    x8, w8 = Float8Tensor.quantize(x), Float8Tensor.quantize(w)
    assert x8.requires_grad and w8.requires_grad
    y = x8 @ w8.t()  # an FP8 GEMM, differentiable
    dy = torch.randn_like(y)
    y.backward(dy)
    # Quantization passes the gradient as identity: the gradients of the dequantized product.
    xd, wd = x8.detach().dequantize(), w8.detach().dequantize()
    assert torch.allclose(x.grad, dy @ wd, rtol=1e-5, atol=1e-5)
    assert torch.allclose(w.grad, dy.t() @ xd, rtol=1e-5, atol=1e-5)
    z = torch.randn(8, 8, requires_grad=True)
    Float8Tensor.quantize(z).dequantize().sum().backward()
    assert torch.equal(z.grad, torch.ones_like(z))


def test_delayed_state_binds_one_format():
    state = DelayedScalingState(DelayedScaling())
    Float8Tensor.quantize(torch.randn(8, 8), E5M2, scaling=state)
    with pytest.raises(ValueError, match="one state per format"):
        Float8Tensor.quantize(torch.randn(8, 8), E4M3, scaling=state)
    with pytest.raises(ValueError, match="one state per format"):
        DelayedScalingState(fp8_dtype=E4M3).bind(E5M2)


def test_margin_that_rounds_everything_to_zero_is_refused():
    with pytest.raises(ValueError, match="largest margin for this format is 17"):
        TensorwiseQuantizer(E4M3, margin=19)
    with pytest.raises(ValueError, match="largest margin"):
        Float8Tensor.quantize(torch.randn(4, 4), scaling=TensorwiseScaling(margin=19))
    with pytest.raises(ValueError, match="too large"):
        Recipe(input=TensorwiseScaling(margin=19))
    TensorwiseQuantizer(E5M2, margin=31)  # E5M2 has the range for it
    x = torch.randn(16, 16)
    assert TensorwiseQuantizer(E4M3, margin=17, power_of_2=True).quantize(x).fp8_data.float().abs().max() > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def single_process_group():
    """A one-rank gloo group: the amax reduction group has to exist and work with it here; the
    distributed tests exercise more ranks."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_amax_group_with_one_rank_gives_the_same_bits(single_process_group):
    g = single_process_group
    x = torch.randn(64, 96) * 5
    grouped = TensorwiseQuantizer(E4M3, amax_group=g)
    assert not grouped.fuses  # the amax is reduced before the cast: kernels write high precision first
    same(grouped.quantize(x, with_transpose=True), TensorwiseQuantizer(E4M3).quantize(x, with_transpose=True))
    a, b = DelayedScalingState(DelayedScaling(), amax_group=g), DelayedScalingState(DelayedScaling())
    for step in range(3):
        xs = torch.randn(32, 32) * (step + 1)
        same(Float8Tensor.quantize(xs, scaling=a), Float8Tensor.quantize(xs, scaling=b))
    assert_same_bits(a.scale, b.scale)
    with pytest.raises(TypeError, match="ProcessGroup"):
        TensorwiseQuantizer(amax_group="world")


def test_delayed_checkpoint_loads_strictly_into_a_fresh_state_and_resumes():
    a = DelayedScalingState(DelayedScaling(history_len=4), fp8_dtype=E4M3)
    for s in (3.0, 7.0):
        Float8Tensor.quantize(torch.randn(16, 16) * s, scaling=a)
    b = DelayedScalingState(DelayedScaling(history_len=4), fp8_dtype=E4M3)
    b.load_state_dict(a.state_dict(), strict=True)
    x = torch.randn(16, 16)
    same(Float8Tensor.quantize(x, scaling=a), Float8Tensor.quantize(x, scaling=b))
    assert_same_bits(a.scale, b.scale)


@pytest.mark.parametrize(
    "saved_len, new_len", [(16, 1024), (8, 3)], ids=["old default into 1024", "longer into shorter"]
)
def test_delayed_checkpoint_of_another_history_length_loads(saved_len, new_len):
    # The default history went from 16 to 1024 steps: a checkpoint of the old default must still load
    # strictly, keeping its newest amaxes, and give the scale the saved window would give from there on.
    a = DelayedScalingState(DelayedScaling(history_len=saved_len), fp8_dtype=E4M3)
    for s in (3.0, 7.0, 1.0, 2.0):
        Float8Tensor.quantize(torch.randn(16, 16) * s, scaling=a)
    b = DelayedScalingState(DelayedScaling(history_len=new_len), fp8_dtype=E4M3)
    b.load_state_dict(a.state_dict(), strict=True)
    n = min(saved_len, new_len)
    assert b.amax_history.shape == (new_len,)
    assert_same_bits(b.amax_history[:n], a.amax_history[:n])
    assert (b.amax_history[n:] == 0).all()
    assert_same_bits(b.scale, a.scale)  # the step after loading casts with the saved scale
    x = torch.randn(16, 16) * 5
    same(Float8Tensor.quantize(x, scaling=a), Float8Tensor.quantize(x, scaling=b))


def test_delayed_first_step_is_current_scaling():
    state = DelayedScalingState(DelayedScaling())
    g = torch.randn(64, 64) * 1e-3  # a gradient far below 448: scale 1 would flush most of it to 0
    same(Float8Tensor.quantize(g, E5M2, scaling=state), Float8Tensor.quantize(g, E5M2))
    assert_same_bits(state.scale, scale_from_amax(g.abs().amax(), E5M2))


def test_delayed_first_step_non_finite_then_no_silent_saturation():
    state = DelayedScalingState(DelayedScaling())
    x = torch.randn(16, 16)
    x[0, 0] = float("inf")  # e.g. an fp16 gradient overflowing on the first step
    assert Float8Tensor.quantize(x, scaling=state).dequantize().isnan().all()
    big = torch.randn(16, 16) * 1000
    second = Float8Tensor.quantize(big, scaling=state)  # no finite amax yet: loudly NaN, never saturated
    assert second.dequantize().isnan().all()
    third = Float8Tensor.quantize(big, scaling=state)  # the second step's amax was recorded
    assert_same_bits(third.fp8_data, Float8Tensor.quantize(big).fp8_data)


def test_delayed_all_zero_history_resumes_identically():
    a = DelayedScalingState(DelayedScaling(), fp8_dtype=E4M3)
    Float8Tensor.quantize(torch.zeros(16, 16), scaling=a)
    b = DelayedScalingState(DelayedScaling(), fp8_dtype=E4M3)
    b.load_state_dict(a.state_dict())
    x = torch.randn(16, 16)
    same(Float8Tensor.quantize(x, scaling=a), Float8Tensor.quantize(x, scaling=b))


def test_delayed_checkpoint_of_another_format_is_refused():
    a = DelayedScalingState(DelayedScaling(), fp8_dtype=E5M2)
    Float8Tensor.quantize(torch.randn(8, 8), E5M2, scaling=a)
    with pytest.raises(ValueError, match="made for torch.float8_e5m2"):
        DelayedScalingState(DelayedScaling(), fp8_dtype=E4M3).load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    "field, value",
    [
        ("scale", float("inf")),
        ("scale", float("nan")),
        ("scale", 0.0),
        ("scale", -2.0),
        ("scale", 1e-45),
        ("amax_history", float("inf")),
        ("amax_history", -1.0),
        ("amax_history", float("nan")),
    ],
)
def test_a_tampered_delayed_checkpoint_is_refused(field, value):
    """A scale of inf, NaN (after a recorded step), <= 0 or out of range, or a history entry no run writes,
    used to load and make every later output finite and wrong (89% off, issue 23). Refused on load now; on
    a GPU the scale becomes NaN instead (checked on the device, no host sync)."""
    a = DelayedScalingState(DelayedScaling(history_len=4), fp8_dtype=E4M3)
    Float8Tensor.quantize(torch.randn(16, 16) * 3, scaling=a)
    state = a.state_dict()
    state[field] = state[field].clone()
    state[field].view(-1)[0] = value
    b = DelayedScalingState(DelayedScaling(history_len=4), fp8_dtype=E4M3)
    with pytest.raises(ValueError, match=field):
        b.load_state_dict(state)


def test_a_poisoned_delayed_state_on_the_device_path_makes_outputs_nan():
    """Tensors not on the CPU are checked on the device (the meta device stands in here for a GPU): the scale
    is replaced by NaN, never loaded as it is."""
    from float8.quantizer import _check_delayed_state

    state = {"s.amax_history": torch.tensor([3.0, 0.0], device="meta"), "s.scale": torch.tensor(-2.0, device="meta")}
    _check_delayed_state(state, "s.")
    assert state["s.scale"].device.type == "meta"  # rebuilt with torch.where, not read on the host


def test_a_delayed_state_with_no_finite_amax_yet_still_loads():
    a = DelayedScalingState(DelayedScaling(), fp8_dtype=E4M3)
    x = torch.randn(16, 16)
    x[0, 0] = float("inf")
    Float8Tensor.quantize(x, scaling=a)  # recorded a step, no finite amax: scale NaN, "no scale yet"
    b = DelayedScalingState(DelayedScaling(), fp8_dtype=E4M3)
    b.load_state_dict(a.state_dict())
    assert b.scale.isnan() and b.has_history


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_delayed_state_is_never_rounded_by_a_model_cast(dtype):
    state = DelayedScalingState(DelayedScaling(), fp8_dtype=E4M3)
    Float8Tensor.quantize(torch.randn(8, 8) * 1e-3, scaling=state)  # scale ~1e5: inf in fp16
    before = state.scale.clone(), state.amax_history.clone()
    state.to(dtype)
    assert_same_bits(state.scale, before[0])
    assert_same_bits(state.amax_history, before[1])


@pytest.mark.filterwarnings("ignore::float8.ops.Float8PrecisionWarning")
def test_delayed_state_reset_after_meta_construction():
    import float8.ops as ops

    lin = ops.Linear(32, 32, recipe=Recipe.delayed(), device="meta")
    lin.to_empty(device="cpu")
    lin.reset_parameters()
    x = torch.randn(4, 32)
    ref = ops.Linear(32, 32, recipe=Recipe.delayed())
    ref.load_state_dict({"weight": lin.weight, "bias": lin.bias}, strict=False)
    assert_same_bits(lin(x), ref(x))  # both a first step: current scaling, no leftover memory read


def test_nan_amax_survives_the_group_reduction(single_process_group):
    # A MAX all-reduce may drop a NaN depending on rank order; the quantizer sends inf instead.
    from float8.quantizer import all_reduce_amax

    amax = torch.tensor(float("nan"))
    assert all_reduce_amax(amax, single_process_group).isinf()
    x = torch.randn(8, 8)
    x[1, 1] = float("nan")
    assert TensorwiseQuantizer(amax_group=single_process_group).quantize(x).dequantize().isnan().all()


def test_e5m2_largest_margin_keeps_values():
    x = torch.randn(16, 16)
    t = TensorwiseQuantizer(E5M2, margin=31, power_of_2=True).quantize(x)
    assert t.fp8_data.float().abs().max() > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_static_scale_poisons_a_non_finite_tensor_and_keeps_a_finite_ones_scale(device, bad):
    """A given scale saturates inf to fp8_max in the cast: scale_inv must then be NaN (the tensor contract),
    and for a finite tensor exactly 1 / scale, bit for bit."""
    x = torch.randn(32, 16, device=device)
    if bad is not None:
        x[3, 5] = bad
    t = StaticQuantizer(torch.tensor(4.0, device=device)).quantize(x)
    if bad is None:
        assert t.scale_inv.item() == 0.25 and torch.isfinite(t.dequantize()).all()
    else:
        assert t.scale_inv.isnan().item() and t.dequantize().isnan().all()
