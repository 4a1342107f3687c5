"""float8.kernels: Triton kernels, plain tensors in and out, each with a pure-torch `*_ref` twin.

Importing this package registers the custom ops `torch.ops.float8.*` (amax, cast, quantize_tensorwise,
cast_transpose, quantize_transpose_tensorwise, quantize_rowwise, quantize_blockwise, dequantize, and the
norm and activation ops of `norm.py` and `activation.py`). On a
CUDA tensor each runs its Triton kernel; on a CPU tensor its reference (DESIGN.md section 5).
"""

from . import activation, norm  # fused activation/bias and norm kernels (float8::act_*, float8::*norm*)
from .amax import amax, amax_ref
from .blockwise import quantize_blockwise, quantize_blockwise_ref
from .cast import cast, cast_ref
from .cast_transpose import (
    cast_transpose,
    cast_transpose_ref,
    quantize_transpose_tensorwise,
    quantize_transpose_tensorwise_ref,
)
from .dequantize import dequantize, dequantize_ref
from .quantize import quantize_tensorwise, quantize_tensorwise_ref
from .rowwise import quantize_rowwise, quantize_rowwise_ref

__all__ = [
    "activation",
    "norm",
    "amax",
    "amax_ref",
    "cast",
    "cast_ref",
    "quantize_tensorwise",
    "quantize_tensorwise_ref",
    "cast_transpose",
    "cast_transpose_ref",
    "quantize_transpose_tensorwise",
    "quantize_transpose_tensorwise_ref",
    "quantize_rowwise",
    "quantize_rowwise_ref",
    "quantize_blockwise",
    "quantize_blockwise_ref",
    "dequantize",
    "dequantize_ref",
]
