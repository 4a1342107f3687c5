"""The kernels that hand an amax over to the next FP8 cast: the product with its amax (kernels/product_amax.py),
the SwiGLU pair backward with the amaxes of its two gradients (kernels/swiglu_pair.py), the one-projection
SwiGLU's silu and product with the product's amax (kernels/silu_product.py) and its backward with dh's
(kernels/activation.py `act_bwd_with_amax`), and the cast from a given amax (kernels/quantize.py
`quantize_tensorwise_from_amax`). Bit for bit: the tensors against the same kernels without the amax (and
torch's product), the maxima against amax_ref of the tensors written, and the cast from max|x| against
quantize_tensorwise."""

from __future__ import annotations

import pytest
import torch

from float8.kernels import quantize_tensorwise
from float8.kernels.activation import act_bwd, act_bwd_triton, act_bwd_with_amax
from float8.kernels.product_amax import product_with_amax, product_with_amax_ref, product_with_amax_triton
from float8.kernels.quantize import quantize_tensorwise_from_amax, quantize_tensorwise_from_amax_triton
from float8.kernels.reference import amax_ref, quantize_tensorwise_ref
from float8.kernels.silu_product import silu_and_product, silu_and_product_ref, silu_and_product_triton
from float8.kernels.swiglu_pair import swiglu_pair_bwd, swiglu_pair_bwd_ref, swiglu_pair_bwd_triton
from tests.kernels.helpers import assert_bits, assert_outputs, make_x, needs_interpreter

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
NAMES = ("data", "data_t", "scale_inv", "amax")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pair(shape, dtype, device="cpu", seed=0):
    a = make_x(shape, dtype, seed=seed, device=device)
    b = make_x(shape, dtype, seed=seed + 1, device=device)
    return a, b


# ---- the product and its amax ---------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 100), (1, 7), (0, 4), (2, 4097)])
def test_interpreted_product_is_torchs_and_its_amax_the_products(dtype, shape):
    a, b = _pair(shape, dtype)
    p, amax = product_with_amax_triton(a, b)
    assert_bits(p, a * b, "product")
    assert_bits(amax, amax_ref(a * b), "amax")


@needs_interpreter
def test_interpreted_product_amax_propagates_nan_and_reads_strided_inputs():
    a, b = _pair((64, 96), torch.bfloat16)
    a[5, 7] = float("nan")
    p, amax = product_with_amax_triton(a.t(), b.t())
    assert p.is_contiguous() and torch.isnan(amax)
    assert_bits(p, (a.t() * b.t()).contiguous(), "product of transposed views")


def test_product_reference_and_checks():
    a, b = _pair((4, 8), torch.bfloat16)
    p, amax = product_with_amax(a, b)  # the CPU takes the reference
    assert_bits(p, a * b)
    assert float(amax) == float((a * b).float().abs().max())
    assert product_with_amax_ref(a, b)[1].dtype == torch.float32
    with pytest.raises(ValueError, match="one shape and one dtype"):
        product_with_amax(a, b.float())
    with pytest.raises(ValueError, match="one shape and one dtype"):
        product_with_amax(a, b[:2])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 1000, 3584), (1, 7), (3, 5, 2049)])
def test_gpu_product_bits_and_amax(dtype, shape):
    a, b = _pair(shape, dtype, "cuda")
    p, amax = product_with_amax(a, b)
    assert_bits(p, a * b, "product against torch's")
    assert_bits(amax, amax_ref(p), "amax")


# ---- the SwiGLU pair backward's amaxes ------------------------------------------------------------------


def _swiglu_inputs(shape, dtype, device="cpu"):
    dy, g = _pair(shape, dtype, device)
    u = make_x(shape, dtype, seed=7, device=device)
    return dy, g, u


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_interpreted_pair_backward_amaxes_are_its_gradients_and_change_no_bit(dtype):
    dy, g, u = _swiglu_inputs((3, 5, 100), dtype)
    dg, du, amax_g, amax_u = swiglu_pair_bwd_triton(dy, g, u, with_amax=True)
    dg0, du0 = swiglu_pair_bwd_triton(dy, g, u)
    assert_bits(dg, dg0, "dg")
    assert_bits(du, du0, "du")
    assert_bits(amax_g, amax_ref(dg), "max|dg|")
    assert_bits(amax_u, amax_ref(du), "max|du|")


def test_pair_backward_reference_amaxes():
    dy, g, u = _swiglu_inputs((4, 64), torch.bfloat16)
    dg, du, amax_g, amax_u = swiglu_pair_bwd(dy, g, u, with_amax=True)
    for t, ref in zip((dg, du), swiglu_pair_bwd_ref(dy, g, u)):
        assert_bits(t, ref)
    assert_bits(amax_g, amax_ref(dg))
    assert_bits(amax_u, amax_ref(du))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_pair_backward_amaxes(dtype):
    dy, g, u = _swiglu_inputs((4, 1000, 3584), dtype, "cuda")
    dg, du, amax_g, amax_u = swiglu_pair_bwd(dy, g, u, with_amax=True)
    dg0, du0 = swiglu_pair_bwd(dy, g, u)
    assert_bits(dg, dg0)
    assert_bits(du, du0)
    assert_bits(amax_g, amax_ref(dg))
    assert_bits(amax_u, amax_ref(du))


