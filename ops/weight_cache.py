"""What an ops.Linear keeps of its weight between calls, derived and never saved: the FP8 copy of a
high-precision weight (`WeightCache`), and an FP8-only weight's prepared decode-size calls (`InferencePlans`,
kernels/weight_only.py PreparedMM). When each is made, read and dropped: ops/linear.py."""

from __future__ import annotations

import copy
import weakref
from typing import Optional, Tuple

import torch

from float8.kernels.scratch import Scratch


class WeightCache:
    """The FP8 copy of a Linear's weight and what it was made from. A plain holder: its fields are written
    on the hot path without nn.Module's attribute machinery, and it is never saved (pickling or copying a
    model drops it: it is derived, and its key holds a weak reference)."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.key = self.storage = self.w8 = self.wd = None

    def __getstate__(self):
        return {}

    def __setstate__(self, state) -> None:
        self.clear()

    @staticmethod
    def _key(w: torch.Tensor):
        # The version counter moves with every in-place update; offset, shape and strides change when
        # `.data` is pointed at another part of the same storage; the storage itself is compared by identity.
        return (w._version, w.storage_offset(), tuple(w.shape), w.stride(), w.dtype, w.device)

    def lookup(self, w: torch.Tensor, for_backward: bool) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
        if self.w8 is None or self.key != self._key(w) or self.storage() is not w.untyped_storage():
            return None
        if for_backward and self.wd is None:
            return None
        return self.w8, (self.wd if for_backward else None)

    def store(self, w: torch.Tensor, w8: torch.Tensor, wd: Optional[torch.Tensor]) -> None:
        # No callback on the weak reference: one that frees tensors while torch deallocates a storage
        # crashed the interpreter (segfault in the CPU suite). Replacing `weight` clears the cache at once
        # (Linear.__setattr__); replacing `weight.data` is seen, and the old copy freed, at the next call.
        self.key, self.storage, self.w8, self.wd = self._key(w), weakref.ref(w.untyped_storage()), w8, wd

    def tensors(self) -> list:
        """The FP8 copies held (for float8.memory_footprint)."""
        return [t for t in (self.w8, self.wd) if t is not None]


class Plans(dict):
    """A Linear's prepared calls by input layout. Derived and never saved: pickling or copying a model drops
    them. Bounded: past MAX layouts they start over (a model serving many prompt lengths keeps the latest)."""

    MAX = 64

    def __reduce__(self):
        return (type(self), ())

    def __deepcopy__(self, memo):
        return type(self)()

    def add(self, key: tuple, prepared: object) -> None:
        """Keep `prepared` for calls of `key`; past MAX layouts the plans made so far are dropped."""
        if len(self) >= self.MAX:
            dict.clear(self)
        self[key] = prepared


class InferencePlans(Plans):
    """An FP8-only weight's prepared inference calls (kernels/weight_only.py PreparedMM), by (input shape,
    dtype), and the workspace they keep (`scratch`, kernels/scratch.py: one object for all the Linears of a
    converted model, ops/convert.py). Derived and never saved: pickling or copying a model drops the plans and
    the buffers (Linears that shared a workspace object share one, empty, in the copy). Bounded: a model
    serving many prompt lengths keeps the latest MAX shapes per Linear; past them the plans are dropped, not
    the workspace, which the model's other layers share and which has the size of the largest call already."""

    def __init__(self):
        super().__init__()
        self.scratch = Scratch()

    def clear(self) -> None:
        """Drop the plans and the kept workspace (the layers sharing it make it again on their next call)."""
        super().clear()
        self.scratch.clear()

    def share(self, scratch: Scratch) -> None:
        """Keep the workspace in `scratch`, shared with other layers. The plans made so far go with this
        layer's own buffers: each plan holds the workspace object it was made with."""
        self.clear()
        self.scratch = scratch

    def __reduce__(self):
        return (type(self), (), {"scratch": self.scratch})

    def __deepcopy__(self, memo):
        new = type(self)()
        new.scratch = copy.deepcopy(self.scratch, memo)  # one copy per shared object, through the memo
        return new
