"""kernels/swiglu_pair.py: (dg, du) of silu(g) * u for separate g and u, one pass.

Its math is act_bwd's SwiGLU op for op, so on the GPU and under the interpreter it gives the bits of
act_bwd(dy, [g | u], "swiglu") split in two, and the torch reference's bits on the GPU (both compute in float32
with one rounding; the interpreter's exp is numpy's, so there the reference is matched within an ulp)."""

from __future__ import annotations

import pytest
import torch

from float8.kernels.activation import act_bwd, act_bwd_triton
from float8.kernels.swiglu_pair import swiglu_pair_bwd, swiglu_pair_bwd_ref, swiglu_pair_bwd_triton
from tests.kernels.helpers import assert_bits, needs_interpreter
from tests.kernels.test_activation import ULPS_GPU, assert_ulps_close, magnitude

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _inputs(shape, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dy, g, u = (torch.randn(shape, generator=gen) * 3 for _ in range(3))
    g.view(-1)[:6] = torch.tensor([0.0, -0.0, 30.0, -30.0, 90.0, -90.0])
    return dy.to(dtype).to(device), g.to(dtype).to(device), u.to(dtype).to(device)


def _act_bwd_halves(dy, g, u, bwd):
    dh = bwd(dy, torch.cat([g, u], dim=-1), "swiglu")
    return dh.chunk(2, dim=-1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 1000, 3584), (1, 7), (3, 5, 2049)])
def test_gpu_act_bwds_bits_and_near_the_reference(dtype, shape):
    dy, g, u = _inputs(shape, dtype, "cuda")
    dg, du = swiglu_pair_bwd(dy, g, u)
    dg_act, du_act = _act_bwd_halves(dy, g, u, act_bwd)
    assert_bits(dg, dg_act.contiguous(), "dg against act_bwd")
    assert_bits(du, du_act.contiguous(), "du against act_bwd")
    # Triton's exp is ex2.approx, torch's is not: the float32 results agree within act_bwd's GPU tolerance
    # (tests/kernels/test_activation.py), so the rounded ones within an ulp of the dtype
    dy32, g32, u32 = dy.float(), g.float(), u.float()
    m = magnitude("swiglu", torch.cat([g32, u32], dim=-1), None, dy32)
    m_g, m_u = m.chunk(2, dim=-1)
    for ours, ref, mag, what in zip(
        swiglu_pair_bwd_triton(dy32, g32, u32), swiglu_pair_bwd_ref(dy32, g32, u32), (m_g, m_u), ("dg", "du")
    ):
        assert_ulps_close(ours, ref, mag, **ULPS_GPU, what=what)
    for ours, ref, mag in zip((dg, du), swiglu_pair_bwd_ref(dy, g, u), (m_g, m_u)):
        err = (ours.double() - ref.double()).abs()
        assert err.le(ref.double().abs() * 2.0**-7 + mag * 2.0**-20 + 2.0**-126).all()  # an ulp, or float32's slack


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_strided_inputs_are_read_as_their_values():
    dy, g, u = _inputs((64, 256), torch.bfloat16, "cuda")
    dg, du = swiglu_pair_bwd(dy.t(), g.t(), u.t())
    copies = (t.t().contiguous() for t in (dy, g, u))
    for ours, ref in zip((dg, du), swiglu_pair_bwd(*copies)):
        assert ours.is_contiguous()
        assert_bits(ours, ref)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_interpreted_kernel_gives_act_bwds_bits(dtype):
    dy, g, u = _inputs((3, 5, 100), dtype, "cpu")
    dg, du = swiglu_pair_bwd_triton(dy, g, u)
    dg_act, du_act = _act_bwd_halves(dy, g, u, act_bwd_triton)
    assert_bits(dg, dg_act.contiguous(), "dg")
    assert_bits(du, du_act.contiguous(), "du")


@needs_interpreter
def test_interpreted_kernel_within_an_ulp_of_the_reference():
    dy, g, u = _inputs((64, 300), torch.float32, "cpu")
    for ours, ref in zip(swiglu_pair_bwd_triton(dy, g, u), swiglu_pair_bwd_ref(dy, g, u)):
        # numpy's float32 exp, not torch's: a few ulps of float32, absolute near silu's zero crossing (g near
        # -1.28, where 1 + g (1 - s) cancels): 2.1e-6 at most measured, gradients of magnitude up to 30
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)


def test_reference_is_the_derivative_of_silu_times_u():
    dy, g, u = _inputs((16, 40), torch.float64, "cpu")
    g.requires_grad_(True)
    u.requires_grad_(True)
    (torch.nn.functional.silu(g) * u).backward(dy)
    # the reference computes in float32: within float32's rounding of the float64 derivative
    dy32, g32, u32 = dy.float(), g.detach().float(), u.detach().float()
    dg, du = swiglu_pair_bwd_ref(dy32, g32, u32)
    torch.testing.assert_close(dg.double(), g.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(du.double(), u.grad, rtol=1e-5, atol=1e-6)


def test_cpu_tensors_take_the_reference():
    dy, g, u = _inputs((4, 33), torch.bfloat16, "cpu")
    for ours, ref in zip(swiglu_pair_bwd(dy, g, u), swiglu_pair_bwd_ref(dy, g, u)):
        assert torch.equal(ours, ref)


@pytest.mark.parametrize(
    "shapes, dtypes, match",
    [
        (((2, 3), (2, 3), (2, 4)), (torch.bfloat16,) * 3, "one shape"),
        (((2, 3),) * 3, (torch.bfloat16, torch.bfloat16, torch.float16), "one dtype"),
        (((2, 3),) * 3, (torch.int32,) * 3, "one dtype"),
    ],
)
def test_mismatched_inputs_are_refused_by_name(shapes, dtypes, match):
    dy, g, u = (torch.ones(s, dtype=d) for s, d in zip(shapes, dtypes))
    with pytest.raises(ValueError, match=match):
        swiglu_pair_bwd(dy, g, u)
