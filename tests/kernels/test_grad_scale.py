"""kernels/grad_scale.py: scale_grad against scale_grad_ref, bit for bit, and the reference against its
definition ((t.float() * g) rounded to t's dtype, then cast) on the CPU."""

import pytest
import torch

from float8.kernels.grad_scale import BLOCK, scale_grad, scale_grad_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
G_VALUES = [1.0, 0.37, 1 / 3, 3.0e4, 0.0, float("inf"), float("nan")]


def _t(n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g) * 3
    t[:4] = torch.tensor([0.0, -0.0, float("inf"), 1e-40])  # signed zeros, an infinity, a float32 subnormal
    return t.to(dtype).to(device)


def _definition(t, g, out_dtype):
    return (t.float() * g).to(t.dtype).to(out_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", G_VALUES)
def test_reference_is_its_definition(dtype, g):
    t = _t(1000, dtype, "cpu")
    gt = torch.tensor(g)
    want = _definition(t, gt, dtype)
    for copy in (False, True):
        src = t.clone()
        got = scale_grad_ref(src, gt, dtype, copy)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert (got.data_ptr() == src.data_ptr()) != copy  # in place unless a copy is asked for
        if copy:
            torch.testing.assert_close(src, t, rtol=0, atol=0, equal_nan=True)
    if dtype == torch.float32:
        for out_dtype in (torch.bfloat16, torch.float16):
            src = t.clone()
            got = scale_grad_ref(src, gt, out_dtype)
            torch.testing.assert_close(got, _definition(t, gt, out_dtype), rtol=0, atol=0, equal_nan=True)
            assert got.dtype == out_dtype


def test_cpu_tensors_take_the_reference():
    t = _t(100, torch.bfloat16, "cpu")
    got = scale_grad(t.clone(), torch.tensor(0.5), torch.bfloat16)
    torch.testing.assert_close(got, _definition(t, torch.tensor(0.5), torch.bfloat16), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("g", G_VALUES)
@pytest.mark.parametrize("n", [0, 5, 3 * BLOCK + 17])
def test_kernel_matches_reference_gpu(dtype, g, n):
    t = _t(max(n, 4), dtype, "cuda")[:n].contiguous() if n else torch.empty(0, dtype=dtype, device="cuda")
    gt = torch.tensor(g, device="cuda")
    outs = [dtype] + ([torch.bfloat16, torch.float16] if dtype == torch.float32 else [])
    for out_dtype in outs:
        for copy in (False, True):
            src, ref_src = t.clone(), t.clone()
            got = scale_grad(src, gt, out_dtype, copy)
            want = scale_grad_ref(ref_src, gt, out_dtype, copy)
            assert got.dtype == out_dtype and got.shape == t.shape
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(got, _definition(t, gt, out_dtype), rtol=0, atol=0, equal_nan=True)
            in_place = out_dtype == dtype and not copy
            assert (got.data_ptr() == src.data_ptr() or n == 0) == (in_place or n == 0)
            if not in_place:
                torch.testing.assert_close(src, t, rtol=0, atol=0, equal_nan=True)  # the source is left alone


@pytest.mark.gpu
def test_eager_cuda_calls_take_the_kernel_gpu(monkeypatch):
    """The kernel, not the reference, serves an eager CUDA call (both give the same bits, so the tests above
    cannot tell them apart); a g that takes a gradient goes to the (differentiable) reference."""
    import float8.kernels.grad_scale as G

    real = G.scale_grad_ref

    def refuse(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(G, "scale_grad_ref", refuse)
    t, g = _t(3 * BLOCK + 5, torch.bfloat16, "cuda"), torch.tensor(0.5, device="cuda")
    for out_dtype, src in ((torch.bfloat16, t.clone()), (torch.float16, t.float())):
        got = G.scale_grad(src, g, out_dtype)
        torch.testing.assert_close(got, _definition(src if out_dtype != src.dtype else t, g, out_dtype), rtol=0, atol=0)
    monkeypatch.setattr(G, "scale_grad_ref", real)
    gr = torch.tensor(0.5, device="cuda", requires_grad=True)
    assert G.scale_grad(t.clone(), gr, torch.bfloat16).requires_grad


@pytest.mark.gpu
def test_linear_cross_entropy_scales_its_gradients_by_the_incoming_one_gpu():
    """A loss scaled before backward (gradient accumulation, loss scaling) gives the gradients of the unscaled
    loss scaled the same way, in bits; an unscaled one leaves them as the forward wrote them."""
    from float8.ops.functional import linear_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 64, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(1000, 64, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    t = torch.randint(0, 1000, (256,), device="cuda", generator=g)
    for acc in ("float32", "weight_dtype"):
        grads = []
        for scale in (None, 0.37):
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            loss = linear_cross_entropy(xr, wr, t, chunk_tokens=64, dw_accumulation=acc)
            (loss if scale is None else loss * scale).backward()
            grads.append((xr.grad, wr.grad))
        (dx1, dw1), (dx2, dw2) = grads
        gt = torch.tensor(0.37, device="cuda")
        torch.testing.assert_close(dx2, _definition(dx1, gt, dx1.dtype), rtol=0, atol=0)
        if acc == "weight_dtype":  # scaled in bf16 as it lies: the bits of the definition
            torch.testing.assert_close(dw2, _definition(dw1, gt, dw1.dtype), rtol=0, atol=0)
        else:  # the float32 sum is scaled before its rounding to bf16: within that rounding
            torch.testing.assert_close(dw2.float(), dw1.float() * 0.37, rtol=8e-3, atol=1e-6)
