"""float8: FP8 training and inference for PyTorch on NVIDIA Hopper.

from float8 import Float8Tensor
x8 = Float8Tensor.quantize(x)                  # per-tensor current scaling, E4M3
y = x8 @ Float8Tensor.quantize(w).t()          # an FP8 GEMM, output in x's dtype
"""

import torch

from float8 import gemm as _gemm  # noqa: F401  (registers mm/addmm)
from float8 import native_ops as _native_ops  # noqa: F401  (registers views, copies, cat/split)

if torch.distributed.is_available():
    from float8 import collectives as _collectives  # noqa: F401  (registers the c10d collectives)
from float8.checkpoint import load_checkpoint, save_checkpoint
from float8.dispatch import Float8FallbackWarning
from float8.memory import memory_footprint
from float8.quantizer import (
    BlockwiseQuantizer,
    DelayedScalingState,
    Quantizer,
    RowwiseQuantizer,
    ScaleLayout,
    StaticQuantizer,
    TensorwiseQuantizer,
)
from float8.recipe import BlockwiseScaling, DelayedScaling, Format, Recipe, RowwiseScaling, TensorwiseScaling
from float8.tensor import Float8Tensor

__version__ = "0.1.0"

__all__ = [
    "Float8Tensor",
    "Float8FallbackWarning",
    "Format",
    "Recipe",
    "TensorwiseScaling",
    "RowwiseScaling",
    "BlockwiseScaling",
    "DelayedScaling",
    "DelayedScalingState",
    "Quantizer",
    "ScaleLayout",
    "TensorwiseQuantizer",
    "StaticQuantizer",
    "RowwiseQuantizer",
    "BlockwiseQuantizer",
    "memory_footprint",
    "save_checkpoint",
    "load_checkpoint",
]
