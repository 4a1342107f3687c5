"""The bytes a model really holds, FP8 weights and cached FP8 copies included.

A Float8Tensor reports its nominal dtype (the high-precision dtype it stands for): `element_size()`,
`nbytes` and everything built on them (Hugging Face's `get_memory_footprint()` among others) count an FP8
weight as 2 or 4 bytes per element. That is deliberate: code that allocates "a tensor like this one" gets the
dtype it expects. `memory_footprint(model)` counts what is allocated: the FP8 bits, the scale-inverses, any
transpose cache, and the FP8 weight copies that ops keep between calls.
"""

from __future__ import annotations

from typing import Dict, Iterable

import torch

from float8.tensor import Float8Tensor

__all__ = ["memory_footprint", "tensor_bytes"]


def _parts(t: torch.Tensor) -> Iterable[torch.Tensor]:
    if isinstance(t, Float8Tensor):
        yield t.fp8_data
        yield t.scale_inv
        if t.transpose_cache is not None:
            yield t.transpose_cache
    else:
        yield t


def _count(t: torch.Tensor, seen: Dict[tuple, int]) -> None:
    for part in _parts(t):
        if part.device.type == "meta":
            continue
        # Each storage once: tied weights, views and a Float8Tensor's aliases share one allocation.
        storage = part.untyped_storage()
        seen[(part.device, storage.data_ptr())] = max(seen.get((part.device, storage.data_ptr()), 0), storage.nbytes())


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes allocated for t: a Float8Tensor's FP8 bits, scale-inverse and transpose cache, each storage once."""
    seen: Dict[tuple, int] = {}
    _count(t, seen)
    return sum(seen.values())


def memory_footprint(model: torch.nn.Module, *, buffers: bool = True, caches: bool = True) -> int:
    """Bytes held by model's parameters (and buffers), each storage counted once, FP8 tensors at their real
    size; with caches=True also the FP8 weight copies its ops keep between calls (`cached_fp8_tensors()`
    of float8.ops.Linear). Tensors on the meta device count 0."""
    seen: Dict[tuple, int] = {}
    for p in model.parameters():
        _count(p, seen)
    if buffers:
        for b in model.buffers():
            _count(b, seen)
    if caches:
        for m in model.modules():
            held = getattr(m, "cached_fp8_tensors", None)
            if callable(held):
                for t in held():
                    _count(t, seen)
    return sum(seen.values())
