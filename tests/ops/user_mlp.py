"""A pre-norm SwiGLU MLP with a residual, written in plain torch the way users write one (and the same from
float8 ops), for the GPU tests (tests/ops/test_gpu_no_host_sync.py, tests/ops/test_gpu_two_devices.py)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

import float8.ops as ops
from float8 import Recipe

D, FFN = 512, 1024


class UserMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(D)
        self.up = torch.nn.Linear(D, 2 * FFN, bias=False)
        self.down = torch.nn.Linear(FFN, D, bias=True)

    def forward(self, x):
        g, u = self.up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def forced(recipe: Recipe) -> Recipe:
    """The recipe with its small-layer policy off: these small layers take the FP8 path too."""
    return dataclasses.replace(recipe, min_fp8_gemm_flops=0)


def ops_mlp(recipe: Recipe) -> ops.Sequential:
    """The same MLP written from float8 ops (the norm writes FP8 for the Linear after it); the caller moves it."""
    return ops.Sequential(
        ops.Residual(),
        ops.RMSNorm(D),
        ops.Linear(D, 2 * FFN, bias=False),
        ops.SwiGLU(),
        ops.Linear(FFN, D, bias=True),
        ops.AddResidual(),
        recipe=recipe,
    )
