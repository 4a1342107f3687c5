"""kernels/activation.py: the Triton launchers (interpreted on CPU tensors) against the *_ref twins, the
twins against float64 autograd, the custom ops (CPU == ref, opcheck), bad input, and a GPU tier.

What is compared how:
- identity and relu run the same float32 arithmetic in kernel and reference (no transcendental): every
  output is compared bit for bit with the reference.
- gelu, gelu_tanh, silu, swiglu use exp/erf. The interpreter's are numpy's (np.exp on float32, math.erf
  rounded to float32) and differ from torch's by an ulp in ~1-40% of the elements; on the GPU tl.exp is
  ex2.approx. So the float32 activation (or gradient) of the kernel is compared with the reference
  within a few float32 ulps (`assert_ulps_close`), and the FP8 outputs are checked bit for bit against
  the quantization of the kernel's own float32 values (amax, scale_inv, data and data_t all exact: the
  whole scaling + cast path), and against the reference's FP8 outputs up to rare one-code differences,
  which only a rounding boundary between the two float32 values can cause.
- dbias is a float32 sum in a different order than torch's: compared within a summation-error bound.
- The erf GELU's tail (x << 0, where 1 + erf cancels and torch's float32 F.gelu is noise) is checked on
  its own against float64 erfc, relatively, in float32 and in FP8 (`test_gelu_tail`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from float8.kernels import activation as act
from float8.kernels.reference import amax_ref, cast_to_fp8_ref, fp8_max, quantize_tensorwise_ref, scale_from_amax

from .helpers import assert_bits, make_x, needs_interpreter

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F32, BF16 = torch.float32, torch.bfloat16
KINDS = act.KINDS
EXACT_KINDS = ("identity", "relu")  # no exp/erf: the kernel's float32 arithmetic is the reference's

# (shape, x dtype, bias dtype or None, fp8 dtype, with_transpose, margin, power_of_2): every value of
# every option appears; 3-D shapes transpose per batch.
CASES = [
    ((1, 16), F32, F32, E4M3, True, 0, False),
    ((7, 34), BF16, None, E5M2, False, 0, False),
    ((17, 128), BF16, BF16, E4M3, True, 1, False),
    ((3, 5, 64), F32, None, E5M2, True, 0, True),
    ((3, 5, 64), BF16, F32, E4M3, False, 2, True),
]
CASE_IDS = ["1x16-f32-bias-T", "7x34-bf16", "17x128-bf16-bias-T-m1", "3x5x64-f32-T-p2", "3x5x64-bf16-bias32-m2-p2"]

# float32 closeness, |ours - ref| <= RTOL * |ref| + ATOL * m, where m (`magnitude`) is the size of the
# terms whose rounding the result inherits: 1 + |v| (times |b| in swiglu's product, times |dy| in a
# gradient). The ATOL part covers the cancellation at the roots of silu' and gelu' (the erf GELU itself
# has none: its v < 0 side uses erfc, see _phi in kernels/activation_math.py and test_gelu_tail).
ULPS_CPU = dict(rtol=2.0**-21, atol=2.0**-22)  # kernel vs ref: 4 ulps + 1/4 ulp of the terms; measured <= 2
ULPS_GPU = dict(rtol=1e-5, atol=2.0**-20)  # ex2.approx: relative error grows like |v| * 2**-24
FP64 = dict(rtol=1e-5, atol=2.0**-23)  # the float32 result vs float64 autograd


def out_shape(shape, kind):
    return (*shape[:-1], shape[-1] // 2) if kind == "swiglu" else tuple(shape)


def inputs(case, kind, seed=0, device="cpu"):
    shape, dtype, bias_dtype = case[:3]
    x = make_x(shape, dtype, seed=seed).to(device)
    bias = None if bias_dtype is None else make_x((shape[-1],), bias_dtype, seed=seed + 1).to(device)
    dy = make_x(out_shape(shape, kind), dtype, seed=seed + 2, scale=1.0).to(device)
    return x, bias, dy


def magnitude(kind, x, bias, dy=None):
    v = x.double() + (bias.double() if bias is not None else 0.0)
    if kind == "swiglu":
        h = v.shape[-1] // 2
        a, b = v[..., :h], v[..., h:]
        if dy is None:
            return b.abs() * (1 + a.abs())
        g = dy.double().abs()
        return torch.cat([g * b.abs() * (1 + a.abs()), g * (1 + a.abs())], dim=-1)
    m = 1 + v.abs()
    return m if dy is None else m * dy.double().abs()


def assert_ulps_close(ours, ref, m, rtol, atol, what=""):
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, (what, ours.shape, ref.shape, ours.dtype, ref.dtype)
    o, r = ours.double(), ref.double()
    ok = ((o - r).abs() <= rtol * r.abs() + atol * m) | (o == r) | (o.isnan() & r.isnan())
    if not ok.all():
        i = (~ok).nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {(~ok).sum().item()} of {ok.numel()} outside {rtol:.3g}*|ref| + {atol:.3g}*m; "
            f"first at {i}: ours {o[tuple(i)].item()!r} ref {r[tuple(i)].item()!r} m {m[tuple(i)].item()}"
        )


def assert_fp8_outputs(out, ours32, ref_out, fp8_dtype, with_transpose, scale_of_amax, max_diff_frac=1e-3):
    """out = (data, data_t, scale_inv, amax, ...) of a launcher; ours32 = its float32 values (the same
    kernel's high-precision output); ref_out = the reference's (data, data_t, scale_inv, amax, ...).

    Exact: amax = max|ours32|; scale_inv = 1 / scale_of_amax(amax); data = the satfinite RTNE cast of
    ours32 * scale; data_t = data with the last two dims swapped (or an empty (0,) tensor).
    Against the reference: the same bits, except in rare elements, by one FP8 code (a rounding
    boundary between ours32 and the reference's float32 value; with identity/relu, none at all)."""
    data, data_t, scale_inv, amax = out[:4]
    assert_bits(amax, amax_ref(ours32), "amax (of the kernel's own float32 values)", nan_bits=False)
    scale = scale_of_amax(amax)
    assert_bits(scale_inv, scale.reciprocal(), "scale_inv")
    own = cast_to_fp8_ref(ours32, scale, fp8_dtype)
    assert_bits(data, own, "data (cast of the kernel's own values)", nan_bits=False)
    if with_transpose:
        assert_bits(data_t, data.transpose(-2, -1).contiguous(), "data_t")
    else:
        assert data_t.shape == (0,) and data_t.dtype == fp8_dtype
    # vs the reference's own pipeline
    ref_data = ref_out[0]
    a, b = data.view(torch.uint8).long(), ref_data.view(torch.uint8).long()
    both_nan = data.float().isnan() & ref_data.float().isnan()
    diff = (a != b) & ~both_nan
    adjacent = ((a & 0x80) == (b & 0x80)) & ((a & 0x7F) - (b & 0x7F)).abs().eq(1)
    far = diff & ~adjacent
    assert not far.any(), f"FP8 codes > 1 step from the reference's: {a[far][:5].tolist()} vs {b[far][:5].tolist()}"
    n_diff = diff.sum().item()
    assert n_diff <= max(1, int(max_diff_frac * data.numel())), f"{n_diff} FP8 codes differ from the reference's"


def _current(fp8_dtype, margin, power_of_2):
    return lambda amax: scale_from_amax(amax, fp8_dtype, margin, power_of_2)


# ---- Triton launchers under the interpreter vs the references --------------------------------------


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_act_fwd_launcher(kind, case):
    x, bias, _ = inputs(case, kind)
    ours32 = act.act_fwd_triton(x, kind, bias, out_dtype=F32)
    ref32 = act.act_ref_fp32(x, kind, bias)
    ours = act.act_fwd_triton(x, kind, bias)
    assert_bits(ours, ours32.to(x.dtype), "act_fwd in x.dtype = its float32 values rounded once")
    if kind in EXACT_KINDS:
        assert_bits(ours32, ref32, "act float32")
        assert_bits(ours, act.act_fwd_ref(x, kind, bias), "act_fwd")
    else:
        assert_ulps_close(ours32, ref32, magnitude(kind, x, bias), **ULPS_CPU, what="act float32")
        # rounded to x.dtype: one unit of it apart at most (when the float32 values straddle a rounding point)
        eps = torch.finfo(x.dtype).eps
        ref = act.act_fwd_ref(x, kind, bias)
        assert_ulps_close(ours, ref, magnitude(kind, x, bias), eps, ULPS_CPU["atol"], "act_fwd")


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_act_fp8_launcher(kind, case):
    x, bias, _ = inputs(case, kind)
    _, _, _, fp8_dtype, with_t, margin, p2 = case
    out = act.act_fp8_triton(x, kind, bias, fp8_dtype, None, margin, p2, with_t)
    ref = act.act_fp8_ref(x, kind, bias, fp8_dtype, None, margin, p2, with_t)
    ours32 = act.act_fwd_triton(x, kind, bias, out_dtype=F32)
    assert_fp8_outputs(out, ours32, ref, fp8_dtype, with_t, _current(fp8_dtype, margin, p2))
    if kind in EXACT_KINDS:
        for o, r, n in zip(out, ref, ("data", "data_t", "scale_inv", "amax")):
            assert_bits(o, r, n)


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_act_fp8_given_scale_launcher(kind, case):
    x, bias, _ = inputs(case, kind)
    _, _, _, fp8_dtype, with_t, _, _ = case
    scale = torch.tensor([fp8_max(fp8_dtype) / 7.3])  # not a power of two; saturates the largest values
    out = act.act_fp8_triton(x, kind, bias, fp8_dtype, scale, 3, True, with_t)  # margin, power_of_2 ignored
    ref = act.act_fp8_ref(x, kind, bias, fp8_dtype, scale, with_transpose=with_t)
    ours32 = act.act_fwd_triton(x, kind, bias, out_dtype=F32)
    assert_fp8_outputs(out, ours32, ref, fp8_dtype, with_t, lambda amax: scale.reshape(()))
    if kind in EXACT_KINDS:
        for o, r, n in zip(out, ref, ("data", "data_t", "scale_inv", "amax")):
            assert_bits(o, r, n)


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_act_bwd_launcher(kind, case):
    x, bias, dy = inputs(case, kind)
    ours32 = act.act_bwd_triton(dy, x, kind, bias, out_dtype=F32)
    ref32 = act.dact_ref_fp32(dy, x, kind, bias)
    ours = act.act_bwd_triton(dy, x, kind, bias)
    assert_bits(ours, ours32.to(x.dtype), "act_bwd in x.dtype = its float32 values rounded once")
    if kind in EXACT_KINDS:
        assert_bits(ours32, ref32, "dx float32")
        assert_bits(ours, act.act_bwd_ref(dy, x, kind, bias), "act_bwd")
    else:
        assert_ulps_close(ours32, ref32, magnitude(kind, x, bias, dy), **ULPS_CPU, what="dx float32")


def assert_dbias(dbias, ours32, dy_dtype, ref_dbias=None, tol=2.0**-20):
    """dbias = row sums of the kernel's float32 dx, up to float32 summation order, rounded to dy's dtype;
    and the reference's dbias, which sums the reference's dx in torch's order, as close."""
    assert dbias.dtype == dy_dtype and dbias.shape == (ours32.shape[-1],)
    rows = ours32.reshape(-1, ours32.shape[-1]).double()
    exact, size = rows.sum(0), rows.abs().sum(0)
    eps = torch.finfo(dy_dtype).eps
    assert_ulps_close(dbias.double(), exact, size, eps, tol, "dbias vs the sums of the kernel's dx")
    if ref_dbias is not None:
        # the two float32 dx differ by a few ulps (ULPS_CPU): |sum| <= that times sum|dx|
        assert_ulps_close(dbias.double(), ref_dbias.double(), size, 2 * eps, tol + 2.0**-21, "dbias vs ref")


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("given", [False, True], ids=["current", "given-scale"])
def test_dact_fp8_launcher(kind, case, given):
    # Both layouts (transposing tiles) or data alone (row tiles), as the case's with_transpose says.
    x, bias, dy = inputs(case, kind)
    _, _, _, fp8_dtype, with_t, margin, p2 = case
    if given:
        scale = torch.tensor([fp8_max(fp8_dtype) / 3.1])  # saturates the largest gradients
        scale_of_amax, margin, p2 = (lambda amax: scale.reshape(())), 5, True  # margin, power_of_2 ignored
    else:
        scale, scale_of_amax = None, _current(fp8_dtype, margin, p2)
    out = act.dact_fp8_triton(dy, x, kind, bias, fp8_dtype, scale, margin, p2, with_t)
    ref = act.dact_fp8_ref(dy, x, kind, bias, fp8_dtype, scale, margin, p2, with_t)
    ours32 = act.act_bwd_triton(dy, x, kind, bias, out_dtype=F32)
    assert_fp8_outputs(out, ours32, ref, fp8_dtype, with_t, scale_of_amax)
    assert_dbias(out[4], ours32, dy.dtype, ref[4])
    if kind in EXACT_KINDS:
        for o, r, n in zip(out[:4], ref[:4], ("data", "data_t", "scale_inv", "amax")):
            assert_bits(o, r, n)


@needs_interpreter
@pytest.mark.parametrize("case", CASES[1:4], ids=CASE_IDS[1:4])
def test_bias_backward_launcher(case):
    # kind "identity" with x = dy: dbias = the row sums of dy, and dy quantized, in one op.
    x, _, _ = inputs(case, "identity")
    _, _, _, fp8_dtype, with_t, margin, p2 = case
    out = act.dact_fp8_triton(x, x, "identity", None, fp8_dtype, None, margin, p2, with_t)
    ref = act.dact_fp8_ref(x, x, "identity", None, fp8_dtype, None, margin, p2, with_t)
    for o, r, n in zip(out[:4], ref[:4], ("data", "data_t", "scale_inv", "amax")):
        assert_bits(o, r, n)
    assert_dbias(out[4], x.float(), x.dtype, ref[4])


@needs_interpreter
@pytest.mark.parametrize("kind", ["relu", "silu", "gelu", "swiglu"])
def test_special_values_and_zero_amax(kind):
    # NaN, +-inf, -0.0 and huge values; then an activation that is 0 everywhere (amax 0 -> scale 1).
    x = make_x((4, 32), F32, seed=3, specials=True, scale=50.0)
    ours32 = act.act_fwd_triton(x, kind, None, out_dtype=F32)
    ref32 = act.act_ref_fp32(x, kind)
    assert_ulps_close(ours32, ref32, magnitude(kind, x, None), **ULPS_CPU, what="act float32")
    out = act.act_fp8_triton(x, kind, None, E4M3, None, 0, False, True)
    assert out[3].isnan() and out[2].isnan()  # a NaN in -> amax NaN -> scale NaN: all NaN
    assert out[0].float().isnan().all() and out[1].float().isnan().all()
    ref = act.act_fp8_ref(x, kind, None, E4M3, None, 0, False, True)
    assert_fp8_outputs(out, ours32, ref, E4M3, True, _current(E4M3, 0, False))
    dy = make_x(out_shape(x.shape, kind), F32, seed=4, specials=True, scale=2.0)
    d32 = act.act_bwd_triton(dy, x, kind, None, out_dtype=F32)
    dout = act.dact_fp8_triton(dy, x, kind, None, E5M2)
    dref = act.dact_fp8_ref(dy, x, kind, None, E5M2)
    assert_fp8_outputs(dout, d32, dref, E5M2, True, _current(E5M2, 0, False))
    assert dout[0].float().isnan().all() and dout[2].isnan()  # the gradient never comes out finite
    # all zero activation
    neg = -(make_x((5, 32), F32, seed=5).abs() + 1)
    zero = neg if kind != "swiglu" else torch.cat([neg[:, :16].abs(), torch.zeros(5, 16)], -1)
    zkind = "relu" if kind != "swiglu" else kind
    data, data_t, scale_inv, amax = act.act_fp8_triton(zero, zkind, None, E4M3, None, 0, False, True)
    assert amax.item() == 0.0 and scale_inv.item() == 1.0
    assert (data.float() == 0).all() and data_t.shape == (data.shape[1], data.shape[0])


@needs_interpreter
def test_empty_and_noncontiguous_inputs():
    x = torch.empty(0, 34)
    data, data_t, scale_inv, amax = act.act_fp8_triton(x, "swiglu", None, E4M3, None, 0, False, True)
    assert data.shape == (0, 17) and data_t.shape == (17, 0) and amax.item() == 0 and scale_inv.item() == 1
    out = act.dact_fp8_triton(torch.empty(0, 17), x, "swiglu", None, E4M3)
    assert out[0].shape == (0, 34) and out[1].shape == (34, 0) and (out[4] == 0).all() and out[4].shape == (34,)
    xt = make_x((34, 16), F32, layout="transposed", seed=6)  # (34, 16) view of a (16, 34) tensor
    ref = act.act_fp8_ref(xt, "gelu_tanh", None, E5M2, None, 0, False, True)
    out = act.act_fp8_triton(xt, "gelu_tanh", None, E5M2, None, 0, False, True)
    ours32 = act.act_fwd_triton(xt, "gelu_tanh", None, out_dtype=F32)
    assert_fp8_outputs(out, ours32, ref, E5M2, True, _current(E5M2, 0, False))


# ---- the formulas against float64 autograd ----------------------------------------------------------


def gelu64(v):
    """gelu in float64 without cancellation (F.gelu's 1 + erf cancels to nothing by v ~ -8.5, even in float64)."""
    return 0.5 * v * torch.special.erfc(-v * act.SQRT1_2)


def torch_act64(kind, v):
    if kind == "swiglu":
        h = v.shape[-1] // 2
        return F.silu(v[..., :h]) * v[..., h:]
    return {
        "identity": lambda t: t,
        "relu": F.relu,
        "gelu": gelu64,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "silu": F.silu,
    }[kind](v)


@pytest.mark.parametrize("impl", ["ref", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("kind", KINDS)
def test_against_float64_autograd(kind, impl):
    # Values to +-15 (4 sigma of 3.7): the tails of every logistic and of erf are in.
    x = make_x((16, 96), F32, seed=7, scale=3.7)
    bias = make_x((96,), F32, seed=8)
    dy = make_x(out_shape(x.shape, kind), F32, seed=9, scale=1.0)
    v64 = (x.double() + bias.double()).requires_grad_()
    y64 = torch_act64(kind, v64)
    (d64,) = torch.autograd.grad(y64, v64, dy.double())
    if impl == "ref":
        y, d = act.act_fwd_ref(x, kind, bias), act.act_bwd_ref(dy, x, kind, bias)
    else:
        y, d = act.act_fwd_triton(x, kind, bias), act.act_bwd_triton(dy, x, kind, bias)
    # Forward: relative error < 1e-5 elementwise, the erf GELU's tail included (down to float32's
    # smallest normal: below it, precision goes), except gelu_tanh, whose float64 reference itself
    # cancels in 1 + tanh for v << 0.
    atol_fwd = {"gelu": 2.0**-126, "gelu_tanh": FP64["atol"]}.get(kind, 0.0)
    assert_ulps_close(y.double(), y64.detach(), magnitude(kind, x, bias), FP64["rtol"], atol_fwd, "forward vs float64")
    assert_ulps_close(d.double(), d64, magnitude(kind, x, bias, dy), **FP64, what="backward vs float64")
    # and normwise
    assert (y.double() - y64).abs().max() <= 1e-6 * y64.abs().max()
    assert (d.double() - d64).abs().max() <= 1e-6 * d64.abs().max()


def _gelu_impls(impl):
    """(fwd float32, bwd float32, act_fp8, dact_dbias_cast_transpose) for gelu, by the reference or the launchers."""
    if impl == "ref":
        return (
            lambda x: act.act_ref_fp32(x, "gelu"),
            lambda dy, x: act.dact_ref_fp32(dy, x, "gelu"),
            lambda x: act.act_fp8_ref(x, "gelu", None, E4M3),
            lambda dy, x: act.dact_fp8_ref(dy, x, "gelu", None, E5M2),
        )
    return (
        lambda x: act.act_fwd_triton(x, "gelu", out_dtype=F32),
        lambda dy, x: act.act_bwd_triton(dy, x, "gelu", out_dtype=F32),
        lambda x: act.act_fp8_triton(x, "gelu", None, E4M3),
        lambda dy, x: act.dact_fp8_triton(dy, x, "gelu", None, E5M2),
    )


def _gelu_terms64(x):
    """(gelu, Phi, x * phi) of x in float64, without cancellation: gelu = x Phi, gelu' = Phi + x phi."""
    v = x.double()
    cdf = 0.5 * torch.special.erfc(-v * act.SQRT1_2)
    return v * cdf, cdf, v * (torch.exp(-0.5 * v * v) * act.INV_SQRT_2PI)


@pytest.mark.parametrize(
    "impl",
    [
        "ref",
        pytest.param("triton", marks=needs_interpreter),
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_gelu_tail(impl):
    # x << 0: gelu(x) = 0.5 x erfc(-x / sqrt2) is tiny, and 0.5 x (1 + erf(x / sqrt2)) cancels to noise
    # (relative error ~1 by x = -6 in float32); the kernels use erfc there. Relative accuracy, for the
    # value and for the gradient (relative to its two terms, which cancel only at gelu's minimum,
    # x ~ -0.75), to 1e-6 (the erfc fit: 1.2e-7, and a few roundings) + x^2 2^-24: exp(-x^2/2) inherits
    # the rounding of x^2 / 2 (and, on the GPU, ex2.approx that of x^2/2 * log2(e)), half an ulp each.
    # Down to x = -12.5, where Phi(x) (3.7e-36) is still a normal float32 (the GPU may flush
    # subnormals). Then FP8 codes within one step of the cast of the exact values, for a tensor of tail
    # values alone, which current scaling lifts into the FP8 range.
    device = "cuda" if impl == "cuda" else "cpu"
    fwd, bwd, fp8, dfp8 = _gelu_impls(impl)
    x = -torch.linspace(0.0, 12.5, 64 * 64, device=device).reshape(64, 64)
    dy = make_x(x.shape, F32, seed=10, scale=1.0).to(device)
    y64, cdf, vpdf = _gelu_terms64(x)
    rtol = 1e-6 + x.double() ** 2 * 2.0**-24
    assert_ulps_close(fwd(x).double(), y64, rtol * y64.abs(), 0.0, 1.0, "gelu tail vs float64")
    terms = dy.double().abs() * (cdf + vpdf.abs())
    d64 = dy.double() * (cdf + vpdf)
    assert_ulps_close(bwd(dy, x).double(), d64, rtol * terms, 0.0, 1.0, "gelu' tail vs float64")

    # x in [-8, -4]: gelu from -1.3e-4 to -5e-15; E4M3 codes from 448 down to 0 (x ~ -6.5)
    x = -torch.linspace(4.0, 8.0, 64 * 16, device=device).reshape(64, 16)
    dy = make_x(x.shape, F32, seed=11, scale=1.0).to(device)
    y64, cdf, vpdf = _gelu_terms64(x)
    out = fp8(x)
    assert_fp8_outputs(out, fwd(x), quantize_tensorwise_ref(y64.float(), E4M3), E4M3, False, _current(E4M3, 0, False))
    assert out[0].view(torch.uint8).unique().numel() > 100  # the tail spans the FP8 codes
    d64 = (dy.double() * (cdf + vpdf)).float()
    out = dfp8(dy, x)
    assert_fp8_outputs(
        out, bwd(dy, x), quantize_tensorwise_ref(d64, E5M2, with_transpose=True), E5M2, True, _current(E5M2, 0, False)
    )


# ---- the custom ops ---------------------------------------------------------------------------------


def _op_calls(kind, case=CASES[2]):
    x, bias, dy = inputs(case, kind)
    if kind == "identity":
        bias = None
    scale = torch.tensor([3.5])
    return [
        (act.act_fwd, (x, kind, bias), act.act_fwd_ref),
        (act.act_fp8, (x, kind, bias, E4M3, None, 1, False, True), act.act_fp8_ref),
        (act.act_fp8, (x, kind, bias, E5M2), act.act_fp8_ref),
        (act.act_fp8, (x, kind, bias, E5M2, scale, 0, False, True), act.act_fp8_ref),
        (act.act_bwd, (dy, x, kind, bias), act.act_bwd_ref),
        (act.dact_fp8, (dy, x, kind, bias, E4M3, None, 0, True), act.dact_fp8_ref),
        (act.dact_fp8, (dy, x, kind, bias, E5M2, scale.reshape(()), 0, False, False), act.dact_fp8_ref),
        (act.dact_fp8, (dy, x, kind, bias, E4M3, None, 1, False, False, False), act.dact_fp8_ref),
        (act.dact_fp8, (x, x, "identity", None, E5M2), act.dact_fp8_ref),  # a bias's backward
    ]


def test_the_ops():
    assert {op.op._name for op, _, _ in _op_calls("relu")} == {"act_fwd", "act_fp8", "act_bwd", "dact_fp8"}
    for old in ("act_fp8_scaled", "dact_dbias_cast_transpose", "dbias_cast_transpose"):
        assert not hasattr(act, old) and not hasattr(torch.ops.float8, old), old


@pytest.mark.parametrize("kind", KINDS)
def test_custom_ops_on_cpu_are_the_refs(kind):
    for op, args, ref in _op_calls(kind):
        ours, theirs = op(*args), ref(*args)
        for o, r in zip(ours if isinstance(ours, tuple) else [ours], theirs if isinstance(theirs, tuple) else [theirs]):
            assert_bits(o, r, op.__name__)


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_opcheck(kind):
    # .op: the registered custom op (an eager call of the plain function skips the dispatcher)
    for op, args, _ in _op_calls(kind, CASES[4]):
        torch.library.opcheck(op.op, args)


TRANSPOSE_VARIANTS = [
    dict(BLOCK_S=64, BLOCK_N=64, num_warps=4, T_MODE=0),
    dict(BLOCK_S=32, BLOCK_N=64, num_warps=4, T_MODE=1),
    dict(BLOCK_S=16, BLOCK_N=32, num_warps=2, T_MODE=2),
]


@needs_interpreter
@pytest.mark.parametrize("cfg", TRANSPOSE_VARIANTS, ids=lambda c: f"{c['BLOCK_S']}x{c['BLOCK_N']}-t{c['T_MODE']}")
@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_transposing_tile_variants_give_the_same_bits(kind, cfg):
    # The sweep (benchmarks.act_sweep) times these tiles and transposes; every one must write
    # exactly the bits of the reference, for odd shapes with partial tiles and a batch dim.
    x, bias, dy = inputs(((2, 70, 96), BF16, BF16), kind)
    # (the default tile's own bits are checked against the references by the launcher tests above)
    out = act.act_fp8_triton(x, kind, bias, E4M3, None, 0, False, True, config=cfg)
    assert_bits(out[1], out[0].transpose(-2, -1).contiguous(), "data_t = data transposed")
    default = act.act_fp8_triton(x, kind, bias, E4M3, None, 0, False, True)
    for o, d, n in zip(out, default, ("data", "data_t", "scale_inv", "amax")):
        assert_bits(o, d, f"{n}, variant vs default tile")
    bwd = act.dact_fp8_triton(dy, x, kind, bias, E5M2, config=cfg)
    bwd_default = act.dact_fp8_triton(dy, x, kind, bias, E5M2)
    for o, d, n in zip(bwd[:4], bwd_default[:4], ("dx", "dx_t", "scale_inv", "amax")):
        assert_bits(o, d, f"backward {n}, variant vs default tile")
    assert_bits(bwd[1], bwd[0].transpose(-2, -1).contiguous(), "dx_t = dx transposed")


@needs_interpreter
@pytest.mark.parametrize("kind", ["swiglu", "identity"])
def test_backward_without_dbias(kind):
    # with_dbias=False (no bias to train): the same FP8 outputs, no sums, an empty dbias; the op agrees.
    x, bias, dy = inputs(((33, 80), BF16, None), kind)
    full = act.dact_fp8_triton(dy, x, kind, bias, E4M3)
    lean = act.dact_fp8_triton(dy, x, kind, bias, E4M3, with_dbias=False)
    for o, f, n in zip(lean[:4], full[:4], ("dx", "dx_t", "scale_inv", "amax")):
        assert_bits(o, f, n)
    assert lean[4].shape == (0,) and lean[4].dtype == dy.dtype
    ref = act.dact_fp8_ref(dy, x, kind, bias, E4M3, None, 0, False, True, False)
    assert ref[4].shape == (0,)
    torch.library.opcheck(act.dact_fp8.op, (dy, x, kind, bias, E4M3, None, 0, False, True, False))


def test_fused_equals_unfused_for_float32():
    # float32 x: act_fwd's output is the kernel's float32 value, so quantizing it separately is the same.
    from float8.kernels import quantize_tensorwise

    x, bias, _ = inputs(CASES[3], "swiglu")
    y = act.act_fwd(x, "swiglu", bias)
    for scale, with_t in [(None, True), (None, False), (torch.tensor([0.3]), True)]:
        fused = act.act_fp8(x, "swiglu", bias, E5M2, scale, 1, True, with_t)
        for o, r in zip(fused, quantize_tensorwise(y, E5M2, scale, 1, True, with_t)):
            assert_bits(o, r, "fused vs unfused")


# ---- bad input --------------------------------------------------------------------------------------


def test_bad_input():
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match="gelu_tanh.*swiglu") as e:
        act.act_fwd(x, "tanh")
    assert all(k in str(e.value) for k in KINDS)
    with pytest.raises(ValueError, match="unknown activation kind"):
        act.act_fp8(x, "geglu", None, E4M3)
    with pytest.raises(ValueError, match=r"\(5,\).*\(4, 6\)"):
        act.act_fwd(x, "gelu", torch.randn(5))
    with pytest.raises(ValueError, match=r"\(3,\).*\(4, 6\)"):
        act.act_fp8(x, "swiglu", torch.randn(3), E4M3)  # a swiglu bias has 2H entries
    with pytest.raises(ValueError, match="even"):
        act.act_fwd(torch.randn(4, 7), "swiglu")
    with pytest.raises(ValueError, match="even"):
        act.act_bwd(torch.randn(4, 3), torch.randn(4, 7), "swiglu")
    with pytest.raises(TypeError):
        act.act_fwd(torch.ones(4, 6, dtype=torch.int32), "relu")
    with pytest.raises(TypeError):
        act.act_bwd(torch.ones(4, 6, dtype=torch.int64), x, "relu")
    with pytest.raises(TypeError):
        act.act_fwd(x, "relu", torch.ones(6, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\(4, 6\).*\(4, 6\).*\(4, 3\)"):
        act.act_bwd(torch.randn(4, 6), x, "swiglu")  # dy must have H columns
    with pytest.raises(ValueError, match="2 dims"):
        act.act_fp8(torch.randn(6), "relu", None, E4M3, None, 0, False, True)
    with pytest.raises(TypeError):
        act.act_fp8(x, "relu", None, torch.bfloat16)
    with pytest.raises(ValueError, match="margin"):
        act.dact_fp8(x, x, "relu", None, E4M3, None, -1)
    with pytest.raises(ValueError, match=r"dact_fp8: margin 32 is too large for torch.float8_e5m2: at most 31"):
        act.dact_fp8(x, x, "relu", None, E5M2, None, 32)
    act.dact_fp8(x, x, "relu", None, E5M2, torch.ones(1), 32)  # ignored with a given scale
    with pytest.raises(ValueError, match="one element"):
        act.act_fp8(x, "relu", None, E4M3, torch.ones(2))
    with pytest.raises(TypeError, match="scale must be float32"):
        act.dact_fp8(x, x, "relu", None, E4M3, torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="2 dims"):
        act.dact_fp8(torch.randn(6), torch.randn(6), "relu", None, E4M3)  # with_transpose=True by default
    act.dact_fp8(torch.randn(6), torch.randn(6), "relu", None, E4M3, with_transpose=False)
    with pytest.raises(TypeError, match="with_dbias must be a bool"):
        act.dact_fp8(x, x, "relu", None, E4M3, None, 0, False, True, 1)


# ---- GPU tier ---------------------------------------------------------------------------------------


def _gpu_check_all(kind, x, bias, dy, fp8_dtype, margin=0, p2=False, with_t=True, dbias_tol=2.0**-16):
    ours32 = act.act_fwd_triton(x, kind, bias, out_dtype=F32)
    assert_ulps_close(ours32, act.act_ref_fp32(x, kind, bias), magnitude(kind, x, bias), **ULPS_GPU, what="act")
    y = act.act_fwd(x, kind, bias)
    assert_bits(y, ours32.to(x.dtype), "act_fwd = its float32 values rounded")
    out = act.act_fp8(x, kind, bias, fp8_dtype, None, margin, p2, with_t)
    ref = act.act_fp8_ref(x, kind, bias, fp8_dtype, None, margin, p2, with_t)
    assert_fp8_outputs(out, ours32, ref, fp8_dtype, with_t, _current(fp8_dtype, margin, p2))
    scale = torch.tensor([fp8_max(fp8_dtype) / 5.1], device=x.device)
    given = lambda amax: scale.reshape(())  # noqa: E731
    out = act.act_fp8(x, kind, bias, fp8_dtype, scale, 0, False, with_t)
    ref = act.act_fp8_ref(x, kind, bias, fp8_dtype, scale, 0, False, with_t)
    assert_fp8_outputs(out, ours32, ref, fp8_dtype, with_t, given)
    del ours32, out, ref
    d32 = act.act_bwd_triton(dy, x, kind, bias, out_dtype=F32)
    assert_ulps_close(d32, act.dact_ref_fp32(dy, x, kind, bias), magnitude(kind, x, bias, dy), **ULPS_GPU, what="dx")
    assert_bits(act.act_bwd(dy, x, kind, bias), d32.to(x.dtype), "act_bwd = its float32 values rounded")
    # current scaling in both layouts (transposing tiles) and in data alone (row tiles); a given scale
    for s, t, scale_of_amax in [
        (None, True, _current(fp8_dtype, margin, p2)),
        (None, False, _current(fp8_dtype, margin, p2)),
        (scale, with_t, given),
    ]:
        out = act.dact_fp8(dy, x, kind, bias, fp8_dtype, s, margin, p2, t)
        ref = act.dact_fp8_ref(dy, x, kind, bias, fp8_dtype, s, margin, p2, t)
        assert_fp8_outputs(out, d32, ref, fp8_dtype, t, scale_of_amax)
        assert_dbias(out[4], d32, dy.dtype, ref[4], tol=dbias_tol)
        del out, ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "shape, dtype, bias_dtype, fp8_dtype, with_t, margin, p2",
    [
        ((1, 16), F32, F32, E4M3, True, 0, False),
        ((257, 1000), BF16, BF16, E4M3, True, 0, False),
        ((3, 129, 192), F32, None, E5M2, True, 1, True),
        ((1000, 66), BF16, F32, E5M2, False, 0, False),
    ],
)
def test_cuda_launches_vs_refs(kind, shape, dtype, bias_dtype, fp8_dtype, with_t, margin, p2):
    x, bias, dy = inputs((shape, dtype, bias_dtype), kind, device="cuda")
    _gpu_check_all(kind, x, bias, dy, fp8_dtype, margin, p2, with_t)
    if kind in EXACT_KINDS:
        assert_bits(act.act_fwd(x, kind, bias), act.act_fwd_ref(x, kind, bias), "act_fwd")
        assert_bits(act.act_bwd(dy, x, kind, bias), act.act_bwd_ref(dy, x, kind, bias), "act_bwd")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_swiglu_large_bf16():
    # The MLP block's SwiGLU (benchmarks/suite.py): 16384 tokens, FFN 14336 (x is (16384, 2 * 14336) bf16, 0.9 GB).
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((16384, 2 * 14336), generator=g, device="cuda").mul_(2).to(BF16)
    dy = torch.randn((16384, 14336), generator=g, device="cuda").to(BF16)
    _gpu_check_all("swiglu", x, None, dy, E4M3, dbias_tol=2.0**-14)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cfg", TRANSPOSE_VARIANTS, ids=lambda c: f"{c['BLOCK_S']}x{c['BLOCK_N']}-t{c['T_MODE']}")
def test_cuda_transposing_tile_variants_give_the_same_bits(cfg):
    # Under the interpreter the three transposes are one numpy transpose; on the GPU they are three
    # different routes through shared memory (FP8 bytes, 16-bit lanes, float32 recast): same bits required.
    x, bias, dy = inputs(((3, 200, 320), BF16, BF16), "swiglu", device="cuda")
    for o, d in zip(
        act.act_fp8_triton(x, "swiglu", bias, E4M3, None, 0, False, True, config=cfg),
        act.act_fp8_triton(x, "swiglu", bias, E4M3, None, 0, False, True),
    ):
        assert_bits(o, d, "forward, variant vs default tile")
    for o, d in zip(
        act.dact_fp8_triton(dy, x, "swiglu", bias, E5M2, config=cfg)[:4],
        act.dact_fp8_triton(dy, x, "swiglu", bias, E5M2)[:4],
    ):
        assert_bits(o, d, "backward, variant vs default tile")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_row_tiles_give_the_transposing_tiles_bits(kind):
    # Without with_transpose the FP8 pass runs on row tiles, another compiled kernel: the same bits required
    # (every value is elementwise; a given scale too).
    x, bias, dy = inputs(((3, 200, 320), BF16, BF16), kind, device="cuda")
    for scale in (None, torch.tensor([17.0], device="cuda")):
        rows, tiles = (act.act_fp8_triton(x, kind, bias, E4M3, scale, 0, False, t) for t in (False, True))
        for o, d, n in zip(rows, tiles, ("data", "data_t", "scale_inv", "amax")):
            if n != "data_t":
                assert_bits(o, d, f"forward {n}, row tiles vs transposing tiles")
        rows, tiles = (act.dact_fp8_triton(dy, x, kind, bias, E5M2, scale, 0, False, t) for t in (False, True))
        for o, d, n in zip(rows, tiles, ("data", "data_t", "scale_inv", "amax", "dbias")):
            if n != "data_t":
                assert_bits(o, d, f"backward {n}, row tiles vs transposing tiles")
