"""Lean activation memory in kernels/activation.py: act_fp8_save_input writes x in E4M3 beside the FP8
activation, and act_bwd / dact_fp8 given x_scale_inv read that copy in place of x.

- The forward's other outputs are act_fp8's, bit for bit; x_data / x_scale_inv are the reference's
  per-tensor E4M3 quantization of x, bit for bit (interpreter and GPU).
- The backwards with an FP8 x are compared with their references exactly as test_activation.py compares
  the high-precision ones (bits for identity/relu, a few float32 ulps for the transcendental kinds, FP8
  outputs bit for bit against the quantization of the kernel's own float32 values).
- Numerics: the gradient through the rounded input stays within the E5M2 gradient cast's own error.
"""

from __future__ import annotations

import pytest
import torch

from float8.kernels import activation as act
from float8.kernels.reference import fp8_max, quantize_tensorwise_ref
from float8.kernels.rowwise import quantize_rowwise_ref

from .helpers import assert_bits, make_x, needs_interpreter
from .test_activation import (
    BF16,
    CASE_IDS,
    CASES,
    E4M3,
    E5M2,
    EXACT_KINDS,
    F32,
    KINDS,
    ULPS_CPU,
    ULPS_GPU,
    _current,
    assert_dbias,
    assert_fp8_outputs,
    assert_ulps_close,
    inputs,
    magnitude,
)

OUTS = ("data", "data_t", "scale_inv", "amax")


def saved_copy(x, per_row=False):
    """(x_data, x_scale_inv): what the forward must save, by the reference quantization; per_row: the
    per-row copy a lean converted model keeps (ops/saved_outputs.py), one scale per row of x."""
    if per_row:
        return quantize_rowwise_ref(x, act.SAVED_X_DTYPE)
    data, _, scale_inv, _ = quantize_tensorwise_ref(x, act.SAVED_X_DTYPE)
    return data, scale_inv


def check_saved_forward(out, plain, x):
    for o, p, n in zip(out[:4], plain, OUTS):
        assert_bits(o, p, f"{n}: the same as act_fp8's")
    x8, xs = saved_copy(x)
    assert out[4].dtype == act.SAVED_X_DTYPE and out[4].shape == x.shape
    assert_bits(out[4], x8, "x_data = x quantized to E4M3 per tensor")
    assert_bits(out[5], xs, "x_scale_inv")


def check_saved_backward(kind, dy, x, bias, fp8_dtype, scale, margin, p2, with_t, ulps, launcher=True, per_row=False):
    """act_bwd / dact_fp8 with the saved copy of x against their references with the same copy."""
    x8, xs = saved_copy(x, per_row)
    xd = x8.float() * xs  # the values the backward reads
    bwd = act.act_bwd_triton if launcher else (lambda *a, out_dtype=None, **k: act.act_bwd(*a, **k))
    ours32 = act.act_bwd_triton(dy, x8, kind, bias, out_dtype=F32, x_scale_inv=xs)
    ref32 = act.dact_ref_fp32(dy, x8, kind, bias, xs)
    assert_bits(ref32, act.dact_ref_fp32(dy, xd, kind, bias), "the reference reads x_data * x_scale_inv")
    if kind in EXACT_KINDS and bias is None:
        assert_bits(ours32, ref32, "dx float32")
    else:  # (a bias may be added by one fma on the GPU: a few ulps, like the transcendental kinds)
        assert_ulps_close(ours32, ref32, magnitude(kind, xd, bias, dy), **ulps, what="dx float32")
    hp = bwd(dy, x8, kind, bias, x_scale_inv=xs)
    assert hp.dtype == dy.dtype, "dx of an FP8 x is in dy's dtype"
    assert_bits(hp, ours32.to(dy.dtype), "act_bwd = its float32 values rounded once")
    scale_of_amax = _current(fp8_dtype, margin, p2) if scale is None else (lambda amax: scale.reshape(()))
    dact = act.dact_fp8_triton if launcher else act.dact_fp8
    out = dact(dy, x8, kind, bias, fp8_dtype, scale, margin, p2, with_t, x_scale_inv=xs)
    ref = act.dact_fp8_ref(dy, x8, kind, bias, fp8_dtype, scale, margin, p2, with_t, True, xs)
    assert_fp8_outputs(out, ours32, ref, fp8_dtype, with_t, scale_of_amax)
    assert_dbias(out[4], ours32, dy.dtype, ref[4], tol=2.0**-16 if x.is_cuda else 2.0**-20)


