"""The basic-op protocol: a small class with `op_forward(ctx, x, out_request)` / `op_backward(ctx, dy, dx_request)`.

Ops tell each other what they want, so an FP8 tensor is written once, by the kernel that makes the data:
- forward: `input_request()` of the next op says "give me FP8 of this format and scaling (with its
  transpose, if my backward will read it)". An op that can (norms, activations, Quantize) writes FP8
  directly in its own kernel; one that cannot returns high precision and the consumer quantizes.
- backward: `grad_request()` of the previous op says the same of the gradient it receives; activation and
  bias backwards then fuse dact/dbias with the FP8 cast-transpose of the gradient.

A `Sequential` runs a list of these inside one autograd Function (ops/sequential.py), so forward and
backward can fuse across ops (ops/fusion.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

import torch

from float8 import DelayedScaling, DelayedScalingState, Float8Tensor, Recipe
from float8.recipe import BlockwiseScaling, RowwiseScaling, TensorwiseScaling


# The recipe of ops given none: a frozen dataclass, so sharing one instance shares no state. Built once:
# a Recipe() per access cost ~3 us, several times per Linear call.
DEFAULT_RECIPE = Recipe()


@dataclass(frozen=True)
class QuantRequest:
    """The FP8 form a consumer wants its input (or gradient) in."""

    fp8_dtype: torch.dtype
    scaling: Union[TensorwiseScaling, DelayedScalingState]
    with_transpose: bool

    def quantize(self, x: torch.Tensor) -> Float8Tensor:
        return Float8Tensor._quantize(x, self.fp8_dtype, scaling=self.scaling, with_transpose=self.with_transpose)


class OpContext:
    """What one op saves for its backward; `run` is shared by all ops of one forward (residual stacks)."""

    def __init__(self, run: "RunState", input_requires_grad: bool = True):
        self.run = run
        self.input_requires_grad = input_requires_grad


class RunState:
    """State of one forward/backward of a Sequential: whether a backward pass will run (`grad`: ops
    allocate transposes and save tensors only then), the token dims of the activation (`lead`: ops see
    2-D (tokens, features) tensors), and the residual values going out and gradients coming back."""

    def __init__(self, grad: bool, lead=()):
        self.grad = grad
        self.lead = tuple(lead)
        self.residuals: List[torch.Tensor] = []
        self.residual_grads: List[torch.Tensor] = []


class BasicOp(torch.nn.Module):
    """Base of all ops. Subclasses implement op_forward / op_backward; parameters via `op_params`."""

    def __init__(self):
        super().__init__()
        self._recipe: Optional[Recipe] = None

    # ---- recipe ----------------------------------------------------------------------------------
    @property
    def recipe(self) -> Recipe:
        return self._recipe if self._recipe is not None else DEFAULT_RECIPE

    def set_recipe(self, recipe: Optional[Recipe], overwrite: bool = False) -> None:
        """Give the op a recipe (a Sequential hands its own to ops that have none)."""
        if recipe is not None and not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a float8.Recipe, got {type(recipe).__name__}")
        if self._recipe is None or overwrite:
            self._recipe = recipe
            self._recipe_changed()

    def _recipe_changed(self) -> None:
        pass

    # ---- protocol ----------------------------------------------------------------------------------
    def op_params(self) -> List[torch.nn.Parameter]:
        return [p for p in self.parameters(recurse=False)]

    def input_request(self, grad: bool, tokens: int) -> Optional[QuantRequest]:
        """What this op wants its forward input as; `grad`: whether a backward pass will run; `tokens`:
        the input's rows."""
        return None

    def grad_request(self, ctx: Optional["OpContext"] = None) -> Optional[QuantRequest]:
        """What this op wants the gradient of its output as, given its context of this run (the forward
        may have decided, e.g. a Linear kept in high precision wants a high-precision gradient)."""
        return None

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest]) -> torch.Tensor:
        raise NotImplementedError

    def op_backward(self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest]):
        """Returns (dx, [grad for each of op_params(), None where not needed])."""
        raise NotImplementedError

    def expand(self) -> List["BasicOp"]:
        """The basic ops this op stands for inside a Sequential (Linear with a bias is Linear + Bias)."""
        return [self]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run this op alone, as a one-op Sequential (same autograd, same fusions)."""
        from float8.ops.sequential import run_ops

        return run_ops(self.expand(), x)


def plain(x: torch.Tensor) -> torch.Tensor:
    """High-precision view of an op's input: FP8 tensors are dequantized (an op that wanted FP8 asked for it)."""
    return x.dequantize() if isinstance(x, Float8Tensor) else x


def scaling_state(recipe_scaling, fp8_dtype, owner: torch.nn.Module, name: str, device):
    """The scaling to quantize with: the recipe's dataclass, or for delayed scaling the op's own state module."""
    if isinstance(recipe_scaling, DelayedScaling):
        state = getattr(owner, name, None)
        if state is None or state.recipe != recipe_scaling:
            state = DelayedScalingState(recipe_scaling, device=device)
            owner.add_module(name, state)
        elif state.scale.device != device:
            state.to(device)
        return state
    return recipe_scaling


def per_tensor(scaling) -> bool:
    """Whether a scaling writes one scale per tensor (so an FP8 transpose is the same bits transposed)."""
    return isinstance(scaling, (TensorwiseScaling, DelayedScalingState, DelayedScaling))


__all__ = ["BasicOp", "QuantRequest", "OpContext", "RunState", "plain", "RowwiseScaling", "BlockwiseScaling"]


def wrap_fp8(request: QuantRequest, data, data_t, scale_inv, nominal_dtype) -> Float8Tensor:
    """A Float8Tensor from a fused kernel's outputs (the transpose only if it was asked for and written)."""
    t = data_t if request.with_transpose and data_t is not None and data_t.numel() == data.numel() else None
    return Float8Tensor(data, scale_inv, nominal_dtype, t)


def is_delayed(request: Optional[QuantRequest]) -> bool:
    return request is not None and isinstance(request.scaling, DelayedScalingState)
