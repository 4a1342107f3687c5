"""max|t| of tensors whose producer computed it on the way, for the Linear that quantizes t next.

Per-tensor current scaling reads a tensor twice: an amax pass, then the cast. Where the kernel that wrote the
tensor folded max|t| in (ops/swiglu_fusion.py: the SwiGLU product of a converted model's separate gate and up
projections, kernels/product_amax.py, and that product's backward, kernels/swiglu_pair.py; or of its one
gate-and-up projection, kernels/silu_product.py, and its backward, kernels/activation.py act_bwd_with_amax),
the Linear reading t (the down projection's input; the output gradients of the gate and up projections, or
of the one projection) skips its amax pass: at 16384 tokens x 14336 features one read of 448 MiB each (896
for the one projection's gradient), two or three per block a step.

`KnownAmaxes` holds, per tensor, the amax and what makes it still that tensor's: the tensor itself (weakly,
by identity), its version counter, data pointer, shape, strides and dtype, and the CUDA stream the amax was
written on (read on another, it would need a wait). An entry is taken once (`take`), and goes when its
tensor dies. A write into the tensor since (in place, or through a view) moves its version and the entry is
not used. A write that moves no version counter is not seen: through `.data`, through another tensor `set_`
on the same storage, the storage itself, a DLPack alias or a kernel outside torch. Autograd's saved tensors
miss such writes too (they compute gradients from the new values); here the cast would use the old amax, a
wrong scale, where before this handoff it read the new values. Tensors under functorch transforms (vmap,
`is_grads_batched`: their per-sample amaxes are not one tensor's) are never noted. One per converted model
(ops/convert.py), shared by its Linears and its SwiGLU fusion; not per thread (a backward runs on autograd's
threads). Derived state: a pickled or copied model gets a new, empty one (one per shared object).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

__all__ = ["KnownAmaxes", "tensor_state"]


def tensor_state(t: torch.Tensor) -> tuple:
    """What makes a tensor still the one a derived value was made from: its version counter, data pointer,
    shape, strides, dtype, device, and the current CUDA stream (a value written on one stream is read only on
    that one; another would need a wait). Also the key of ops/linear_train.py's SharedInputCopy."""
    stream = torch.cuda.current_stream(t.device) if t.is_cuda else None
    return (t._version, t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, stream)


def _plain(t: torch.Tensor) -> bool:
    # A tensor with storage of its own: not a batched tensor of vmap or of `is_grads_batched` (whose samples
    # would share one amax), nor a functorch wrapper.
    return torch._C._has_storage(t) and not torch._C._functorch.is_functorch_wrapped_tensor(t)


def _forget(table_ref: weakref.ref, key: int, dead: weakref.ref) -> None:
    # The tensor died: its entry goes. The table is reached weakly (no cycle through the entries).
    table = table_ref()
    if table is not None:
        entry = table._entries.get(key)
        if entry is not None and entry[0] is dead:
            del table._entries[key]


class KnownAmaxes:
    """max|t| for tensors whose producer computed it (see the module docstring): `put` by the producer,
    `take` by the Linear that quantizes t next."""

    def __init__(self):
        self._entries: dict = {}  # id(t) -> (weakref to t, key of t when put, amax)

    def __reduce__(self):
        return (type(self), ())

    def __deepcopy__(self, memo):
        return type(self)()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, t: torch.Tensor, amax: torch.Tensor) -> None:
        """Note that amax (a () float32 tensor on t's device) is max|t| of t as it is now. Tensors made under
        inference_mode (no version counter: a write would not be seen) are not noted."""
        if t.is_inference() or not _plain(t):
            return
        ident = id(t)
        ref = weakref.ref(t, lambda dead, table=weakref.ref(self), key=ident: _forget(table, key, dead))
        self._entries[ident] = (ref, tensor_state(t), amax)

    def take(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """max|t| if noted for this very tensor, unchanged since and on this stream; the entry goes either way."""
        entry = self._entries.pop(id(t), None)
        if entry is None or not _plain(t):
            return None
        ref, key, amax = entry
        if ref() is not t or key != tensor_state(t):
            return None
        return amax
