"""Subclass mechanics: the dispatch table, native ops, the transpose cache per op, the fallback."""

import warnings

import pytest
import torch

from float8 import BlockwiseScaling, Float8FallbackWarning, Float8Tensor, RowwiseScaling, dispatch
from tests.tolerances import assert_same_bits

aten = torch.ops.aten


def q(shape=(32, 48), transpose=False, scaling=None, dtype=torch.bfloat16):
    x = torch.randn(*shape, dtype=dtype) * 4
    return x, Float8Tensor.quantize(x, scaling=scaling, with_transpose=transpose)


def check_meaning(out, expected_hp):
    """A native op's result is a Float8Tensor whose dequantization equals the op on the dequantized input."""
    assert isinstance(out, Float8Tensor), type(out)
    assert_same_bits(out.dequantize(), expected_hp)
    if out.transpose_cache is not None:
        assert out.transpose_cache.is_contiguous()
        assert_same_bits(out.transpose_cache, out.fp8_data.transpose(-2, -1))


def test_registering_an_op_twice_is_refused():
    with pytest.raises(ValueError, match="already has a handler"):
        dispatch.implements([aten.detach.default])(lambda f, a, k: None)


def test_properties_and_repr():
    x, t = q()
    assert t.shape == x.shape and t.dtype == torch.bfloat16 and t.device == x.device
    assert t.fp8_data.dtype == torch.float8_e4m3fn and t.fp8_dtype == torch.float8_e4m3fn
    assert "Float8Tensor(shape=(32, 48)" in repr(t)


def test_transpose_cache_only_when_a_backward_can_read_it():
    x = torch.randn(32, 48)
    assert Float8Tensor.quantize(x).transpose_cache is None
    assert Float8Tensor.quantize(x, with_transpose=True).transpose_cache is not None
    with torch.no_grad():
        assert Float8Tensor.quantize(x, with_transpose=True).transpose_cache is None
    with torch.inference_mode():
        assert Float8Tensor.quantize(x, with_transpose=True).transpose_cache is None


@pytest.mark.parametrize("transpose", [False, True])
def test_transpose_swaps_data_and_cache(transpose):
    x, t = q(transpose=transpose)
    tt = t.t()
    check_meaning(tt, t.dequantize().t())
    if transpose:
        # The cached layout becomes the data (contiguous) and the old data becomes the cache.
        assert tt.fp8_data.is_contiguous() and tt.transpose_cache is not None
        assert tt.fp8_data.data_ptr() == t.transpose_cache.data_ptr()
        assert tt.transpose_cache.data_ptr() == t.fp8_data.data_ptr()
    else:
        assert tt.transpose_cache is None and tt.fp8_data.data_ptr() == t.fp8_data.data_ptr()
    check_meaning(t.transpose(0, 1), t.dequantize().transpose(0, 1))
    check_meaning(t.permute(1, 0), t.dequantize().permute(1, 0))
    assert_same_bits(tt.t().dequantize(), t.dequantize())


def test_transpose_of_rowwise_moves_the_scale():
    x, t = q(scaling=RowwiseScaling())
    tt = t.t()
    assert tuple(tt.scale_inv.shape) == (1, 32)
    check_meaning(tt, t.dequantize().t())


CACHE_RULES = [
    # (name, op, keeps the cache)
    ("detach", lambda t: t.detach(), True),
    ("clone", lambda t: t.clone(), True),
    ("view", lambda t: t.view(16, 96), False),
    ("reshape", lambda t: t.reshape(-1), False),
    ("slice rows", lambda t: t[4:20], False),
    ("slice cols", lambda t: t[:, 16:32], False),
    ("select", lambda t: t[3], False),
    ("unsqueeze", lambda t: t.unsqueeze(0), False),
    ("basic indexing", lambda t: t[None, 2:5, ::2], False),
]


@pytest.mark.parametrize("name,op,keeps", CACHE_RULES, ids=[c[0] for c in CACHE_RULES])
def test_transpose_cache_rule_per_op(name, op, keeps):
    x, t = q(transpose=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Float8FallbackWarning)
        out = op(t)
    check_meaning(out, op(t.dequantize()))
    assert (out.transpose_cache is not None) == keeps


def test_clone_under_no_grad_allocates_no_transpose():
    x, t = q(transpose=True)
    with torch.no_grad():
        assert t.clone().transpose_cache is None
        assert t.detach().transpose_cache is not None  # an alias allocates nothing


def test_clone_copies_the_scale_but_views_share_it():
    x, t = q()
    assert t.clone().scale_inv.data_ptr() != t.scale_inv.data_ptr()
    assert t[2:].scale_inv.data_ptr() == t.scale_inv.data_ptr()


@pytest.mark.parametrize(
    "scaling,ok",
    [(None, True), (RowwiseScaling(), True), (BlockwiseScaling((1, 128)), True), (BlockwiseScaling((128, 128)), True)],
)
def test_block_aligned_slices_stay_fp8(scaling, ok):
    x, t = q((256, 256), scaling=scaling)
    for view in (lambda v: v[128:], lambda v: v[:, 128:], lambda v: v[5], lambda v: v.split(128)[1]):
        check_meaning(view(t), view(t.dequantize()))


