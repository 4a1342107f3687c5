"""The basic-op protocol: a small class with `op_forward(ctx, x, out_request)` / `op_backward(ctx, dy, dx_request)`.

Ops tell each other what they want, so an FP8 tensor is written once, by the kernel that makes the data:
- forward: `input_request()` of the next op is a `QuantRequest` (float8/quantizer.py): "give me FP8 from
  this quantizer (with its transpose, if my backward will read it)". An op with a fused kernel (norms,
  activations) writes FP8 directly when the quantizer `fuses`; otherwise it writes high precision and
  calls `request._quantize`.
- backward: `grad_request()` of the previous op says the same of the gradient it receives; activation and
  bias backwards then fuse dact/dbias with the FP8 cast-transpose of the gradient.

A `Sequential` runs a list of these inside one autograd Function (ops/runner.py), so forward and
backward can fuse across ops (ops/fusion.py).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from float8 import Recipe
from float8.ops.context import OpContext, RunState, plain, second_backward_error, take
from float8.ops.runner import run_ops
from float8.quantizer import QuantRequest

# The recipe of ops given none: a frozen dataclass, so sharing one instance shares no state. Built once:
# a Recipe() per access cost ~3 us, several times per Linear call.
DEFAULT_RECIPE = Recipe()


def is_dtensor(t: object) -> bool:
    """Whether t is a torch.distributed DTensor (False where this torch build has none)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return False  # the common case, without looking the class up
    dtensor = getattr(getattr(torch.distributed, "tensor", None), "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def check_gathered(op: BasicOp, params: list) -> list:
    """params, unless one is still a sharded DTensor: FSDP2's fully_shard on an op that runs inside a
    Sequential, which runs its ops without their forward (so without FSDP's gathering hooks)."""
    if any(is_dtensor(p) for p in params):
        raise ValueError(
            f"{type(op).__name__}'s parameters are sharded DTensors (fully_shard on an op inside a Sequential): "
            "a Sequential runs its ops without their forward, so FSDP never gathers them. Shard the Sequential "
            "(a block) instead, or call the op on its own."
        )
    return params


class BasicOp(torch.nn.Module):
    """Base of all ops. Subclasses implement op_forward / op_backward; parameters via `op_params`."""

    # The quantizers an op holds (a Linear's three); none by default. A class attribute, so that asking
    # every op of a run for them costs no nn.Module attribute miss.
    quantizers: tuple = ()
    # A process group over which the gradients of this op's parameters are summed in backward, or None:
    # set on ops whose parameters are replicated across a sequence-parallel group while each rank sees only
    # its own tokens (norms and biases between the collectives of a tensor-parallel layer).
    grad_sum_group = None
    # Why this op cannot run inside torch.compile, or None (ops/runner.py checks it while tracing).
    not_compilable: Optional[str] = None
    # Whether `torch_forward` exists: the op's plain-torch twin, which a Sequential runs instead of the
    # fused kernels when none of its Linears runs in FP8 (the small-layer policy, ops/runner.py).
    has_torch_forward: bool = False
    # What the runner (ops/runner.py), the fusion matcher (ops/fusion.py) and Sequential must know of an op,
    # declared by the op: the core of ops/ imports no concrete op.
    # The names of the attributes op_forward keeps on its OpContext for op_backward: under torch.compile
    # exactly these are packed through save_for_backward (ops/saved.py), so a name missing here fails there.
    saves: tuple = ()
    # The op's part in the fusion patterns of ops/fusion.py ("linear", "bias", "activation", "norm",
    # "residual"), or None.
    fusion_role: Optional[str] = None
    # A GEMM that the small-layer policy may keep in high precision: the op answers `runs_as_torch(rows,
    # device)`, and a run of ops none of whose GEMMs runs in FP8 takes the plain-torch twins.
    gemm: bool = False
    # A bias that the plain-torch run folds into the F.linear of the GEMM before it.
    folds_into_gemm: bool = False
    # Runs outside the fused Functions under torch.compile (ops.Attention: SDPA under ordinary autograd),
    # through `torch_forward_nd(x)`.
    splits_compiled_run: bool = False
    # +1 for an op that pushes a residual (Residual), -1 for one that pops it (AddResidual).
    residual_step: int = 0
    # The process group whose ranks this op's collective checks hold activations of one shape (the
    # tensor-parallel collectives of ops/parallel.py), or None. Once per run and group; a compiled run
    # split at attention checks in its first part only (ops/runner.py).
    shape_checked_group = None

    def __init__(self):
        super().__init__()
        self._recipe: Optional[Recipe] = None
        self._amax_group = None

    # ---- recipe ----------------------------------------------------------------------------------
    @property
    def recipe(self) -> Recipe:
        """The op's recipe: its own, else the Sequential's, else Recipe()."""
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

    @property
    def amax_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The process group over which this op's per-tensor amaxes are reduced (MAX), or None."""
        return self._amax_group

    def set_amax_group(self, group: Optional[torch.distributed.ProcessGroup], overwrite: bool = False) -> None:
        """Give the op an amax reduction group (a Sequential hands its own to ops that have none)."""
        from float8.quantizer import check_amax_group

        if group is not None or overwrite:
            if self._amax_group is None or overwrite:
                self._amax_group = check_amax_group(group)
                self._recipe_changed()

    # ---- protocol ----------------------------------------------------------------------------------
    def op_params(self) -> List[torch.nn.Parameter]:
        """The parameters whose gradients op_backward returns, in that order."""
        # Straight from _parameters: parameters(recurse=False) walks nn.Module's generic member iterator,
        # 5 us a call under cProfile on the H100 machine's host (benchmarks/host.py --profile), per op per run.
        return check_gathered(self, [p for p in self._parameters.values() if p is not None])

    def input_request(self, grad: bool, tokens: int) -> Optional[QuantRequest]:
        """What this op wants its forward input as; `grad`: whether a backward pass will run; `tokens`:
        the input's rows."""
        return None

    def grad_request(self, ctx: Optional["OpContext"] = None) -> Optional[QuantRequest]:
        """What this op wants the gradient of its output as, given its context of this run (the forward
        may have decided, e.g. a Linear kept in high precision wants a high-precision gradient)."""
        return None

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest]) -> torch.Tensor:
        """y for x (rows, features); FP8 as `out_request` asks where this op can write it, else high
        precision. Saves on `ctx` what op_backward reads."""
        raise NotImplementedError

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest]
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        """Returns (dx, [grad for each of op_params(), None where not needed])."""
        raise NotImplementedError

    def torch_forward(self, x: torch.Tensor, run: "RunState") -> torch.Tensor:
        """y for x (rows, features) with torch's own differentiable functions, high precision in and out
        (`run`: the token dims, and the stack that Residual pushes and AddResidual pops). Only where
        `has_torch_forward`. A parameter kept in another dtype than x (a float32 master weight) gets the
        gradient that op_backward gives it."""
        raise NotImplementedError

    def expand(self) -> List["BasicOp"]:
        """The basic ops this op stands for inside a Sequential (Linear with a bias is Linear + Bias)."""
        return [self]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run this op alone, as a one-op Sequential (same autograd, same fusions)."""
        return run_ops(self.expand(), x)


def sequence_parallel(op: BasicOp, group: Optional[torch.distributed.ProcessGroup]) -> None:
    """Mark op's parameters as replicated over the sequence-parallel `group` (see BasicOp.grad_sum_group)."""
    if group is not None:
        from float8.row_collectives import check_group

        op.grad_sum_group = check_group(group, f"{type(op).__name__} sequence_parallel_group")


__all__ = [
    "BasicOp",
    "QuantRequest",
    "OpContext",
    "RunState",
    "plain",
    "second_backward_error",
    "sequence_parallel",
    "take",
]
