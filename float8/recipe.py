"""Scaling recipes: what granularity and format to quantize with. Frozen, validated, stateless.

A recipe describes how the *next* FP8 tensor is made; it never owns or changes a tensor that exists
(the scale-inverse travels with the FP8 bits, see float8/tensor.py). It names a format and one scaling
per role (the dataclasses of float8/scaling.py, exported here too) and builds the quantizers that do the
work (`Recipe.quantizers()`, float8/quantizer.py): the top of the tensor/quantizer/recipe layers, which
import downwards only. The one piece of state, the amax history of delayed scaling, lives in a
`DelayedScalingState` (a quantizer) owned by whoever quantizes (an op), and is updated on the device with
no host sync.

    Float8Tensor.quantize(x)                                   # per-tensor current scaling, E4M3
    Float8Tensor.quantize(x, scaling=RowwiseScaling())         # one scale per row
    Float8Tensor.quantize(w, scaling=BlockwiseScaling((128, 128)))
    state = DelayedScalingState(DelayedScaling(history_len=16)); Float8Tensor.quantize(x, scaling=state)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from float8.kernels.reference import fp8_max, max_margin
from float8.quantizer import LinearQuantizers, Quantizer, quantizer_for
from float8.scaling import BlockwiseScaling, DelayedScaling, RowwiseScaling, Scaling, TensorwiseScaling


class Format(enum.Enum):
    """FP8 formats for the forward pass (activations, weights) and the backward pass (gradients).

    E4M3 has more precision (3 mantissa bits, max 448); E5M2 more range (max 57344). HYBRID, the usual
    training choice, uses E4M3 forward and E5M2 for gradients, whose range is wider.
    """

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    HYBRID = "hybrid"

    @property
    def forward_dtype(self) -> torch.dtype:
        """The FP8 dtype of activations and weights."""
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    @property
    def backward_dtype(self) -> torch.dtype:
        """The FP8 dtype of gradients."""
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2


def _check_role_quantizer(role: str, q: Quantizer, fp8: torch.dtype) -> None:
    """A quantizer given for a recipe role: stateless (every Linear of the recipe shares it), and of the
    role's format."""
    if isinstance(q, torch.nn.Module):
        raise TypeError(
            f"Recipe.{role}: {type(q).__name__} keeps state (a scale or an amax history) that one op owns, and a "
            "recipe is shared by every Linear built from it; give a scaling dataclass, or set the op's quantizer"
        )
    if q.fp8_dtype != fp8:
        raise ValueError(
            f"Recipe.{role}: the quantizer writes {q.fp8_dtype}, but this recipe's format gives the {role} role {fp8}"
        )


