"""float8.kernels: Triton kernels, plain tensors in and out, each with a pure-torch `*_ref` twin.

Importing this package registers the custom ops `torch.ops.float8.*`, one per kernel family: amax,
quantize_tensorwise (a given scale or current scaling, with or without the transpose), quantize_rowwise,
quantize_blockwise, dequantize, and norm_fwd / norm_fp8 / norm_bwd (`norm.py`) and act_fwd / act_fp8 /
act_bwd / dact_fp8 (`activation.py`), pack_heads_fp8 (`pack_heads.py`: attention's q/k/v gradients
packed into tokens x features, in FP8), fp8_block_mm (`block_gemm.py`: block-scaled FP8 x FP8), and fp8_weight_mm (`weight_only.py`: few-token activations times
an FP8 weight, one launch, no activation cast), fp8_rowwise_input_mm (`rowwise_input_mm.py`: x quantized per row,
then FP8 x FP8 with an E4M3 weight, for 33-128 tokens). On a CUDA tensor each runs its Triton launcher (`*_triton`); on a
CPU tensor its reference (`*_ref`); `reference.py` states the semantics they share.
"""

# The repository root holds this folder as `kernels/`. With the root on sys.path (pytest, `python -m`,
# `python -c` or a REPL started there, a PYTHONPATH naming it) a probe for some other package named
# `kernels` imports it under that name: transformers' `is_kernels_available()` does, for Hugging Face's
# kernel hub. Run a second time, its modules would define every float8:: op again, and torch drops an op's
# first definition when it is defined again, so the operator handles already taken from it dangle: dynamo's
# fake-tensor calls of our ops then crashed at random (segfaults, std::bad_alloc, basic_string::_M_create;
# docs/bad_input.md). Under a bare name the name means another installed package of that name where
# there is one (Hugging Face's hub), else float8.kernels itself with its loaded submodules
# (common.alias_package); and a module that defines ops refuses to run twice (common.refuse_redefinition).
if "." in __name__:  # float8.kernels (or its __init__ imported as a submodule: the same names)
    from . import activation, norm, pack_heads  # the fused kernels registering float8::act_*, norm_*, pack_heads_fp8
    from .amax import amax, amax_ref
    from .block_gemm import fp8_block_mm, fp8_block_mm_ref
    from .blockwise import quantize_blockwise, quantize_blockwise_ref
    from .dequantize import dequantize, dequantize_ref
    from .quantize import quantize_tensorwise, quantize_tensorwise_ref
    from .rowwise import quantize_rowwise, quantize_rowwise_ref
    from .rowwise_input_mm import fp8_rowwise_input_mm, fp8_rowwise_input_mm_ref
    from .weight_only import fp8_weight_mm, fp8_weight_mm_ref
else:
    from float8.kernels.common import alias_package as _alias_package

    _alias_package(__name__, "float8.kernels", __path__[0])

__all__ = [
    "activation",
    "norm",
    "pack_heads",
    "amax",
    "amax_ref",
    "quantize_tensorwise",
    "quantize_tensorwise_ref",
    "quantize_rowwise",
    "fp8_rowwise_input_mm",
    "fp8_rowwise_input_mm_ref",
    "quantize_rowwise_ref",
    "quantize_blockwise",
    "quantize_blockwise_ref",
    "dequantize",
    "dequantize_ref",
    "fp8_weight_mm",
    "fp8_weight_mm_ref",
    "fp8_block_mm",
    "fp8_block_mm_ref",
]