# ---- interpreter ------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", ["relu", "gelu", "swiglu"])
def test_save_input_launcher(kind, case):
    x, bias, _ = inputs(case, kind)
    _, _, _, fp8_dtype, with_t, margin, p2 = case
    out = act.act_fp8_triton(x, kind, bias, fp8_dtype, None, margin, p2, with_t, save_input=True)
    check_saved_forward(out, act.act_fp8_triton(x, kind, bias, fp8_dtype, None, margin, p2, with_t), x)
    # a given scale: one cast pass for y, but pass 1 still runs for max|x|
    scale = torch.tensor([fp8_max(fp8_dtype) / 7.3])
    out = act.act_fp8_triton(x, kind, bias, fp8_dtype, scale, 0, False, with_t, save_input=True)
    check_saved_forward(out, act.act_fp8_triton(x, kind, bias, fp8_dtype, scale, 0, False, with_t), x)


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_saved_input_backward_launchers(kind, case):
    x, bias, dy = inputs(case, kind)
    _, _, _, fp8_dtype, with_t, margin, p2 = case
    check_saved_backward(kind, dy, x, bias, fp8_dtype, None, margin, p2, with_t, ULPS_CPU)


@needs_interpreter
@pytest.mark.parametrize("case", CASES[1:4], ids=CASE_IDS[1:4])
@pytest.mark.parametrize("kind", ["gelu", "silu", "swiglu"])
def test_saved_input_backward_with_a_scale_per_row(kind, case):
    # A per-row copy (one scale-inverse per row, (..., 1)): each row read at its own scale, as the reference.
    x, bias, dy = inputs(case, kind)
    _, _, _, fp8_dtype, with_t, margin, p2 = case
    check_saved_backward(kind, dy, x, bias, fp8_dtype, None, margin, p2, with_t, ULPS_CPU, per_row=True)


def test_a_scale_inverse_of_another_shape_is_refused():
    x8, _ = saved_copy(torch.randn(6, 8))
    for bad in (torch.ones(6), torch.ones(6, 2), torch.ones(1, 1), torch.ones(8, 6)[:, :1]):
        with pytest.raises(ValueError, match="x_scale_inv must be"):
            act.act_bwd(torch.ones(6, 8), x8, "gelu", None, bad)


@needs_interpreter
def test_saved_input_special_values():
    # inf in x: its amax is inf, the scale NaN, so the saved copy is NaN and so is every gradient (the
    # forward's own FP8 output is NaN as well): nothing turns finite. A zero x saves zeros with scale 1.
    x = torch.randn(16, 32)
    x[3, 5] = float("inf")
    out = act.act_fp8_triton(x, "gelu", None, E4M3, save_input=True)
    assert out[5].isnan() and out[4].float().isnan().all()
    dx = act.act_bwd_triton(torch.ones(16, 32), out[4], "gelu", x_scale_inv=out[5])
    assert dx.isnan().all()
    z = act.act_fp8_triton(torch.zeros(16, 32), "swiglu", None, E4M3, save_input=True)
    assert z[5].item() == 1.0 and not z[4].float().any()


# ---- custom ops, CPU = references ---------------------------------------------------------------------


def _saved_op_calls(kind):
    x, bias, dy = inputs(CASES[2], kind)
    x8, xs = saved_copy(x)
    return [
        (act.act_fp8_save_input, (x, kind, bias, E4M3, None, 0, False, True), act.act_fp8_save_input_ref),
        (act.act_bwd, (dy, x8, kind, bias, xs), act.act_bwd_ref),
        (act.dact_fp8, (dy, x8, kind, bias, E5M2, None, 0, False, True, True, xs), act.dact_fp8_ref),
    ]


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_ops_on_cpu_are_the_refs_and_pass_opcheck(kind):
    for op, args, ref in _saved_op_calls(kind):
        ours, theirs = op(*args), ref(*args)
        for o, r in zip(ours if isinstance(ours, tuple) else [ours], theirs if isinstance(theirs, tuple) else [theirs]):
            assert_bits(o, r, op.__name__)
        tests = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
        if any(isinstance(a, torch.Tensor) and a.dtype == act.SAVED_X_DTYPE for a in args):
            tests.remove("test_schema")  # it compares FP8 inputs with ops that have no FP8 CPU kernel
        torch.library.opcheck(op.op, args, test_utils=tests)


