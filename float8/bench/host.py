"""Host time of a tiny Linear forward+backward (GPU work negligible), ours against bf16 nn.Linear, and a
cProfile of ours: where the microseconds go.

    python -m float8.bench.host [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def host_us(step, n=300, warmup=30) -> float:
    """Microseconds per call with the GPU idle enough that the host is the bottleneck (tiny shapes)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def tiny_linear_steps(m=16, k=64, n=64):
    import float8.ops as ops

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.Linear(k, n, bias=False).to("cuda", torch.bfloat16)
    ours = ops.Linear(k, n, bias=False).to("cuda", torch.bfloat16)

    def step(model):
        def run():
            model.weight.grad = None
            x.grad = None
            model(x).backward(dy)

        return run

    return step(ref), step(ours)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    bf16, ours = tiny_linear_steps()
    b, o = host_us(bf16), host_us(ours)
    print(f"host us per tiny Linear fwd+bwd: bf16 nn.Linear {b:.1f}, ours {o:.1f} ({o / b:.2f}x)")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            ours()
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    return b, o


if __name__ == "__main__":
    main()
