"""The MLP block of the benchmarks, twice: in plain PyTorch (bf16) and from float8.ops. Timed by the suite
(`python -m benchmarks`, case d) and profiled by `python -m benchmarks.breakdown --mlp`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Bf16MLP(torch.nn.Module):
    """The same block in plain PyTorch: RMSNorm -> Linear(d, 2f) -> SwiGLU -> Linear(f, d)."""

    def __init__(self, d, f):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d, eps=1e-6)
        self.up = torch.nn.Linear(d, 2 * f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        a, b = self.up(self.norm(x)).chunk(2, dim=-1)
        return self.down(F.silu(a) * b)


def fp8_mlp(d, f, recipe=None):
    """The block from float8.ops (recipe: the Sequential's, default Recipe())."""
    import float8.ops as ops

    return ops.Sequential(
        ops.RMSNorm(d), ops.Linear(d, 2 * f, bias=False), ops.SwiGLU(), ops.Linear(f, d, bias=False), recipe=recipe
    )
