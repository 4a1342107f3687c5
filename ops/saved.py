"""What a Sequential's ops saved for backward, moved through `ctx.save_for_backward` under torch.compile.

In eager mode each op keeps what its backward reads on its OpContext (ops/base.py), and the backward
takes it from there. Dynamo cannot trace that: a backward may not mutate objects from outside it, and a
tensor reaching the backward through a Python object (not through `save_for_backward`) must not share
storage with any other tensor of the forward, which FP8 tensors and their transposes always do.

So under torch.compile the Sequential's autograd Function packs the contexts after the forward: every
tensor they hold goes into one `save_for_backward` call, and a skeleton (the same structure with numbered
slots) stays on the autograd context. The backward unpacks the skeleton into new contexts, objects of its
own, which it may then mutate. Eager mode does none of this: it costs a walk over every saved value.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from float8 import Float8Tensor
from float8.ops.context import OpContext, RunState


class SavedRecord:
    """Base of a dataclass an op saves for its backward (ops/linear_engine.py LinearSaved): packed field by
    field, in the dataclass's field order (`__match_args__`). Marked by this base, not found with
    dataclasses.is_dataclass, which dynamo 2.11 cannot trace."""

    __slots__ = ()


class _Slot:
    """The place of the i-th saved tensor in a skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _map(value, leaf):
    """value with each tensor or slot in it replaced by leaf(it), through tuples (named ones too), lists and
    the records; anything else as it is."""
    if isinstance(value, (torch.Tensor, _Slot)):
        return leaf(value)
    if isinstance(value, tuple):
        items = [_map(v, leaf) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_map(v, leaf) for v in value]
    if isinstance(value, SavedRecord):
        return type(value)(*[_map(getattr(value, f), leaf) for f in type(value).__match_args__])
    return value


def _pack(value, tensors: List[torch.Tensor], inputs):
    def slot(t):
        # A tensor the forward made is copied: dynamo drops (and then refuses to read in the backward) a
        # saved intermediate that shares storage with another tensor of the forward, and an FP8 tensor's
        # saved layout always does (it is a view of the Float8Tensor's data). The Function's own inputs
        # (the activation, the parameters) are saved as they are.
        tensors.append(t if any(t is i for i in inputs) else t.clone())
        return _Slot(len(tensors) - 1)

    return _map(value, slot)


def _tensors_in(value, out: list) -> None:
    """Append every tensor in value, through tuples, lists and saved records, to out (a walk: nothing is
    rebuilt, unlike `_map`)."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors_in(v, out)
    elif isinstance(value, SavedRecord):
        for f in type(value).__match_args__:
            _tensors_in(getattr(value, f), out)


def held_storages(ctxs: List[OpContext]) -> set:
    """The storages (`storage_key`) of every tensor the contexts hold (any attribute, and the run's residual
    stacks): an in-place write into a tensor over one of them would change what a backward reads. Eager
    only (it reads every attribute of each context, which dynamo cannot iterate); FP8 copies are the op's
    own memory and are skipped. One walk serves every tensor the caller asks about."""
    held, runs = [], {}
    for ctx in ctxs:
        for value in vars(ctx).values():
            if isinstance(value, RunState):
                runs[id(value)] = value
            else:
                _tensors_in(value, held)
    for run in runs.values():
        _tensors_in(run.residuals, held)
    return {storage_key(t) for t in held if type(t) is not Float8Tensor}


def storage_key(t: torch.Tensor) -> tuple:
    """(device, storage address): what `held_storages` holds of a tensor."""
    return t.device, t.untyped_storage().data_ptr()


def pack_contexts(ops: list, ctxs: List[OpContext], inputs: tuple) -> Tuple[List[torch.Tensor], tuple]:
    """(tensors, skeleton): every tensor the contexts hold, and what `unpack_contexts` rebuilds them from.
    Each op's context is packed by the names the op declares (`BasicOp.saves`: dynamo 2.11 cannot iterate a
    context's __dict__); a name an op keeps without declaring it is missing in its compiled backward, which
    then fails on the attribute (AttributeError), not silently. inputs: the autograd Function's tensor
    inputs, saved without a copy."""
    tensors: List[torch.Tensor] = []
    skeleton = []
    for op, ctx in zip(ops, ctxs):
        saved = {k: _pack(getattr(ctx, k), tensors, inputs) for k in op.saves if hasattr(ctx, k)}
        skeleton.append((ctx.input_requires_grad, ctx.first, saved))
    run = ctxs[0].run if ctxs else None
    return tensors, (None if run is None else (run.grad, run.lead), skeleton)


def unpack_contexts(skeleton: tuple, tensors: Sequence[torch.Tensor]) -> List[OpContext]:
    """New contexts holding what `pack_contexts` took, with a new RunState for the backward's residuals."""
    run_args, entries = skeleton
    run = RunState(*run_args) if run_args is not None else None
    ctxs = []
    for input_requires_grad, first, saved in entries:
        ctx = OpContext(run, input_requires_grad, first)
        for k, v in saved.items():
            setattr(ctx, k, _map(v, lambda slot: tensors[slot.index]))
        ctxs.append(ctx)
    return ctxs
