"""The one tolerance table of the test suite (docs/design.md §7).

Where bits can match we compare bits (`assert_same_bits`); end-to-end numerics are SQNR in dB against
the high-precision computation of the same inputs.
"""

import torch

SQNR_DB = {
    "cast": 25.0,  # quantize -> dequantize against the input
    "linear": 18.0,  # FP8 GEMM output against the high-precision product
    "grad": 17.0,  # gradients against the high-precision backward
}


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB; +inf when equal, NaN never passes a >= check."""
    ref = reference.detach().double()
    noise = (ref - approx.detach().double()).pow(2).sum()
    signal = ref.pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(signal / noise))


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise equality of two tensors of the same dtype (NaN payloads included)."""
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    ua, ub = a.contiguous().view(bits), b.contiguous().view(bits)
    mismatch = (ua != ub).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} elements differ, first at {mismatch[0].tolist()}"
