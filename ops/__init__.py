"""float8.ops: composable ops that a Sequential fuses into few kernels, with FP8 GEMMs.

import float8.ops as ops
mlp = ops.Sequential(
    ops.RMSNorm(4096),
    ops.Linear(4096, 2 * 14336, bias=False),
    ops.SwiGLU(),
    ops.Linear(14336, 4096, bias=False),
)
"""

if "." in __name__:  # float8.ops (or its __init__ imported as a submodule: the same names)
    from float8.ops import functional
    from float8.ops.activations import GELU, Activation, ReLU, SiLU, SwiGLU
    from float8.ops.attention import Attention
    from float8.ops.base import BasicOp, QuantRequest
    from float8.ops.bias import Bias
    from float8.ops.calibrate import CalibrationReport, calibrate, load_input_scales, set_input_scale
    from float8.ops.convert import ConversionWarning, convert
    from float8.ops.cross_entropy import LinearCrossEntropy
    from float8.ops.graphs import GraphedInference, graphed_inference
    from float8.ops.linear import Linear
    from float8.ops.misc import AddResidual, Dropout, Identity, Quantize, Reshape, Residual
    from float8.ops.norms import LayerNorm, RMSNorm
    from float8.ops.parallel import AllGather, AllReduce, ReduceScatter
    from float8.ops.precision import high_precision
    from float8.ops.requantize import requantize_weights
    from float8.ops.runner import RunPlan, plan
    from float8.ops.sequential import Float8PrecisionWarning, Sequential
else:  # the ops/ folder reached by a bare name: none of the imports above run under it (kernels/__init__.py)
    from float8.kernels.common import alias_package as _alias_package

    _alias_package(__name__, "float8.ops", __path__[0])

__all__ = [
    "Activation",
    "AddResidual",
    "AllGather",
    "AllReduce",
    "Attention",
    "BasicOp",
    "Bias",
    "CalibrationReport",
    "ConversionWarning",
    "Dropout",
    "Float8PrecisionWarning",
    "GELU",
    "GraphedInference",
    "Identity",
    "LayerNorm",
    "Linear",
    "LinearCrossEntropy",
    "QuantRequest",
    "Quantize",
    "RMSNorm",
    "ReLU",
    "ReduceScatter",
    "RunPlan",
    "Reshape",
    "Residual",
    "Sequential",
    "SiLU",
    "SwiGLU",
    "calibrate",
    "convert",
    "functional",
    "graphed_inference",
    "load_input_scales",
    "plan",
    "high_precision",
    "requantize_weights",
    "set_input_scale",
]
