"""The transpose cache of a Float8Tensor kept in step with writes into its bits, or dropped.

    transpose_in_step(t) -> the cache, or None after dropping a stale one
    share_writes(view, src) -> view (counting writes with src); mark_written(t) after the library wrote t

The cache is stamped, when it is made or re-derived, with (writes, version of the bits, version of the
cache); a read that finds any of them moved drops it, and the GEMM that needs the other layout makes it
again from the bits. Two kinds of write are caught:
- raw writes into `t.fp8_data` or into the cache (`t.t().fp8_data` *is* it): they move the tensors'
  version counters;
- writes through the library (in-place ops, copy_) into any Float8Tensor that aliases the bits (a view:
  `t.view(-1).add_(1)`): they bump `_writes`, a counter shared by all Float8Tensors made as views of one
  another (share_writes). Counters are needed here because views made inside __torch_dispatch__ run
  below autograd and do not share the base's version counter.
Below float8/tensor.py in the import order: it reads a Float8Tensor's fields, it imports nothing of it.
"""

from __future__ import annotations

from typing import Optional

import torch


def _stamp(t: torch.Tensor):
    data, cache = t._data, t._transpose_raw
    if cache is None or data.is_inference() or cache.is_inference() or torch.compiler.is_compiling():
        return None  # inference tensors keep no version counter; a traced graph has no counters to read
    return (t._writes[0], data._version, cache._version)


def transpose_in_step(t: torch.Tensor) -> Optional[torch.Tensor]:
    """t's transpose cache, or None after dropping it if a write moved the bits or the cache since it was
    made. The one place that decides whether a cache is still valid."""
    cache = t._transpose_raw
    if cache is None or t._t_stamp is None or torch.compiler.is_compiling():
        return cache
    if (t._writes[0], t._data._version, cache._version) != t._t_stamp:
        t._transpose_raw = t._t_stamp = None
        return None
    return cache


def share_writes(view: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Make `view`, which aliases src's bits, count its writes with src's (and the other way round)."""
    view._writes = src._writes
    view._t_stamp = _stamp(view)
    return view


def mark_written(t: torch.Tensor) -> None:
    """After the library wrote t's bits (and re-derived t's own cache): every alias's cache is now stale,
    t's own is in step."""
    t._writes[0] += 1
    t._t_stamp = _stamp(t)
