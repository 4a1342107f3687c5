"""torch.compile(fullgraph=True) of quantize, dequantize and FP8 GEMMs on the eager and aot_eager backends."""

import pytest
import torch

from float8 import Float8Tensor, RowwiseScaling
from tests.tolerances import assert_same_bits


def quantize_and_mm(x, w):
    a = Float8Tensor.quantize(x)
    b = Float8Tensor.quantize(w)
    return a @ b.t(), a.dequantize()


def rowwise_round_trip(x):
    return Float8Tensor.quantize(x, scaling=RowwiseScaling()).dequantize()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_quantize_and_gemm_match_eager(backend):
    torch._dynamo.reset()
    x, w = torch.randn(32, 64), torch.randn(48, 64)
    compiled = torch.compile(quantize_and_mm, backend=backend, fullgraph=True)
    out, dq = compiled(x, w)
    ref_out, ref_dq = quantize_and_mm(x, w)
    assert_same_bits(out, ref_out)
    assert_same_bits(dq, ref_dq)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_rowwise(backend):
    torch._dynamo.reset()
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    out = torch.compile(rowwise_round_trip, backend=backend, fullgraph=True)(x)
    assert_same_bits(out, rowwise_round_trip(x))


def test_float8_tensor_as_compiled_function_input():
    torch._dynamo.reset()
    a = Float8Tensor.quantize(torch.randn(32, 64))
    b = Float8Tensor.quantize(torch.randn(64, 48), with_transpose=True)

    def f(a, b):
        return (a @ b).sum(dim=0)

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(a, b)
    assert_same_bits(out, f(a, b))
