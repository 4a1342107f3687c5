"""Workspace that prepared eager calls keep between calls (kernels/weight_only.py PreparedMM).

A prepared split-K call writes its float32 partial sums to a workspace, and a prepared FP8-input call
(kernels/rowwise_input_mm.py) its quantized rows and their scales; both are written and read inside the one
launch, never across calls. Made afresh per call, each is a `torch.empty`: 5-12 us of host time per call on
the H100 machine's host (.scratch A/B of 2026-11-27: 4096->1024 at 16 tokens 35.7 against 30.1 us; the
FP8-input call at 128 tokens 37.5 against 31.0), paid by every such Linear of an eager decode-size forward,
which waits for the host. A `Scratch` keeps one buffer per (device, stream, host thread, dtype), grown to the
largest call made through it. ops.convert gives all the Linears of a model one `Scratch`: they take turns,
so it holds the largest workspace of any of them, where one per layer would hold their sum: for the
Llama-style model of benchmarks/inference.py after calls of 1-128 tokens (each shape called twice; H100,
2026-11-27, float8.memory_footprint), 8.0 MiB for its weight-only calls and 5.75 MiB with the FP8-input
recipe, against 176 and 103 MiB summed over its layers.

- Launches on one stream run in order, so one launch's workspace is not touched by the next before it ends,
  whichever layer makes it. Two streams, or two host threads (cudaStreamPerThread: one handle, several
  streams), get buffers of their own, as the tile counters do.
- A buffer that grows is replaced; torch's caching allocator hands the old one's memory to later work on
  the same stream only, after what is queued there.
- A CUDA graph must not capture a kept buffer (it could be replaced while the graph lives): the prepared
  calls that use one take the checked path under capture (PreparedMM._stream_key).

ops.Linear counts it in `cached_fp8_tensors` (float8.memory_footprint, once however many layers share it)
and drops it with its prepared calls.
"""

from __future__ import annotations

from typing import Optional

import torch

MAX_BUFFERS = 64  # (device, stream, host thread, dtype) keys kept; the oldest is dropped beyond


class Scratch:
    """Kept workspace buffers, by (device, stream handle, host thread, dtype), for the layers that share it.
    Copies and pickles of it are empty (a copy of a model does not share its original's buffers)."""

    __slots__ = ("buffers",)

    def __init__(self) -> None:
        self.buffers: dict = {}

    def __reduce__(self):
        return (type(self), ())

    def get(self, key: tuple, dtype: torch.dtype, numel: int, device: torch.device) -> Optional[torch.Tensor]:
        """A 1-D `dtype` tensor of at least `numel` elements on `device` for the launches of stream/thread `key`
        (the caller's current stream): the kept one, or a larger one replacing it. None where the allocator
        gives an address that is not 16-byte aligned (Triton specializes on it: the caller's checked path)."""
        k = (key, dtype)
        buf = self.buffers.get(k)
        if buf is not None and buf.numel() >= numel:
            return buf
        if buf is None and len(self.buffers) >= MAX_BUFFERS:
            # The buffer made first; a no-op where another thread has just dropped it.
            self.buffers.pop(next(iter(self.buffers), None), None)
        buf = None  # the old buffer, if any, is freed before its successor is made: the peak holds one
        self.buffers.pop(k, None)
        buf = torch.empty(numel, dtype=dtype, device=device)
        if buf.data_ptr() % 16:
            return None
        self.buffers[k] = buf
        return buf

    def tensors(self) -> list:
        """The buffers held (float8.memory_footprint counts them)."""
        return list(self.buffers.values())

    def clear(self) -> None:
        self.buffers.clear()
