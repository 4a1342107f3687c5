"""python -m benchmarks.gaps [--variants a,b] [--tiny] [--separate-gate-up] [--separate-qkv] [--out DIR]: where the GPU waits inside one training
step of the Llama-style model (benchmarks/step_llama.py variants).

A step's wall time is its kernels' time plus the time the GPU sits idle, waiting for the host to launch
the next kernel. This profiles one step (after warm-up) with CPU and CUDA activity and Python stacks,
finds every idle interval longer than --min-us between kernels, and charges it to the Python line that
launched the kernel after the gap (the profiled op with a Python stack that started last before that
kernel did). CUDA only: on the CPU there are no kernels and the report is empty. Recorded as the area
"gaps" in DIR (default benchmarks/results/; benchmarks.harness.record): idle time and gaps per variant as
figures, the whole report as detail.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Callable, Dict, List

import torch

from benchmarks.llama import TINY, LlamaShape

REPO_DIRS = ("float8/", "benchmarks/", "ops/", "kernels/")


def _where(stack: List[str]) -> str:
    """The innermost frame of a profiled op's stack in this repository's code, else its innermost frame."""
    for frame in stack:
        if any(d in frame for d in REPO_DIRS) and "site-packages/torch" not in frame:
            return frame.split("/")[-1] if "/" in frame else frame
    return stack[0] if stack else "?"


def gpu_gaps(step: Callable[[], None], device: torch.device, min_us: float = 20.0, top: int = 15) -> dict:
    """One step's idle GPU time: total, the `top` gaps, and the idle time per host line (see module doc)."""
    if device.type != "cuda":
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.events()
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    host_ops = [e for e in events if e.device_type == DeviceType.CPU and e.stack]
    if not kernels:
        return {}
    busy_until, gaps = kernels[0].time_range.start, []
    for k in kernels:
        if k.time_range.start - busy_until > min_us:
            gaps.append((busy_until, k.time_range.start, k.name))
        busy_until = max(busy_until, k.time_range.end)
    by_line: Dict[str, float] = {}
    rows = []
    for a, b, name in gaps:
        # The host runs one op at a time: the launcher is the op that started last before the kernel did
        # (an innermost op starts after the ops it runs in).
        before = [e for e in host_ops if e.time_range.start <= b]
        inner = max(before, key=lambda e: e.time_range.start) if before else None
        where = _where(inner.stack) if inner is not None else "?"
        by_line[where] = by_line.get(where, 0.0) + (b - a)
        rows.append(
            {
                "idle_us": round(b - a, 1),
                "before_kernel": name[:80],
                "host_op": inner.name if inner else "?",
                "where": where,
            }
        )
    span = busy_until - kernels[0].time_range.start
    return {
        "span_ms": round(span / 1e3, 2),
        "idle_ms": round(sum(b - a for a, b, _ in gaps) / 1e3, 2),
        "gaps": len(gaps),
        "by_line_ms": {k: round(v / 1e3, 3) for k, v in sorted(by_line.items(), key=lambda kv: -kv[1])[:top]},
        "largest": sorted(rows, key=lambda r: -r["idle_us"])[:top],
    }


def main(argv=None) -> None:
    from benchmarks.harness import add_out_argument, environment, figures_from_rows, free_memory, record
    from benchmarks.step_llama import build_step

    p = argparse.ArgumentParser(prog="python -m benchmarks.gaps", description=__doc__.split("\n")[0])
    p.add_argument("--variants", default="float8 ops eager", help="comma-separated step_llama variants")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the default without CUDA)")
    p.add_argument("--min-us", type=float, default=20.0, help="shortest idle interval counted, in microseconds")
    p.add_argument("--separate-gate-up", action="store_true", help="Hugging Face's MLP (benchmarks.step_llama)")
    p.add_argument("--separate-qkv", action="store_true", help="Hugging Face's attention (benchmarks.step_llama)")
    add_out_argument(p)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = TINY if args.tiny or device.type == "cpu" else LlamaShape()
    s = dataclasses.replace(s, separate_gate_up=args.separate_gate_up, separate_qkv=args.separate_qkv)
    report = {}
    for variant in args.variants.split(","):
        step, _ = build_step(variant, s, device)
        for _ in range(3):
            step()
        report[variant] = gpu_gaps(step, device, args.min_us)
        print(variant, json.dumps(report[variant], indent=1), flush=True)
        del step
        free_memory()
    rows = [{"variant": v, **{k: r[k] for k in ("span_ms", "idle_ms", "gaps") if k in r}} for v, r in report.items()]
    record("gaps", args.out, environment(device), figures_from_rows(rows, "GPU idle in one step"), None, report)


if __name__ == "__main__":
    main()