def test_unaligned_block_slice_is_refused_not_copied():
    # A view that returned a copy would swallow writes through it (t[:, 5:100] = 0 would change nothing).
    x, t = q((256, 256), scaling=BlockwiseScaling((1, 128)))
    with pytest.raises(ValueError, match="cuts a scale block"):
        t[:, 5:100]
    with pytest.raises(ValueError, match="cuts a scale block"):
        t[:, :64] = 0
    x, r = q((4, 8, 64), scaling=RowwiseScaling())
    with pytest.raises(ValueError, match="cannot be viewed"):
        r.view(4, 512)


def test_writes_into_part_of_a_tensor_are_refused():
    x, t = q(transpose=True)
    before = t.dequantize().clone()
    with pytest.raises(ValueError, match="view of a Float8Tensor"):
        t[0:2].copy_(torch.randn(2, 48, dtype=torch.bfloat16) * 100)
    with pytest.raises(ValueError, match="view of a Float8Tensor"), pytest.warns(Float8FallbackWarning):
        t[0].mul_(2)
    with pytest.raises(ValueError, match="view of a Float8Tensor"):
        t[:2].copy_(Float8Tensor.quantize(torch.randn(2, 48)))
    assert_same_bits(t.dequantize(), before)  # nothing was half-written
    assert_same_bits(t.transpose_cache, t.fp8_data.t())
    with pytest.warns(Float8FallbackWarning):
        t.detach().mul_(2)  # a whole-tensor alias: allowed; t's cache is then in step or gone, never stale
    assert t.transpose_cache is None or torch.equal(
        t.transpose_cache.view(torch.uint8), t.fp8_data.t().view(torch.uint8)
    )
    assert_same_bits((t @ t.t()), (t.detach().clone() @ t.detach().clone().t()))


def test_rowwise_view_keeps_rows():
    x, t = q((4, 8, 64), scaling=RowwiseScaling())
    v = t.view(32, 64)
    assert tuple(v.scale_inv.shape) == (32, 1)
    check_meaning(v, t.dequantize().view(32, 64))
    check_meaning(t.squeeze(), t.dequantize())
    check_meaning(t[:, 3], t.dequantize()[:, 3])


def test_split_chunk_cat_round_trip_stays_fp8():
    x, t = q((64, 32))
    parts = t.split(16)
    assert all(isinstance(p, Float8Tensor) for p in parts)
    back = torch.cat(parts)
    check_meaning(back, t.dequantize())
    assert back.scale_inv.data_ptr() != t.scale_inv.data_ptr()  # a new tensor owns a new scale
    chunks = t.chunk(4, dim=1)
    check_meaning(torch.cat(chunks, dim=1), t.dequantize())


def test_cat_rowwise_along_rows_and_columns():
    _, a = q((16, 32), scaling=RowwiseScaling())
    _, b = q((8, 32), scaling=RowwiseScaling())
    check_meaning(torch.cat([a, b]), torch.cat([a.dequantize(), b.dequantize()]))
    _, c = q((16, 32), scaling=RowwiseScaling())
    both = torch.cat([a, c], dim=1)
    assert tuple(both.scale_inv.shape) == (16, 2)
    check_meaning(both, torch.cat([a.dequantize(), c.dequantize()], dim=1))


def test_cat_of_different_scales_falls_back():
    _, a = q()
    _, b = q()
    with pytest.warns(Float8FallbackWarning, match="aten.cat"):
        out = torch.cat([a, b])
    assert_same_bits(out, torch.cat([a.dequantize(), b.dequantize()]))


def test_copy_fp8_to_fp8_copies_bits_and_scale():
    _, a = q(transpose=True)
    _, b = q()
    a.copy_(b)
    assert_same_bits(a.fp8_data, b.fp8_data)
    assert_same_bits(a.scale_inv, b.scale_inv)
    assert_same_bits(a.transpose_cache, b.fp8_data.t())  # the cache follows the new bits


def test_copy_high_precision_into_fp8_requantizes_in_place():
    _, a = q()
    data_ptr, scale_ptr = a.fp8_data.data_ptr(), a.scale_inv.data_ptr()
    src = torch.randn(32, 48, dtype=torch.bfloat16)
    a.copy_(src)
    ref = Float8Tensor.quantize(src)
    assert_same_bits(a.fp8_data, ref.fp8_data) and a.fp8_data.data_ptr() == data_ptr
    assert a.scale_inv.data_ptr() == scale_ptr
    plain = torch.empty(32, 48)
    plain.copy_(a)
    assert_same_bits(plain, a.dequantize(torch.float32))


def test_to_device_and_dtype():
    _, t = q(transpose=True)
    moved = t.to("cpu", copy=True)
    check_meaning(moved, t.dequantize())
    f = t.to(torch.float32)
    assert isinstance(f, Float8Tensor) and f.dtype == torch.float32
    assert_same_bits(f.fp8_data, t.fp8_data)  # the bits stay; only the nominal dtype changes
    with pytest.raises(TypeError, match="fp8_data"):
        t.to(torch.float8_e5m2)


