"""Host time of tiny forward+backward steps (GPU work negligible), ours against the same bf16 torch modules:
a Linear alone and a Sequential of Linear, RMSNorm, GELU. Variants: bf16 eager; ours eager with the default
recipe (the small-layer policy runs a layer this small in bf16); ours forced onto its FP8 path
(Recipe(min_fp8_gemm_flops=0)); both captured in CUDA graphs (torch.cuda.make_graphed_callables), and a
cProfile of ours: where the microseconds go, by function and by file.

    python -m benchmarks.host [--profile] [--out DIR]

Recorded as the area "host" in DIR (default benchmarks/results/; benchmarks.harness.record), the profiles
as detail.

Targets (issue 11): Sequential eager <= 1.3x bf16 eager host time, forced FP8 <= 2x, graphed <= 1.0x.
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import io
import pstats
import statistics

import torch

from benchmarks.harness import add_out_argument, environment, figures_from_rows, host_us, markdown_table, record


class Step:
    """One forward+backward of `model` on fixed x, dy; `graphed()` is the same step with the module's
    forward and backward captured once and replayed (torch.cuda.make_graphed_callables: static shapes;
    an FP8 weight is re-quantized inside the graph at every replay)."""

    def __init__(self, model, x, dy, fn=None):
        self.model, self.x, self.dy, self.fn = model, x, dy, fn or model
        self.params = list(model.parameters())

    def __call__(self):
        for p in self.params:
            p.grad = None
        self.x.grad = None
        self.fn(self.x).backward(self.dy)

    def graphed(self) -> "Step":
        model = copy.deepcopy(self.model)  # make_graphed_callables replaces the module's forward
        return Step(model, self.x, self.dy, torch.cuda.make_graphed_callables(model, (self.x,)))


def _inputs(m, k, n):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return x, torch.randn(m, n, device="cuda", dtype=torch.bfloat16)


def tiny_linear_steps(m=16, k=64, n=64, recipe=None):
    """(bf16 step, ours step) of one Linear. recipe=Recipe(min_fp8_gemm_flops=0) forces the FP8 path: with
    the default recipe a layer this small runs in bf16 (the small-layer policy)."""
    import float8.ops as ops

    x, dy = _inputs(m, k, n)
    ref = torch.nn.Linear(k, n, bias=False).to("cuda", torch.bfloat16)
    ours = ops.Linear(k, n, bias=False, recipe=recipe).to("cuda", torch.bfloat16)
    return Step(ref, x, dy), Step(ours, x, dy)


def tiny_sequential_steps(m=16, k=64, n=64, recipe=None):
    """(bf16 step, ours step) of Linear -> RMSNorm -> GELU: torch.nn.Sequential against ops.Sequential."""
    import float8.ops as ops

    x, dy = _inputs(m, k, n)
    ref = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False), torch.nn.RMSNorm(n), torch.nn.GELU())
    ours = ops.Sequential(ops.Linear(k, n, bias=False), ops.RMSNorm(n), ops.GELU(), recipe=recipe)
    return Step(ref.to("cuda", torch.bfloat16), x, dy), Step(ours.to("cuda", torch.bfloat16), x, dy)


def measure(rounds: int = 5, calls: int = 100) -> list:
    """Rows {case, variant, us, vs_bf16}: every variant of both cases, timed in `rounds` interleaved rounds
    of `calls` calls each; `us` is a variant's median round and `vs_bf16` the median over rounds of its time
    over bf16 eager's in the same round. The host's speed drifts (bf16 eager read 179-204 us for the tiny
    Linear in three runs of 2026-11-22), so both sides of a ratio come from the same round."""
    from float8 import Recipe

    forced = Recipe(min_fp8_gemm_flops=0)
    rows = []
    for case, make in (("linear", tiny_linear_steps), ("sequential", tiny_sequential_steps)):
        bf16, ours = make()
        _, fp8 = make(recipe=forced)
        variants = {
            "bf16 eager": bf16,
            "ours eager (policy)": ours,
            "ours eager, forced FP8": fp8,
            "bf16 graphed": bf16.graphed(),
            "ours graphed, forced FP8": fp8.graphed(),
        }
        times = {name: [] for name in variants}
        for _ in range(rounds):
            for name, step in variants.items():
                times[name].append(host_us(step, n=calls, warmup=10))
        base = times["bf16 eager"]
        for name, t in times.items():
            ratio = statistics.median(a / b for a, b in zip(t, base))
            rows.append(
                {"case": case, "variant": name, "us": round(statistics.median(t), 1), "vs_bf16": round(ratio, 2)}
            )
    return rows


def profile(step, calls=200) -> str:
    """cProfile of `calls` steps: the top functions by own time, then own time summed per file."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(40)
    per_file = collections.Counter()
    for (path, _, _), (_, _, tottime, _, _) in stats.stats.items():
        per_file[path.split("site-packages/")[-1]] += tottime
    out.write(f"own time per file, us per step ({calls} steps):\n")
    for path, t in per_file.most_common(25):
        out.write(f"{t / calls * 1e6:9.1f}  {path}\n")
    return out.getvalue()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--profile", action="store_true")
    add_out_argument(p)
    args = p.parse_args(argv)
    from float8 import Recipe

    rows = measure()
    for r in rows:
        print(f"{r['case']:11s} {r['variant']:28s} {r['us']:8.1f} us  {r['vs_bf16']:.2f}x bf16 eager")
    profiles = {}
    if args.profile:
        forced = Recipe(min_fp8_gemm_flops=0)
        for name, make, recipe in (
            ("sequential, policy", tiny_sequential_steps, None),
            ("sequential, forced FP8", tiny_sequential_steps, forced),
        ):
            step = make(recipe=recipe)[1]
            for _ in range(20):
                step()
            profiles[name] = profile(step)
            print(f"--- cProfile, {name}\n{profiles[name]}")
    env = environment(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    md = markdown_table(rows, ["case", "variant", "us", "vs_bf16"])
    record("host", args.out, env, figures_from_rows(rows, keys=["case"]), md, {"rows": rows, "profiles": profiles})
    return rows


if __name__ == "__main__":
    main()
