"""kernels/rowwise_input_mm.py: x quantized per row, then the row-wise scaled FP8 GEMM with an FP8 weight.

CPU: the reference's semantics (per-row scales, the weight's scale per tensor or per row, the bias, the
non-finite contract), which operands it takes, and that the op is its reference there. GPU tier: the
kernel's quantized bytes and scales are the reference's bit for bit, the GEMM's output matches the
reference's float32 product, prepared calls give the unprepared call's bits (CUDA graphs too) and read
a weight's scale changed in place.
"""

import pytest
import torch

from float8 import Float8Tensor
from float8.kernels import rowwise_input_mm as R
from float8.kernels.rowwise import launch_rowwise, quantize_rowwise, quantize_rowwise_ref
from tests.tolerances import SQNR_DB, assert_same_bits, sqnr_db

E4M3 = torch.float8_e4m3fn


def _operands(m=48, k=64, n=32, per_row_weight=False, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device, torch.bfloat16)
    if per_row_weight:
        w8, s = quantize_rowwise_ref(w, E4M3)
    else:
        q = Float8Tensor.quantize(w)
        w8, s = q.fp8_data, q.scale_inv
    return x, w8, s


def _exact(x, w8, s, bias=None):
    w = w8.double() * (s.double().reshape(-1, 1) if s.numel() > 1 else s.double())
    y = x.double() @ w.t()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("per_row_weight", [False, True], ids=["tensor-scaled weight", "row-scaled weight"])
def test_reference_is_the_product_of_the_row_quantized_input(per_row_weight):
    x, w8, s = _operands(per_row_weight=per_row_weight)
    bias = torch.randn(w8.shape[0]).to(torch.bfloat16)
    y = R.fp8_rowwise_input_mm_ref(x, w8, s, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], w8.shape[0])
    x8, sx = quantize_rowwise_ref(x, E4M3)
    want = _exact(x8.double() * sx.double(), w8, s, bias)
    assert sqnr_db(want, y) > 45  # only the final bf16 rounding and float32 sums differ
    assert sqnr_db(_exact(x, w8, s, bias), y) >= SQNR_DB["linear"]


def test_each_row_keeps_its_own_scale():
    """A row 1000x smaller than the others is quantized as accurately as they are (one scale per row): a
    single scale for the tensor would leave it a few FP8 steps."""
    x, w8, s = _operands(m=40)
    x[3] *= 1e-3
    y = R.fp8_rowwise_input_mm_ref(x, w8, s)
    exact = _exact(x, w8, s)
    assert sqnr_db(exact[3], y[3]) > 25
    assert sqnr_db(exact[3], y[3]) > sqnr_db(exact[0], y[0]) - 6


def test_a_per_tensor_weight_scale_is_folded_into_the_row_scales():
    """sx * sw is rounded once in float32 and multiplies the float32 product: the GEMM's column scales are
    ones, so no call keeps a copy of the weight's scale."""
    x, w8, s = _operands()
    x8, sx = quantize_rowwise_ref(x, E4M3)
    want = ((x8.float() @ w8.float().t()) * (sx * s)).to(torch.bfloat16)
    assert_same_bits(R.fp8_rowwise_input_mm_ref(x, w8, s), want)
    _, w8r, sr = _operands(per_row_weight=True)
    want = ((x8.float() @ w8r.float().t()) * sx * sr.reshape(1, -1)).to(torch.bfloat16)
    assert_same_bits(R.fp8_rowwise_input_mm_ref(x, w8r, sr), want)


def test_supports():
    x, w8, s = _operands()
    assert R.supports(x, w8, s)
    assert not R.supports(x.half(), w8, s)  # the row-wise GEMM writes bf16
    assert not R.supports(x, w8.view(torch.uint8).view(torch.float8_e5m2), s)
    assert not R.supports(x[:, :48], w8, s)  # K does not chain (48 against the weight's 64)
    assert not R.supports(x.t().contiguous().t(), w8, s)  # x's rows not contiguous
    x24, w24 = torch.randn(4, 24).to(torch.bfloat16), w8[:, :24].contiguous()
    assert not R.supports(x24, w24, s)  # K not a multiple of 16
    assert not R.supports(x, w8[:24], s)  # N not a multiple of 16
    assert not R.supports(x, w8, torch.ones(2, 1))  # blocks: the weight-only kernel's
    _, w8r, sr = _operands(per_row_weight=True)
    assert R.supports(x, w8r, sr)


def test_unsupported_operands_raise():
    x, w8, s = _operands()
    with pytest.raises(ValueError, match="bfloat16"):
        R.fp8_rowwise_input_mm(x.half(), w8, s)
    with pytest.raises(ValueError, match="bias"):
        R.fp8_rowwise_input_mm(x, w8, s, torch.zeros(w8.shape[0]))  # float32 bias


