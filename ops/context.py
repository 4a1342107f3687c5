"""What the ops of one run share with the runner: the per-op context, the run's state, and the helpers a
backward uses to let go of what its forward saved. The bottom of ops/: it imports no op and no runner."""

from __future__ import annotations

from typing import Any, List

import torch

from float8 import Float8Tensor


class OpContext:
    """What one op saves for its backward; `run` is shared by all ops of one forward (residual stacks)."""

    def __init__(self, run: "RunState", input_requires_grad: bool = True, first: bool = False):
        self.run = run
        self.input_requires_grad = input_requires_grad
        self.first = first  # the first op of the run: its input comes from outside the Sequential


class RunState:
    """State of one forward/backward of a Sequential: whether a backward pass will run (`grad`: ops
    allocate transposes and save tensors only then), the token dims of the activation (`lead`: ops see
    2-D (tokens, features) tensors), and the residual values going out and gradients coming back."""

    def __init__(self, grad: bool, lead=(), shapes_agreed=()):
        self.grad = grad
        self.lead = tuple(lead)
        self.residuals: List[torch.Tensor] = []
        self.residual_grads: List[torch.Tensor] = []
        # Names of the process groups whose ranks were found to hold activations of one shape in this run
        # (ops/parallel.py), or in an earlier part of a compiled run split at attention.
        self.shapes_agreed: set = set(shapes_agreed)


def keeps_graph() -> bool:
    """Whether the backward running now keeps its autograd graph (`loss.backward(retain_graph=True)`):
    what the forward saved must then stay for a later backward through the same graph. False outside a
    backward (no graph task: torch answers True there), and while traced (torch.compile's backward graph
    is its own, and dynamo cannot trace these queries)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1 and torch._C._autograd._get_current_graph_task_keep_graph()


def take(holder: object, *names: str) -> Any:
    """Read attributes a backward consumes (what its forward saved) and let them go: set to None, so the
    tensors are freed as soon as the backward is done with them, not when the autograd graph dies.

    Kept where the backward keeps its graph (`retain_graph=True`, `keeps_graph`): a second backward reads
    them again, as torch's own ops' saved tensors. Under torch.compile nothing is written: dynamo refuses a
    backward that mutates an object from outside it, and the compiled graph frees its own intermediates.
    One name gives its value, several a tuple."""
    values = tuple(getattr(holder, n) for n in names)
    if not (torch.compiler.is_compiling() or keeps_graph()):
        for n in names:
            setattr(holder, n, None)
    return values[0] if len(names) == 1 else values


def second_backward_error(what: str) -> RuntimeError:
    """The error of a second backward through one graph (`loss.backward(retain_graph=True)` twice)."""
    return RuntimeError(
        f"{what}: a second backward through the same graph. float8 ops let go of what they saved for the "
        "backward (FP8 activations, weight copies) as soon as a backward without retain_graph=True has read "
        "it, so that no FP8 copy outlives its use. Pass retain_graph=True to every backward but the last (as "
        "torch's own ops need), or run the forward again for each backward."
    )


def plain(x: torch.Tensor) -> torch.Tensor:
    """High-precision view of an op's input: FP8 tensors are dequantized (an op that wanted FP8 asked for it)."""
    return x.dequantize() if isinstance(x, Float8Tensor) else x


__all__ = ["OpContext", "RunState", "keeps_graph", "plain", "second_backward_error", "take"]