def test_gradient_through_the_saved_copy_is_within_the_gradient_cast_error():
    # SwiGLU / GELU on (4096, 512) inputs of an MLP's scale: the E4M3 input moves dx by less than the E5M2
    # cast of dx itself does (the cast every FP8 backward applies to it).
    for kind in ("swiglu", "gelu"):
        x = make_x((4096, 512), BF16, specials=False, seed=3, scale=2.0)
        dy = make_x((4096, 256 if kind == "swiglu" else 512), BF16, specials=False, seed=4, scale=1.0)
        exact = act.dact_ref_fp32(dy, x, kind)
        x8, xs = saved_copy(x)
        through_copy = act.dact_ref_fp32(dy, x8, kind, None, xs)
        cast = quantize_tensorwise_ref(exact, E5M2)
        cast_values = cast[0].float() * cast[2]

        def err(a):
            return ((a.double() - exact.double()).norm() / exact.double().norm()).item()

        assert err(through_copy) < err(cast_values), (kind, err(through_copy), err(cast_values))


def test_bad_input():
    x = torch.randn(4, 6)
    x8, xs = saved_copy(x)
    with pytest.raises(TypeError, match="x_scale_inv is given, so x must be the FP8 copy"):
        act.act_bwd(torch.randn(4, 6), x, "gelu", None, xs)
    with pytest.raises(ValueError, match=r"x_scale_inv must be a \(\) float32 tensor"):
        act.dact_fp8(torch.randn(4, 6), x8, "gelu", None, E5M2, x_scale_inv=xs.reshape(1))
    with pytest.raises(ValueError, match=r"x_scale_inv must be a \(\) float32 tensor"):
        act.act_bwd(torch.randn(4, 6), x8, "gelu", None, xs.double())
    with pytest.raises(TypeError, match="already FP8"):
        act.act_bwd(torch.randn(4, 6), x8, "gelu")  # an FP8 x without its scale-inverse
    with pytest.raises(TypeError, match="already FP8"):
        act.act_fp8_save_input(x8, "gelu", None, E4M3)


# ---- GPU tier ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "shape, dtype, bias_dtype, fp8_dtype, with_t",
    [
        ((257, 1000), BF16, BF16, E4M3, True),
        ((3, 129, 192), F32, None, E5M2, True),
        ((1000, 66), BF16, None, E5M2, False),
    ],
)
def test_cuda_saved_input_vs_refs(kind, shape, dtype, bias_dtype, fp8_dtype, with_t):
    x, bias, dy = inputs((shape, dtype, bias_dtype), kind, device="cuda")
    for scale in (None, torch.tensor([fp8_max(fp8_dtype) / 5.1], device="cuda")):
        out = act.act_fp8_save_input(x, kind, bias, fp8_dtype, scale, 0, False, with_t)
        check_saved_forward(out, act.act_fp8(x, kind, bias, fp8_dtype, scale, 0, False, with_t), x)
    check_saved_backward(kind, dy, x, bias, fp8_dtype, None, 0, False, with_t, ULPS_GPU, launcher=False)
    # Per row, without a bias, as a lean converted model calls it (ops/saved_outputs.py). With a bias the GPU
    # contracts x * x_scale_inv + bias into one fma, where the reference rounds twice: at an exact
    # cancellation relu's gradient flips (0 against dy; H100, 2026-11-27, the (257, 1000) bf16-bias case).
    check_saved_backward(kind, dy, x, None, fp8_dtype, None, 0, False, with_t, ULPS_GPU, launcher=False, per_row=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_swiglu_mlp_shape():
    # The MLP block's SwiGLU (16384 tokens, FFN 14336): one forward and backward through the saved copy.
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((16384, 2 * 14336), generator=g, device="cuda").mul_(2).to(BF16)
    dy = torch.randn((16384, 14336), generator=g, device="cuda").to(BF16)
    out = act.act_fp8_save_input(x, "swiglu", None, E4M3, None, 0, False, True)
    x8, xs = saved_copy(x)
    assert_bits(out[4], x8, "x_data")
    assert_bits(out[5], xs, "x_scale_inv")
    del out
    check_saved_backward("swiglu", dy, x, None, E5M2, None, 0, False, False, ULPS_GPU, launcher=False)
