"""In-place writes into a Float8Tensor: re-quantized through the tensor's requantizer, with its transpose
cache kept in step with writes into its bits, or dropped.

    requantize_into(dst, src); requantized(t, values) -> Float8Tensor; check_whole(dst)
    transpose_in_step(t) -> the cache, or None after dropping a stale one
    share_writes(view, src) -> view (counting writes with src); mark_written(t) after the library wrote t

A write means: dequantize, modify, quantize again with a fresh scale in the tensor's own format and layout
(tests/float8/test_inplace_consistency.py), the same way eagerly and compiled, through any alias.

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

from float8.checks import is_whole


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


def check_whole(dst: torch.Tensor) -> None:
    """In-place writes must cover the whole FP8 storage: a part of a tensor shares its scale (and the
    base's transpose) with the rest, which a write through the part would silently corrupt."""
    if not is_whole(dst):
        raise ValueError(
            f"in-place write into a view of a Float8Tensor (shape {tuple(dst.shape)} of a larger tensor): the "
            "view shares its scale and transpose with the whole tensor. Write the whole tensor (e.g. "
            "t.copy_(new_values)), or work on t.dequantize()"
        )


def requantized(t: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` (t's shape, any float dtype) quantized by t's requantizer: t's format and scale layout, a
    fresh scale. ValueError where the requantizer would lay the scales out otherwise than t has them (a
    transposed view of a per-row tensor, whose scales run along its columns)."""
    q = t.requantizer
    fresh = q._quantize(values.to(t.dtype), False)
    if fresh.fp8_dtype != t.fp8_dtype:
        raise ValueError(
            f"in-place write into a {t.fp8_dtype} Float8Tensor: its quantizer {type(q).__name__} writes "
            f"{fresh.fp8_dtype} (a quantizer of one's own whose constructor takes more than its format says so "
            "in constructor_arguments())"
        )
    if fresh._scale_inv.shape != t._scale_inv.shape:
        raise ValueError(
            f"in-place write into a Float8Tensor whose scales (scale_inv {tuple(t._scale_inv.shape)} for data "
            f"{tuple(t.shape)}) are not laid out as its quantizer {type(q).__name__} lays them out "
            f"({tuple(fresh._scale_inv.shape)}): a transposed row-wise or block-scaled tensor, whose scales run "
            "along its columns. Write the tensor it is a view of, or work on t.dequantize()"
        )
    return fresh


def requantize_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Write high-precision `src` into FP8 `dst` in place: same format and layout, fresh scale.

    dst's buffers are written, not replaced, so views and optimizer references stay valid; a cached
    transpose is re-derived from the new bits. dst must be a whole tensor, not a slice of one.
    """
    check_whole(dst)
    if tuple(src.shape) != tuple(dst.shape):
        src = src.expand(dst.shape)
    with torch.no_grad():
        fresh = requantized(dst, src)
        dst._data.copy_(fresh._data)
        dst._scale_inv.copy_(fresh._scale_inv)
        if dst._transpose_raw is not None:
            dst._transpose_raw.copy_(fresh._data.transpose(-2, -1))
    mark_written(dst)