def test_op_on_the_cpu_is_its_reference():
    x, w8, s = _operands()
    bias = torch.randn(w8.shape[0]).to(torch.bfloat16)
    assert_same_bits(R.fp8_rowwise_input_mm(x, w8, s, bias), R.fp8_rowwise_input_mm_ref(x, w8, s, bias))
    y, prepared = R.prepare(x, w8, s, bias)  # nothing to prepare off the GPU
    assert prepared is None and torch.equal(y, R.fp8_rowwise_input_mm_ref(x, w8, s, bias))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_row_gives_a_nan_row(bad):
    x, w8, s = _operands()
    x[5, 3] = bad
    y = R.fp8_rowwise_input_mm(x, w8, s)
    assert torch.isnan(y[5]).all()
    assert torch.isfinite(torch.cat([y[:5], y[6:]])).all()


# ---- GPU tier ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m", [33, 64, 128])
@pytest.mark.parametrize("per_row_weight", [False, True], ids=["tensor-scaled weight", "row-scaled weight"])
def test_gpu_kernel_against_the_reference(m, per_row_weight):
    x, w8, s = _operands(m=m, k=512, n=256, per_row_weight=per_row_weight, device="cuda")
    bias = torch.randn(256, device="cuda").to(torch.bfloat16)
    x8, sx = quantize_rowwise(x, E4M3)
    r8, rs = quantize_rowwise_ref(x, E4M3)
    assert_same_bits(x8, r8)
    assert_same_bits(sx, rs)
    if not per_row_weight:  # the weight's scale folded in by the kernel: the reference's float32 product
        folded8, folded = launch_rowwise(x, E4M3, times=s.reshape(()))
        assert_same_bits(folded8, r8)
        assert_same_bits(folded, (rs * s).reshape(-1))
    y = R.fp8_rowwise_input_mm(x, w8, s, bias)
    want = R.fp8_rowwise_input_mm_ref(x, w8, s, bias)
    # The same FP8 operands and scales; only the GEMM's float32 summation order and the rounding differ.
    assert sqnr_db(want.double(), y) > 45
    assert (y.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2**-8


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_gpu_a_non_finite_row_gives_a_nan_row(bad):
    x, w8, s = _operands(m=64, device="cuda")
    x[5, 3] = bad
    y = R.fp8_rowwise_input_mm(x, w8, s)
    assert torch.isnan(y[5]).all()
    assert torch.isfinite(torch.cat([y[:5], y[6:]])).all()


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_prepared_call_gives_the_unprepared_bits(bias):
    x, w8, s = _operands(m=96, k=256, n=128, device="cuda")
    b = torch.randn(128, device="cuda").to(torch.bfloat16) if bias else None
    y0, prepared = R.prepare(x, w8, s, b)
    assert prepared is not None and prepared.matches(w8, s, b)
    want = R.fp8_rowwise_input_mm(x, w8, s, b)
    assert_same_bits(y0, want)
    x2 = torch.randn_like(x)
    assert_same_bits(prepared(x2, w8, s, b), R.fp8_rowwise_input_mm(x2, w8, s, b))
    # A misaligned input is handed back to the checked path.
    buf = torch.empty(x.numel() + 8, device="cuda", dtype=torch.bfloat16)
    odd = buf[1 : 1 + x.numel()].view_as(x)
    odd.copy_(x)
    assert prepared(odd, w8, s, b) is None


@pytest.mark.gpu
@pytest.mark.parametrize("per_row_weight", [False, True], ids=["tensor-scaled weight", "row-scaled weight"])
def test_gpu_a_scale_changed_in_place_is_read_by_the_next_prepared_call(per_row_weight):
    """The prepared call keeps no copy of the weight's scale: the quantize kernel reads a per-tensor scale
    at every call, the GEMM a per-row one."""
    x, w8, s = _operands(m=64, device="cuda", per_row_weight=per_row_weight)
    _, prepared = R.prepare(x, w8, s)
    before = prepared(x, w8, s, None)
    s.mul_(2)
    after = prepared(x, w8, s, None)
    assert_same_bits(after, R.fp8_rowwise_input_mm(x, w8, s))
    assert not torch.equal(after, before)


@pytest.mark.gpu
def test_gpu_prepared_call_replays_in_a_cuda_graph():
    x, w8, s = _operands(m=64, k=256, n=128, device="cuda")
    _, prepared = R.prepare(x, w8, s)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        prepared(static_x, w8, s, None)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = prepared(static_x, w8, s, None)
    for seed in range(3):
        static_x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to("cuda", x.dtype))
        graph.replay()
        assert_same_bits(static_y, R.fp8_rowwise_input_mm(static_x, w8, s))
