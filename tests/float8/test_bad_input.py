"""Bad input gets a clear error that names the problem (docs/design.md §3; docs/bad_input.md lists every case)."""

import pytest
import torch

from float8 import BlockwiseScaling, DelayedScaling, Float8Tensor, RowwiseScaling, TensorwiseScaling


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool, torch.float64])
def test_non_float_input(dtype):
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        Float8Tensor.quantize(torch.zeros(4, 4, dtype=dtype))


def test_fp8_inputs():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        Float8Tensor.quantize(torch.zeros(4, 4, dtype=torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="already FP8"):
        Float8Tensor.quantize(Float8Tensor.quantize(torch.randn(4, 4)))


@pytest.mark.parametrize("fp8_dtype", [torch.float16, torch.int8, "e4m3"])
def test_non_fp8_target(fp8_dtype):
    with pytest.raises(TypeError, match="fp8_dtype"):
        Float8Tensor.quantize(torch.randn(4, 4), fp8_dtype)


def test_untileable_block():
    with pytest.raises(ValueError, match="block"):
        Float8Tensor.quantize(torch.randn(4, 100), scaling=BlockwiseScaling((1, 128)))
    with pytest.raises(ValueError, match="block"):
        Float8Tensor.quantize(torch.randn(128, 200), scaling=BlockwiseScaling((128, 128)))
    with pytest.raises(ValueError, match="block must be one of"):
        BlockwiseScaling((2, 64))


def test_bad_scales():
    x = torch.randn(4, 4)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite positive"):
            Float8Tensor.quantize(x, scale=bad)
    with pytest.raises(TypeError, match="float32"):
        Float8Tensor.quantize(x, scale=torch.ones((), dtype=torch.float16))
    with pytest.raises(ValueError, match="one value"):
        Float8Tensor.quantize(x, scale=torch.ones(2))
    with pytest.raises(ValueError, match="not both"):
        Float8Tensor.quantize(x, scale=2.0, scaling=TensorwiseScaling())


def test_bad_scaling_arguments():
    with pytest.raises(TypeError, match="DelayedScalingState"):
        Float8Tensor.quantize(torch.randn(4, 4), scaling=DelayedScaling())
    with pytest.raises(TypeError, match="scaling must be"):
        Float8Tensor.quantize(torch.randn(4, 4), scaling="rowwise")
    with pytest.raises(ValueError, match="margin"):
        RowwiseScaling(margin=-1)
    with pytest.raises(ValueError, match="amax_compute_algo"):
        DelayedScaling(amax_compute_algo="mean")


@pytest.mark.gpu
def test_cpu_and_cuda_operands_mixed():
    a = Float8Tensor.quantize(torch.randn(16, 32))
    b = Float8Tensor.quantize(torch.randn(32, 16, device="cuda"))
    with pytest.raises(ValueError, match="different devices"):
        a @ b
    with pytest.raises(ValueError, match="is on"):
        Float8Tensor.quantize(torch.randn(4, 4, device="cuda"), scale=torch.ones(()))


def test_dequantize_to_a_non_float_dtype():
    with pytest.raises(TypeError, match="dequantize"):
        Float8Tensor.quantize(torch.randn(4, 4)).dequantize(torch.int32)
