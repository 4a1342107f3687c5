"""Lean saved outputs: a converted model's Linear outputs that torch ops save for backward, kept as E4M3.

A model written in plain torch.nn saves what its own elementwise code needs for backward: in a Llama MLP,
`F.silu(g) * u` keeps the gate and up projections' outputs g and u in bf16 (2 x 448 MiB per block of
16384 tokens x 14336 features), although they are outputs of Linears that `ops.convert` replaced. Under
`Recipe(lean_activations=True)`, `ops.convert` attaches a `SavedOutputs` to the model it converts: during
a training forward of that model, a tensor that autograd saves and that is (a view of) a converted Linear's
output is kept as an E4M3 Float8Tensor (current scaling, one scale per row, one kernel) and widened back
when the backward reads it; everything else is saved as it is. The high-precision output is then freed
after the forward. ops.SwiGLU under lean activations keeps its input in E4M3 too (one scale per tensor).

The copy is made when autograd saves the tensor, so an in-place write to the output after that does not
reach the backward (which then reads the values the forward used; plain autograd raises instead).

Not applied: under torch.compile (the compiler decides what a graph saves), under no_grad/inference, and
inside a `torch.autograd.graph.saved_tensors_hooks` context of the caller (activation offloading, for
example), whose hooks keep precedence.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from float8 import Float8Tensor, RowwiseScaling

__all__ = ["SavedOutputs", "saved_outputs_of"]

# Smaller saved outputs stay as they are: a quantize and a dequantize launch each cost more than they save.
MIN_NUMEL = 1 << 16


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class _Packed:
    """What autograd holds instead of a saved output: its E4M3 copy and the dtype to widen it back to."""

    __slots__ = ("fp8", "dtype")

    def __init__(self, fp8: Float8Tensor, dtype: torch.dtype):
        self.fp8, self.dtype = fp8, dtype


class SavedOutputs:
    """Keeps the converted Linears' outputs that autograd saves during a model's training forward in E4M3.

    `attach(model, linears)` registers a forward pre-hook and an always-called forward hook on the model
    (the training forward runs inside a saved-tensor hooks context) and a forward hook on each Linear (its
    output is noted); `detach()` removes them. The state of a forward in progress is not pickled.
    `last_forward`: how many saved tensors the latest training forward kept in E4M3, and the bytes that
    saved against keeping them as they were."""

    def __init__(self, min_numel: int = MIN_NUMEL):
        self.min_numel = min_numel
        self._handles: list = []
        self.last_forward = {"tensors": 0, "bytes_saved": 0}
        self._reset()

    def _reset(self) -> None:
        self._contexts: list = []  # one per model forward in progress (None: not applied to that forward)
        self._outputs: dict = {}  # storage address -> weakref to the storage of a converted Linear's output
        self._packed: dict = {}  # _key(saved tensor) -> (weakref to it, _Packed): one copy per tensor

    def __getstate__(self) -> dict:
        return {"min_numel": self.min_numel}

    def __setstate__(self, state: dict) -> None:
        self.min_numel = state["min_numel"]
        self._handles = []
        self.last_forward = {"tensors": 0, "bytes_saved": 0}
        self._reset()

    def attach(self, model: torch.nn.Module, linears: list) -> None:
        """Hooks on `model` (the forward whose saves are kept lean) and on each of `linears`."""
        self._handles.append(model.register_forward_pre_hook(self._enter))
        self._handles.append(model.register_forward_hook(self._exit, always_call=True))
        self._handles.extend(lin.register_forward_hook(self._note) for lin in linears)

    def detach(self) -> None:
        """Remove every hook `attach` registered."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- hooks -------------------------------------------------------------------------------------
    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        ctx = None
        if (
            torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and torch._C._autograd._saved_tensors_hooks_is_enabled()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        ):
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            if not self._contexts:
                self.last_forward = {"tensors": 0, "bytes_saved": 0}
        self._contexts.append(ctx)

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._contexts:
            return
        ctx = self._contexts.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if not self._contexts:  # the copies live on in autograd's graph; these tables only served the forward
            self._outputs.clear()
            self._packed.clear()

    def _note(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._contexts and self._contexts[-1] is not None and isinstance(output, torch.Tensor):
            # The storage's Python object lives exactly as long as the storage (views keep it), unlike the
            # output's own, which a view such as chunk may outlive.
            storage = output.untyped_storage()
            self._outputs[storage.data_ptr()] = weakref.ref(storage)

    def _pack(self, t: torch.Tensor) -> Any:
        if (
            type(t) is not torch.Tensor
            or not t.is_floating_point()
            or t.element_size() < 2
            or t.numel() < self.min_numel
        ):
            return t
        storage = t.untyped_storage()
        ref = self._outputs.get(storage.data_ptr())
        if ref is None or ref() is not storage:  # not an output's storage (or a new one at a freed address)
            return t
        key = _key(t)
        hit = self._packed.get(key)
        if hit is not None and hit[0]() is not None:
            return hit[1]
        with torch.no_grad():
            # Per row: one kernel reads a view such as chunk's halves in place (the per-tensor cast wants
            # contiguous memory, and copying the view first doubled the cost of keeping it).
            fp8 = Float8Tensor.quantize(t, scaling=RowwiseScaling())
        packed = _Packed(fp8, t.dtype)
        self._packed[key] = (weakref.ref(t), packed)
        self.last_forward["tensors"] += 1
        self.last_forward["bytes_saved"] += t.numel() * (t.element_size() - 1) - 4 * fp8.scale_inv.numel()
        return packed

    @staticmethod
    def _unpack(p: Any) -> torch.Tensor:
        if isinstance(p, _Packed):
            with torch.no_grad():
                return p.fp8.dequantize(p.dtype)
        return p


def saved_outputs_of(model: torch.nn.Module) -> Optional[SavedOutputs]:
    """The SavedOutputs that `ops.convert` attached to `model`, or None."""
    for hook in model._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, SavedOutputs):
            return owner
    return None
