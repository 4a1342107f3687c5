"""Host time of a tiny Linear forward+backward (GPU work negligible), ours against bf16 nn.Linear, eager
and captured in CUDA graphs (torch.cuda.make_graphed_callables), and a cProfile of ours: where the
microseconds go.

    python -m benchmarks.host [--profile]
"""

from __future__ import annotations

import argparse
import copy
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


class Step:
    """One forward+backward of `model` on fixed x, dy; `graphed()` is the same step with the module's
    forward and backward captured once and replayed (torch.cuda.make_graphed_callables: static shapes;
    an FP8 weight is re-quantized inside the graph at every replay)."""

    def __init__(self, model, x, dy, fn=None):
        self.model, self.x, self.dy, self.fn = model, x, dy, fn or model

    def __call__(self):
        self.model.weight.grad = None
        self.x.grad = None
        self.fn(self.x).backward(self.dy)

    def graphed(self) -> "Step":
        model = copy.deepcopy(self.model)  # make_graphed_callables replaces the module's forward
        return Step(model, self.x, self.dy, torch.cuda.make_graphed_callables(model, (self.x,)))


def tiny_linear_steps(m=16, k=64, n=64, recipe=None):
    """(bf16 step, ours step). recipe=Recipe(min_fp8_gemm_flops=0) forces the FP8 path: with the default
    recipe a layer this small runs in bf16 (the small-layer policy)."""
    import float8.ops as ops

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.Linear(k, n, bias=False).to("cuda", torch.bfloat16)
    ours = ops.Linear(k, n, bias=False, recipe=recipe).to("cuda", torch.bfloat16)
    return Step(ref, x, dy), Step(ours, x, dy)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    from float8 import Recipe

    bf16, ours = tiny_linear_steps()
    _, fp8 = tiny_linear_steps(recipe=Recipe(min_fp8_gemm_flops=0))
    b, o, f = host_us(bf16), host_us(ours), host_us(fp8)
    bg, fg = host_us(tiny_linear_steps()[0].graphed()), host_us(fp8.graphed())
    print(f"host us per tiny Linear fwd+bwd: bf16 nn.Linear {b:.1f}, ours (policy: bf16) {o:.1f} ({o / b:.2f}x), "
          f"ours forced FP8 {f:.1f} ({f / b:.2f}x); CUDA graphs: bf16 {bg:.1f}, ours forced FP8 {fg:.1f} ({fg / b:.2f}x of bf16 eager)")
    if args.profile:
        for name, fn in (("policy path", ours), ("forced FP8 path", fp8)):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            prof.disable()
            print(f"--- cProfile, {name}, 200 steps")
            pstats.Stats(prof).sort_stats("cumtime").print_stats(25)
            pstats.Stats(prof).sort_stats("tottime").print_stats(40)
        return b, o
    return b, o


if __name__ == "__main__":
    main()
