"""high_precision(model): run a converted model's Linears in their activation dtype for a while.

For evaluation against the FP8 run, or to debug a loss that moved: every `ops.Linear` of the model runs
`F.linear` in its input's dtype (an FP8-only weight is dequantized for the product, so it stays 1 byte per
parameter in memory), and a Sequential whose Linears all do runs torch's own functions for its ops (the
small-layer path, ops/runner.py). Nothing is converted back, and on exit every Linear runs as before.
The switch is an attribute of each Linear of `model`, set for the duration: no global state, so other
models (and other threads' models) are not affected.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from float8.ops.linear import Linear


@contextlib.contextmanager
def high_precision(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block, the Linears of `model` (an ops.Linear itself, or any module holding them) run their
    GEMMs in the activation dtype instead of FP8. Yields the model. Restored on exit, errors included."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"high_precision takes an nn.Module, got {type(model).__name__}")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    before = [m.__dict__.get("high_precision") for m in linears]
    try:
        for m in linears:
            m.high_precision = True
        yield model
    finally:
        for m, value in zip(linears, before):
            if value is None:
                m.__dict__.pop("high_precision", None)
            else:
                m.high_precision = value
