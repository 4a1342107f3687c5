"""What ops.convert attaches around a converted model's own code: the base of its hook owners.

An owner (ops/saved_outputs.py's SavedOutputs, ops/swiglu_fusion.py's SwiGLUFusion) registers its bound
methods as module hooks on a model and on the model's ops.Linear modules; its state lasts one forward, so a
copy or a pickle of the model carries only its settings (`min_numel`).
"""

from __future__ import annotations

from typing import Optional, TypeVar

import torch

__all__ = ["ModelHooks"]

_Owner = TypeVar("_Owner", bound="ModelHooks")


class ModelHooks:
    """Base of the objects ops.convert attaches to a model: finding, pickling and removing them."""

    min_numel: int

    def _reset(self) -> None:
        """Drop the state of a forward in progress (and the last forward's statistics)."""
        raise NotImplementedError

    def __getstate__(self) -> dict:
        return {"min_numel": self.min_numel}

    def __setstate__(self, state: dict) -> None:
        self.min_numel = state["min_numel"]
        self._reset()

    def detach(self, model: torch.nn.Module) -> None:
        """Remove this object's hooks from every module of `model`."""
        for m in model.modules():
            for table in (m._forward_pre_hooks, m._forward_hooks):
                for hook_id in [k for k, h in table.items() if getattr(h, "__self__", None) is self]:
                    del table[hook_id]
                    m._forward_hooks_always_called.pop(hook_id, None)

    @classmethod
    def of(cls: type[_Owner], model: torch.nn.Module) -> Optional[_Owner]:
        """The object of this class attached to `model` itself (by its forward pre-hook), or None."""
        for hook in model._forward_pre_hooks.values():
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, cls):
                return owner
        return None

    @classmethod
    def detach_all(cls, model: torch.nn.Module) -> None:
        """Remove every object of this class attached to `model` or to any module in it."""
        for m in model.modules():
            found = cls.of(m)
            while found is not None:
                found.detach(model)
                found = cls.of(m)