@dataclass(frozen=True)
class Recipe:
    """Which format and scaling each role of a Linear uses. Hand it to ops or to `Sequential`.

    Defaults: HYBRID format (E4M3 forward, E5M2 gradients), per-tensor current scaling everywhere, fast
    accumulation in the forward GEMM, and small Linears (GEMMs under 3e11 FLOPs) left in high precision
    on CUDA.
    """

    format: Format = Format.HYBRID
    # A scaling dataclass per role, or a stateless Quantizer of the role's format (a granularity of your
    # own: tests/float8/test_new_granularity.py), shared by every Linear built from the recipe.
    input: Union[Scaling, Quantizer] = field(default_factory=TensorwiseScaling)
    weight: Union[Scaling, Quantizer] = field(default_factory=TensorwiseScaling)
    grad: Union[Scaling, Quantizer] = field(default_factory=TensorwiseScaling)
    # Forward GEMM with cuBLASLt's fast accumulation (as TransformerEngine and torchao do); gradients
    # always accumulate with float32 promotion.
    fprop_fast_accum: bool = True
    # The small-layer policy, on CUDA: a Linear whose GEMMs do fewer FLOPs than this (2*M*K*N) runs in
    # its activation dtype instead of FP8. Below it FP8 cannot win on the H100 here: the layer is bound
    # by host time (bf16 fwd+bwd at (2048, 4096, 4096): 0.29 ms; FP8: 1.60 ms, H100 2026-11-22,
    # bench_linear of 2026-11-22T01:03 in benchmarks/results/history.csv). 0 disables it.
    min_fp8_gemm_flops: float = 3e11
    # Lean activation memory, for training steps whose peak is set by activations:
    # - GELU, SiLU and SwiGLU keep their input for backward as E4M3 with one per-tensor scale (1 byte per
    #   element, written by the forward kernel beside its FP8 output), not in the activation dtype; ReLU
    #   keeps its input (its derivative jumps at 0, where a rounded input flips it).
    # - A Linear takes its FP8 input and its FP8 gradient in rows only (the layout of the forward and the
    #   input-gradient GEMMs) and makes the transpose its weight-gradient GEMM reads in the backward, when
    #   that GEMM runs: the two layouts of one tensor are never alive together.
    # (Every recipe, lean or not: under per-tensor current scaling a Linear keeps no FP8 copy of its trained
    # weight from the forward to the backward, which quantizes the weight again; docs/design.md section 5.)
    # The forward's bits do not change, nor do ReLU's gradients. Numerics and cost: docs/design.md, "Lean activation memory".
    lean_activations: bool = False
    # Inference with FP8-only weights: from this many tokens up to 128 a converted Linear quantizes x per
    # row and runs an FP8 x FP8 kernel (kernels/rowwise_input_mm.py: the quantization inside the GEMM's launch
    # on a prepared eager call, half the MMA work of the weight-only kernel that serves fewer tokens). The
    # default, 129, leaves it off: eagerly, where these sizes wait for the host, it was at best level with
    # the weight-only kernel (H100 machine, 2026-11-26, Llama-style model at 33 / 64 / 128 tokens, four
    # runs: 0.76-0.97x / 0.79-0.94x / 0.78-0.89x bf16 eager against 0.83-0.97x for the weight-only kernel).
    # Under CUDA graphs (ops.graphed_inference), where host time does not count, 17 is faster: 1.43x / 1.42x
    # bf16 graphed at 24 / 32 tokens against 1.20x / 1.19x for the weight-only kernel (2026-11-27, area
    # inference_graphed_17_32), 1.36x / 1.27x against 1.11x / 0.93-0.95x at 64 / 128
    # (benchmarks/results/profile_rowwise_input_inference.txt); at 16 tokens the weight-only kernel is
    # ahead. Eager, graphed and compiled calls of one recipe give the same bits.
    inference_fp8_input_from: int = 129

    def __post_init__(self):
        if not (isinstance(self.min_fp8_gemm_flops, (int, float)) and self.min_fp8_gemm_flops >= 0):
            raise ValueError(f"min_fp8_gemm_flops must be a number >= 0, got {self.min_fp8_gemm_flops!r}")
        if type(self.inference_fp8_input_from) is not int or self.inference_fp8_input_from < 1:
            raise ValueError(f"inference_fp8_input_from must be an int >= 1, got {self.inference_fp8_input_from!r}")
        if not isinstance(self.lean_activations, bool):
            raise TypeError(f"lean_activations must be a bool, got {self.lean_activations!r}")
        if not isinstance(self.format, Format):
            raise TypeError(f"format must be a float8.Format, got {self.format!r}")
        if self.format is Format.E5M2:
            raise ValueError(
                "Recipe(format=Format.E5M2) would make every GEMM E5M2 x E5M2, which the tensor cores cannot "
                "run: use Format.HYBRID (E4M3 forward, E5M2 gradients) or Format.E4M3"
            )
        for role in ("input", "weight", "grad"):
            s = getattr(self, role)
            fp8 = self.format.backward_dtype if role == "grad" else self.format.forward_dtype
            if isinstance(s, Quantizer):
                _check_role_quantizer(role, s, fp8)
                continue
            if not isinstance(s, (TensorwiseScaling, RowwiseScaling, BlockwiseScaling, DelayedScaling)):
                raise TypeError(
                    f"Recipe.{role} must be a scaling dataclass or a stateless Quantizer, got {type(s).__name__}"
                )
            if s.margin > max_margin(fp8):
                raise ValueError(
                    f"Recipe.{role} has margin {s.margin}, too large for {fp8}: every value would round to 0 "
                    f"(the largest margin for this format is {max_margin(fp8)})"
                )

    def quantizers(
        self,
        *,
        device: Union[torch.device, str, None] = None,
        amax_group: Optional[torch.distributed.ProcessGroup] = None,
    ) -> LinearQuantizers:
        """The (input, weight, grad) quantizers this recipe describes (float8.quantizer.LinearQuantizers).

        Delayed scaling gives new DelayedScalingState modules on `device` (default: the CPU; the caller owns
        their history); amax_group: a process group over which per-tensor amaxes are reduced, or None.
        """
        fwd, bwd = self.format.forward_dtype, self.format.backward_dtype
        dev = torch.device("cpu") if device is None else device
        for role in ("input", "weight", "grad"):
            q = getattr(self, role)
            if isinstance(q, Quantizer) and amax_group is not None and getattr(q, "amax_group", None) is not amax_group:
                raise ValueError(
                    f"Recipe.{role} is a {type(q).__name__} given as it is, which cannot reduce its amax over the "
                    "op's amax_group (tensor parallelism agrees scales over it): give a scaling dataclass"
                )
        return LinearQuantizers(
            quantizer_for(self.input, fwd, device=dev, amax_group=amax_group),
            quantizer_for(self.weight, fwd, device=dev, amax_group=amax_group),
            quantizer_for(self.grad, bwd, device=dev, amax_group=amax_group),
        )

    @classmethod
    def tensorwise(cls, format: Format = Format.HYBRID) -> "Recipe":
        """Per-tensor current scaling everywhere (the default recipe)."""
        return cls(format)

    @classmethod
    def delayed(
        cls, format: Format = Format.HYBRID, history_len: int = 1024, amax_compute_algo: str = "max"
    ) -> "Recipe":
        """Per-tensor delayed scaling (an amax history per role, kept by the op that quantizes) everywhere."""
        d = DelayedScaling(history_len, amax_compute_algo)
        return cls(format, d, d, d)

    @classmethod
    def rowwise(cls, format: Format = Format.E4M3) -> "Recipe":
        """One scale per row for inputs, weights and gradients (E4M3: cuBLASLt's row-wise mode needs it)."""
        return cls(format, RowwiseScaling(), RowwiseScaling(), RowwiseScaling())

    @classmethod
    def blockwise(cls, format: Format = Format.E4M3) -> "Recipe":
        """DeepSeek-V3 style blocks: 1x128 for inputs and gradients, 128x128 for weights."""
        return cls(format, BlockwiseScaling((1, 128)), BlockwiseScaling((128, 128)), BlockwiseScaling((1, 128)))


__all__ = [
    "Format",
    "TensorwiseScaling",
    "RowwiseScaling",
    "BlockwiseScaling",
    "DelayedScaling",
    "Recipe",
    "fp8_max",
]