def test_empty_and_zeros_like():
    _, t = q()
    z = torch.zeros_like(t)
    assert isinstance(z, Float8Tensor) and (z.dequantize() == 0).all()
    e = torch.empty_like(t)
    assert isinstance(e, Float8Tensor) and e.shape == t.shape
    assert torch.zeros_like(t, dtype=torch.float32).dtype == torch.float32


def test_fallback_warns_naming_the_op_and_computes_in_high_precision():
    _, t = q()
    with pytest.warns(Float8FallbackWarning, match="aten.sin"):
        out = torch.sin(t)
    assert type(out) is torch.Tensor
    assert_same_bits(out, torch.sin(t.dequantize()))


def test_in_place_fallback_requantizes_and_keeps_the_type():
    _, t = q()
    expected = Float8Tensor.quantize(t.dequantize() * 0.5 + 1)
    with pytest.warns(Float8FallbackWarning, match="aten.mul_"):
        t.mul_(0.5)
    with pytest.warns(Float8FallbackWarning, match="aten.add_"):
        r = t.add_(1)
    assert r is t and isinstance(t, Float8Tensor)
    assert_same_bits(t.fp8_data, expected.fp8_data)


def test_fallback_preserves_rowwise_granularity_in_place():
    _, t = q(scaling=RowwiseScaling())
    with pytest.warns(Float8FallbackWarning):
        t.mul_(2)
    assert tuple(t.scale_inv.shape) == (32, 1)


def test_constructor_validates_its_parts():
    data = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="float8"):
        Float8Tensor(torch.zeros(4, 8), torch.ones(()), torch.float32)
    with pytest.raises(TypeError, match="float32"):
        Float8Tensor(data, torch.ones((), dtype=torch.float16), torch.float32)
    with pytest.raises(ValueError, match="does not tile"):
        Float8Tensor(data, torch.ones(3, 1), torch.float32)
    with pytest.raises(ValueError, match="transpose cache"):
        Float8Tensor(data, torch.ones(()), torch.float32, transpose=data)


def test_zero_padding_and_new_zeros_stay_fp8():
    # What DTensor does to uneven shards: pad with zeros, or cat with new_zeros. Both stay FP8, values exact.
    import torch.nn.functional as F

    from float8 import RowwiseScaling

    t = Float8Tensor.quantize(torch.randn(5, 32))
    p = F.pad(t, (0, 0, 0, 3))
    assert isinstance(p, Float8Tensor) and p.shape == (8, 32)
    assert torch.equal(p.dequantize()[:5], t.dequantize()) and (p.dequantize()[5:] == 0).all()
    z = t.new_zeros((3, 32))
    assert isinstance(z, Float8Tensor) and (z.dequantize() == 0).all()
    c = torch.cat([t, z])
    assert isinstance(c, Float8Tensor) and torch.equal(c.dequantize(), p.dequantize())
    r = Float8Tensor.quantize(torch.randn(5, 32), scaling=RowwiseScaling())
    pr = F.pad(r, (0, 0, 0, 3))
    assert tuple(pr.scale_inv.shape) == (8, 1) and torch.equal(pr.dequantize()[:5], r.dequantize())
    assert torch.equal(torch.cat([r, r.new_zeros((3, 32))]).dequantize(), pr.dequantize())
    with pytest.raises(ValueError, match="cut a scale block"):
        F.pad(r, (0, 3))  # a column pad would stretch the row scales over new columns
    assert type(t.new_zeros((2, 2), dtype=torch.bfloat16)) is torch.Tensor


@pytest.mark.parametrize("foreach", [True, False])
def test_in_place_updates_of_an_fp8_parameter_that_requires_grad_are_refused(foreach):
    """AdamW on an FP8-only parameter: with foreach the weight never changed (the _foreach_*_ writes were
    lost), without it the FP8 moments rounded to zero and the weights grew to 1e3 (issue 23 item 9). An
    in-place update of an FP8 tensor that requires grad is refused, saying what to do."""
    p = torch.nn.Parameter(Float8Tensor.quantize(torch.randn(32, 32) * 0.05), requires_grad=True)
    opt = torch.optim.AdamW([p], lr=1e-2, foreach=foreach)
    (torch.randn(16, 32) @ p.dequantize().t()).sum().backward()
    with pytest.warns(Float8FallbackWarning), pytest.raises(RuntimeError, match="Train a high-precision master"):
        opt.step()


def test_foreach_in_place_ops_write_back_into_fp8_tensors():
    """A _foreach_*_ op on a list holding Float8Tensors ran on dequantized copies and dropped the result."""
    a, b = Float8Tensor.quantize(torch.ones(4, 4)), torch.ones(4, 4)
    with pytest.warns(Float8FallbackWarning):
        torch._foreach_mul_([a, b], 2.0)
    assert isinstance(a, Float8Tensor) and torch.equal(a.dequantize(), torch.full((4, 4), 2.0))
    assert torch.equal(b, torch.full((4, 4), 2.0))
