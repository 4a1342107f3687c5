"""kernels/cross_entropy.py: the Triton kernel against ce_rows_ref, interpreted on the CPU and on the GPU.

Not bit for bit: the kernel's online softmax sums exp() in another order than torch.logsumexp. Loss and lse
agree to float32 rounding; the gradient to its dtype's rounding."""

import os

import pytest
import torch

from float8.kernels import cross_entropy as ce

from .helpers import needs_interpreter

CASES = [  # rows, vocab (odd sizes: a partial last block), dtype, smoothing
    (5, 37, torch.float32, 0.0),
    (7, 2048 + 13, torch.bfloat16, 0.0),
    (3, 4100, torch.float16, 0.1),
    (4, 300, torch.float32, 1.0),
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _inputs(rows, vocab, dtype, device, per_row_scale=False):
    g = torch.Generator().manual_seed(rows * vocab)
    z = (torch.randn(rows, vocab, generator=g) * 4).to(dtype).to(device)
    z[0, 3] = 30.0  # one dominant logit
    t = torch.randint(0, vocab, (rows,), generator=g).to(device)
    t[-1] = -100  # an ignored row
    scale = torch.rand(rows, generator=g).to(device) if per_row_scale else torch.tensor(0.25, device=device)
    return z, t, scale


def _check(device, rows, vocab, dtype, smoothing, per_row_scale):
    z, t, scale = _inputs(rows, vocab, dtype, device, per_row_scale)
    z_ref = z.clone()
    for write in (False, True):
        zk, zr = z.clone(), z_ref.clone()
        loss, lse = ce.ce_rows_triton(zk, t, scale, -100, smoothing, write)
        loss_r, lse_r = ce.ce_rows_ref(zr, t, scale, -100, smoothing, write)
        torch.testing.assert_close(loss, loss_r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, lse_r, rtol=1e-5, atol=1e-5)
        assert loss[-1] == 0 and lse[-1] == 0
        if write:
            torch.testing.assert_close(zk.float(), zr.float(), rtol=TOL[dtype], atol=TOL[dtype] * 1e-2)
            assert (zk[-1] == 0).all()
        else:
            assert torch.equal(zk, z)  # no gradient asked: the logits are left alone


@needs_interpreter
@pytest.mark.parametrize("rows,vocab,dtype,smoothing", CASES)
@pytest.mark.parametrize("per_row_scale", [False, True])
def test_ce_rows_interpreted(rows, vocab, dtype, smoothing, per_row_scale):
    _check("cpu", rows, vocab, dtype, smoothing, per_row_scale)


def test_ce_rows_ref_is_f_cross_entropy():
    z, t, _ = _inputs(6, 50, torch.float64, "cpu")
    zz = z.clone().requires_grad_(True)
    for smoothing in (0.0, 0.2):
        ref = torch.nn.functional.cross_entropy(zz, t, reduction="none", label_smoothing=smoothing)
        (grad,) = torch.autograd.grad(ref.sum(), zz)
        got = z.clone()
        loss, _ = ce.ce_rows_ref(got, t, torch.tensor(1.0, dtype=torch.float64), -100, smoothing, True)
        torch.testing.assert_close(loss, ref.float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got, grad, rtol=1e-5, atol=1e-6)  # the reference computes in float32


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="runs the kernel on the GPU, not the interpreter")
@pytest.mark.parametrize("rows,vocab,dtype,smoothing", CASES + [(64, 128256, torch.bfloat16, 0.0)])
def test_ce_rows_gpu(rows, vocab, dtype, smoothing):
    _check("cuda", rows, vocab, dtype, smoothing, per_row_scale=rows % 2 == 1)
