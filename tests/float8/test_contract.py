"""The non-finite contract and the silent wrong results that were found (F1-F7), one regression test each.

A non-finite input never comes out finite (docs/design.md, "The tensor contract"); every write keeps the
cached transpose in step or drops it; a replaced weight storage is never served from the cache.
"""

import math

import pytest
import torch

import float8.ops as ops
from float8 import DelayedScaling, DelayedScalingState, Float8Tensor, Recipe, RowwiseScaling, TensorwiseScaling
from float8.kernels.reference import FLOAT32_MAX
from tests.tolerances import assert_same_bits

pytestmark = pytest.mark.filterwarnings("ignore::float8.ops.Float8PrecisionWarning")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ---- non-finite values stay non-finite --------------------------------------------------------------
@pytest.mark.parametrize("poison", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_current_scaling_of_a_non_finite_tensor_is_not_finite(poison, fp8):
    x = torch.randn(32, 32)
    x[3, 4] = poison
    t = Float8Tensor.quantize(x, fp8, with_transpose=True)
    assert not t.dequantize().isfinite().any()
    w = Float8Tensor.quantize(torch.randn(16, 32), E4M3)
    assert not (t @ w.t()).isfinite().any()  # every GEMM output that reads it
    assert not (w @ t.t()).isfinite().any()


@pytest.mark.parametrize("poison", [math.inf, math.nan])
def test_given_scales_mark_a_non_finite_tensor(poison):
    x = torch.randn(16, 16)
    x[0, 0] = poison
    static = Float8Tensor.quantize(x, scale=2.0)
    assert static.scale_inv.isnan() and not static.dequantize().isfinite().any()
    state = DelayedScalingState(DelayedScaling())
    Float8Tensor.quantize(torch.randn(16, 16), scaling=state)
    scale, history = state.scale.clone(), state.amax_history.clone()
    delayed = Float8Tensor.quantize(x, scaling=state)
    assert not delayed.dequantize().isfinite().any()
    assert_same_bits(state.scale, scale)  # never recorded ...
    assert_same_bits(state.amax_history, history)
    ok = Float8Tensor.quantize(torch.randn(16, 16), scaling=state)  # ... and the next finite step recovers
    assert ok.dequantize().isfinite().all()


def test_rowwise_poisons_only_the_rows_that_hold_non_finite_values():
    x = torch.randn(8, 32)
    x[2, 5] = math.inf
    d = Float8Tensor.quantize(x, scaling=RowwiseScaling()).dequantize()
    assert not d[2].isfinite().any()
    assert d[torch.arange(8) != 2].isfinite().all()


def test_an_overflowing_fp16_gradient_reaches_the_weights_as_non_finite():
    lin = ops.Linear(32, 16, bias=False)
    x = torch.randn(8, 32, requires_grad=True)
    dy = torch.full((8, 16), 6e4, dtype=torch.float32)
    dy[0, 0] = math.inf  # an fp16 overflow upstream
    lin(x).backward(dy)
    assert not lin.weight.grad.isfinite().all() and not x.grad.isfinite().all()


# ---- F1: writes keep the transpose in step, or drop it --------------------------------------------
def _fresh():
    return Float8Tensor.quantize(torch.randn(16, 16), with_transpose=True)


def _check_in_step(x8):
    t = x8.transpose_cache
    if t is not None:
        assert_same_bits(t, x8.fp8_data.t().contiguous())
    b = Float8Tensor.quantize(torch.randn(32, 16))
    # b @ x8 reads x8 column-major: its transpose cache, when it has one. The reference has none.
    plain = Float8Tensor(x8.fp8_data.clone(), x8.scale_inv.clone(), x8.dtype)
    assert_same_bits(b @ x8, b @ plain)
    assert_same_bits(x8.t() @ b.t(), plain.t() @ b.t())


def test_f1_check_can_fail():
    x8 = _fresh()
    x8._t_stamp = None  # switch the staleness check off: the write below must then be caught by the test
    x8.fp8_data.view(torch.uint8)[0].fill_(0x38)
    with pytest.raises(AssertionError):
        _check_in_step(x8)


def test_f1_write_through_a_whole_view():
    x8 = _fresh()
    with pytest.warns(Warning, match="add_"):
        x8.view(-1).add_(1)
    _check_in_step(x8)


def test_f1_copy_from_own_transpose():
    x8 = _fresh()
    before = x8.fp8_data.clone()
    x8.copy_(x8.t())
    assert_same_bits(x8.fp8_data, before.t().contiguous())
    _check_in_step(x8)


def test_f1_write_into_the_bits():
    x8 = _fresh()
    x8.fp8_data.view(torch.uint8)[0].fill_(0x38)
    _check_in_step(x8)
    y8 = _fresh()
    y8.t().fp8_data.view(torch.uint8)[:, 1].fill_(0x38)  # the cache itself, through the transposed view
    _check_in_step(y8)


@pytest.mark.parametrize(
    "view",
    [
        lambda t: t.detach(),
        lambda t: t.view(16, 16),
        lambda t: t.view(-1),
        lambda t: t[:],
        lambda t: t[0:8],
        lambda t: t.unsqueeze(0),
        lambda t: t.t().t(),
    ],
    ids=["detach", "view", "flat", "all", "rows", "unsqueeze", "tt"],
)
def test_f1_raw_write_into_the_bits_of_a_view(view):
    x8 = _fresh()
    view(x8).fp8_data.view(torch.uint8).fill_(0x38)
    _check_in_step(x8)


def test_f1_fp8_weight_parameter_written_through_its_source():
    import float8.ops as ops

    w8 = _fresh()
    lin = ops.Linear(16, 16, bias=False)
    lin.weight = torch.nn.Parameter(w8, requires_grad=False)  # a Parameter of a Float8Tensor is its detach()
    w8.fp8_data.copy_(Float8Tensor.quantize(torch.randn(16, 16), scale=w8.scale_inv.reciprocal()).fp8_data)
    x = torch.randn(4, 16, requires_grad=True)
    lin(x).sum().backward()
    plain = Float8Tensor(w8.fp8_data.clone(), w8.scale_inv.clone(), w8.dtype)
    expected = torch.ones(4, 16) @ plain.dequantize()
    assert torch.allclose(x.grad, expected, rtol=1e-2, atol=1e-2)


def test_f1_in_place_on_the_transposed_view_keeps_both_sides_right():
    x8 = _fresh()
    with pytest.warns(Warning, match="mul_"):
        x8.t().mul_(2)
    _check_in_step(x8)


# ---- F3: a replaced weight storage is never served from the cache ---------------------------------
def test_f3_replaced_weight_data_at_a_reused_address():
    lin = ops.Linear(32, 32, bias=False)
    x = torch.randn(4, 32)
    lin(x)
    for _ in range(20):  # the allocator hands freed blocks back: new storage, often the same address
        new = torch.randn(32, 32)
        lin.weight.data = new
        expected = Float8Tensor.quantize(x) @ Float8Tensor.quantize(new).t()
        assert_same_bits(lin(x), expected)


def test_f3_replaced_weight_data_in_the_same_storage():
    buf = torch.randn(2, 32, 32)
    lin = ops.Linear(32, 32, bias=False)
    x = torch.randn(4, 32)
    lin.weight.data = buf[0]
    y0 = lin(x)
    lin.weight.data = buf[1]
    assert_same_bits(lin(x), Float8Tensor.quantize(x) @ Float8Tensor.quantize(buf[1]).t())
    assert not torch.equal(lin(x), y0)


def test_weight_cache_is_not_pickled():
    import pickle

    lin = ops.Linear(32, 32, recipe=Recipe.delayed())
    lin(torch.randn(4, 32))
    copy = pickle.loads(pickle.dumps(lin))
    assert copy._weight_cache.w8 is None
    assert_same_bits(copy(torch.ones(2, 32)), lin(torch.ones(2, 32)))


# ---- F4: addmm with beta=0 ignores its input ------------------------------------------------------
def test_f4_addmm_beta_zero_ignores_the_input():
    a8, b8 = Float8Tensor.quantize(torch.randn(16, 32)), Float8Tensor.quantize(torch.randn(32, 16))
    inp = torch.full((16, 16), math.inf)
    out = torch.addmm(inp, a8, b8, beta=0)
    assert_same_bits(out, a8 @ b8)
    assert_same_bits(torch.addmm(inp, a8, b8, beta=0, alpha=2), 2 * (a8 @ b8))


def test_rowwise_gemm_near_float32_max_does_not_overflow():
    x = torch.full((16, 32), 3e38)
    x[1:] = torch.randn(15, 32)
    w = torch.full((16, 32), 1e-37)
    a, b = Float8Tensor.quantize(x, scaling=RowwiseScaling()), Float8Tensor.quantize(w, scaling=RowwiseScaling())
    out = a @ b.t()
    assert out.isfinite().all()
    exact = a.dequantize().double() @ b.dequantize().double().t()
    assert torch.allclose(out.double(), exact, rtol=1e-3)


# ---- F5: bad static scales -------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, 1e-45, 1e39])
def test_f5_bad_static_scale_numbers(bad):
    with pytest.raises(ValueError, match="finite positive float32"):
        Float8Tensor.quantize(torch.randn(4, 4), scale=bad)


@pytest.mark.parametrize("bad", [0.0, math.inf, math.nan, 1e-40])
def test_f5_bad_static_scale_tensors(bad):
    with pytest.raises(ValueError, match="finite positive float32"):
        Float8Tensor.quantize(torch.randn(4, 4), scale=torch.tensor(bad))


def test_f5_huge_python_numbers_and_later_writes():
    with pytest.raises(ValueError, match="finite positive float32"):
        Float8Tensor.quantize(torch.randn(4, 4), scale=10**400)
    from float8 import StaticQuantizer

    s = torch.tensor(2.0)
    q = StaticQuantizer(s)
    s.zero_()  # the quantizer validated and kept its own copy
    assert float(q.quantize(torch.ones(2, 2)).scale_inv) == 0.5


def test_f5_device_scales_are_not_read_on_the_host():
    # The no-sync path (a CUDA tensor, or any tensor under torch.compile): an invalid scale poisons.
    compiled = torch.compile(
        lambda x, s: Float8Tensor.quantize(x, scale=s).dequantize(), backend="aot_eager", fullgraph=True
    )
    x = torch.randn(8, 8)
    assert_same_bits(compiled(x, torch.tensor(4.0)), Float8Tensor.quantize(x, scale=4.0).dequantize())
    assert compiled(x, torch.tensor(0.0)).isnan().all()


# ---- F6 is in test_quantizer.py (margins); F7: finite values near float32 max ---------------------
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_f7_finite_input_near_float32_max_dequantizes_finite(fp8):
    x = torch.tensor([[FLOAT32_MAX, -FLOAT32_MAX, 3.0e38, 1.0]])
    for scaling in (TensorwiseScaling(), RowwiseScaling(), TensorwiseScaling(power_of_2=True)):
        d = Float8Tensor.quantize(x, fp8, scaling=scaling).dequantize()
        assert d.isfinite().all(), (scaling, d)
        assert float(d[0, 0]) > 2.9e38