# ---- the one-projection SwiGLU: silu and product, and the backward of h = [g | u] ----------------------------


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 200), (1, 2), (2, 4100)])
def test_interpreted_silu_product_amax_is_the_products_and_changes_no_bit(dtype, shape):
    h = make_x(shape, dtype, seed=3)
    s, p, amax = silu_and_product_triton(h, with_amax=True)
    s0, p0 = silu_and_product_triton(h)
    assert_bits(s, s0, "silu")
    assert_bits(p, p0, "product")
    assert_bits(amax, amax_ref(p), "max|p|")
    h[0, 0] = float("nan")  # a NaN gate: its product is NaN, and so is the amax
    assert torch.isnan(silu_and_product_triton(h, with_amax=True)[2])


def test_silu_product_reference_amax():
    h = make_x((4, 6, 16), torch.bfloat16)
    s, p, amax = silu_and_product(h, with_amax=True)  # the CPU takes torch's own calls
    for ours, ref in zip((s, p), silu_and_product_ref(h)):
        assert_bits(ours, ref)
    assert_bits(amax, amax_ref(p))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_silu_product_amax(dtype):
    for shape in [(4, 1000, 2 * 3584), (3, 5, 2 * 2049), (1, 2)]:
        h = make_x(shape, dtype, seed=5, device="cuda")
        s, p, amax = silu_and_product(h, with_amax=True)
        for ours, ref in zip((s, p), silu_and_product_ref(h)):
            assert_bits(ours, ref)
        assert_bits(amax, amax_ref(p))


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 200), (40, 2 * 130)])
def test_interpreted_swiglu_backward_amax_is_dhs_and_changes_no_bit(dtype, shape):
    h = make_x(shape, dtype, seed=4)
    dy = make_x((*shape[:-1], shape[-1] // 2), dtype, seed=5)
    dh, amax = act_bwd_triton(dy, h, "swiglu", with_amax=True)
    assert_bits(dh, act_bwd_triton(dy, h, "swiglu"), "dh")
    assert_bits(amax, amax_ref(dh), "max|dh|")
    dy[1, 1] = float("nan")
    assert torch.isnan(act_bwd_triton(dy, h, "swiglu", with_amax=True)[1])


def test_swiglu_backward_amax_on_the_cpu():
    h = make_x((4, 64), torch.bfloat16)
    dy = make_x((4, 32), torch.bfloat16, seed=2)
    dh, amax = act_bwd_with_amax(dy, h, "swiglu")
    assert_bits(dh, act_bwd(dy, h, "swiglu"))
    assert_bits(amax, amax_ref(dh))
    with pytest.raises(ValueError):
        act_bwd_with_amax(dy[:, :16], h, "swiglu")  # dy must have half of h's width


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_swiglu_backward_amax(dtype):
    for shape in [(4, 1000, 2 * 3584), (3, 5, 2 * 2049)]:
        h = make_x(shape, dtype, seed=6, device="cuda")
        dy = make_x((*shape[:-1], shape[-1] // 2), dtype, seed=7, device="cuda")
        dh, amax = act_bwd_with_amax(dy, h, "swiglu")
        assert_bits(dh, act_bwd(dy, h, "swiglu"))
        assert_bits(amax, amax_ref(dh))


# ---- the cast from a given amax -------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_transpose", [False, True])
@pytest.mark.parametrize("shape", [(64, 96), (2, 33, 80), (1, 16)])
@pytest.mark.parametrize(
    "fp8_dtype, margin, power_of_2", [(torch.float8_e4m3fn, 0, False), (torch.float8_e5m2, 1, True)]
)
def test_interpreted_cast_from_max_x_gives_current_scalings_bits(
    dtype, with_transpose, shape, fp8_dtype, margin, power_of_2
):
    x = make_x(shape, dtype, specials=True)
    ours = quantize_tensorwise_from_amax_triton(x, amax_ref(x), fp8_dtype, margin, power_of_2, with_transpose)
    ref = quantize_tensorwise_ref(x, fp8_dtype, None, margin, power_of_2, with_transpose)
    assert_outputs(ours, ref, NAMES)


def test_cast_from_amax_on_the_cpu_and_its_checks():
    x = make_x((32, 48), torch.bfloat16)
    amax = amax_ref(x)
    for with_transpose in (False, True):
        ours = quantize_tensorwise_from_amax(x, amax, torch.float8_e4m3fn, with_transpose=with_transpose)
        assert ours[3] is amax
        assert_outputs(ours, quantize_tensorwise(x, torch.float8_e4m3fn, None, 0, False, with_transpose), NAMES)
    with pytest.raises(ValueError, match=r"\(\) float32"):
        quantize_tensorwise_from_amax(x, amax.reshape(1), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"\(\) float32"):
        quantize_tensorwise_from_amax(x, amax.double(), torch.float8_e4m3fn)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("with_transpose", [False, True])
@pytest.mark.parametrize("shape", [(16384, 4096), (3, 5, 2048), (16, 16), (1024, 4096), (4096, 14336)])
def test_gpu_cast_from_amax_gives_quantize_tensorwises_bits(with_transpose, shape):
    x = make_x(shape, torch.bfloat16, device="cuda")
    for fp8_dtype, margin, power_of_2 in ((torch.float8_e4m3fn, 0, False), (torch.float8_e5m2, 1, True)):
        ref = quantize_tensorwise(x, fp8_dtype, None, margin, power_of_2, with_transpose)
        ours = quantize_tensorwise_from_amax(x, ref[3].clone(), fp8_dtype, margin, power_of_2, with_transpose)
        assert_outputs(ours, ref, NAMES)
