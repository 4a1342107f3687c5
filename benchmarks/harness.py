"""What every benchmark case shares: one step timer, one peak-memory probe, the environment record and one
report writer (JSON for machines, a markdown table for people). Cases use float8's public API only."""

from __future__ import annotations

import datetime
import gc
import json
import pathlib
import statistics
import time
from typing import Callable, List, Optional

import torch


def free_memory() -> None:
    """Drop what the previous variant left, so each variant's peak is its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def time_steps(step: Callable[[], None], device: torch.device, warmup: int = 2, reps: int = 5) -> float:
    """Median milliseconds of `step` (a whole training step, or any callable) over `reps` calls after
    `warmup` calls. On the GPU each call is bracketed by CUDA events and a synchronize; on the CPU (smoke
    runs that test plumbing, not speed) by the wall clock."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def step_peak_bytes(step: Callable[[], None], device: torch.device) -> Optional[int]:
    """The most memory allocated during one call of `step` (after warm-up calls), or None on the CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


# Kernel-name patterns, in the order they are tried: the first that matches names the group.
KERNEL_GROUPS = [
    ("inductor", ("triton_",)),  # first: inductor's names carry the ops they fuse (rms_norm, ...)
    ("GEMM (cuBLAS)", ("nvjet", "gemm", "xmma", "cutlass")),
    ("attention (SDPA)", ("sdpa", "flash", "fmha", "attention", "cudnn")),
    ("optimizer (foreach)", ("multi_tensor_apply",)),
    ("float8: activations", ("_act_",)),
    ("float8: norms", ("_norm_",)),
    ("float8: casts, amax, transposes", ("_cast", "_amax", "_multi_", "_quantize", "_transpose", "_rowwise", "_block2d", "_pack_heads")),
    ("float8: cross-entropy", ("_ce_",)),
    ("copies and cat", ("CatArray", "copy", "Copy")),
    ("elementwise (ATen)", ("elementwise",)),
    ("reductions (ATen)", ("reduce",)),
]


def kernel_group(name: str) -> str:
    """The KERNEL_GROUPS group a kernel's name falls in ("other" for none)."""
    for group, patterns in KERNEL_GROUPS:
        if any(p in name for p in patterns):
            return group
    return "other"


def kernel_breakdown(step: Callable[[], None], device: torch.device, top: int = 25) -> dict:
    """Where one step's GPU time goes (torch.profiler, ms): `total` of all kernels (against the step's
    wall time, the rest is the GPU waiting), the time of each KERNEL_GROUPS group, and the `top` kernels."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append({"kernel": e.key[:120], "ms": t / 1e3, "calls": e.count})
    rows.sort(key=lambda r: -r["ms"])
    groups: dict = {}
    for r in rows:
        g = kernel_group(r["kernel"])
        groups[g] = groups.get(g, 0.0) + r["ms"]
    return {
        "total_ms": round(sum(r["ms"] for r in rows), 2),
        "groups": {g: round(ms, 2) for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top": [{**r, "ms": round(r["ms"], 3)} for r in rows[:top]],
    }


def environment(device: torch.device) -> dict:
    """Device, date and versions: what a recorded number needs beside it."""
    import triton

    env = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    try:
        import torchao

        env["torchao"] = torchao.__version__
    except ImportError:
        env["torchao"] = None
    return env


def latest_stem(name: str, env: dict) -> str:
    """`<name>_<device>`: the file stem of a benchmark's latest record (older ones go to history/)."""
    return f"{name}_{env['device'].lower().replace(' ', '-')}"


def archive_latest(name: str, out: str, env: dict) -> None:
    """Move the latest record of `name` on this device (every file of its stem) into <out>/history/, named with
    the date its env records, before a new run writes its own."""
    folder = pathlib.Path(out)
    stem = latest_stem(name, env)
    old = folder / f"{stem}.json"
    if not old.exists():
        return
    date = json.loads(old.read_text()).get("env", {}).get("date", "undated")
    (folder / "history").mkdir(parents=True, exist_ok=True)
    for f in folder.glob(f"{stem}.*"):
        f.rename(folder / "history" / f"{stem}_{date}{f.suffix}")
    for f in folder.glob(f"{stem}_*.txt"):
        f.rename(folder / "history" / f"{stem}_{date}{f.name[len(stem):]}")


def write_report(
    name: str, out: str, env: dict, rows: List[dict], columns: List[str], extra: Optional[dict] = None,
    latest: bool = False,
) -> pathlib.Path:  # fmt: skip
    """<out>/<name>_<device>_<date>.json (everything) and .md (the table of `columns`); returns the .md.
    latest: <out>/<name>_<device>.* instead, the latest record (call `archive_latest` once before a run)."""
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    stem = latest_stem(name, env) if latest else f"{latest_stem(name, env)}_{env['date']}"
    (folder / f"{stem}.json").write_text(json.dumps({"env": env, "rows": rows, **(extra or {})}, indent=1))
    lines = [f"# {name}", "", ", ".join(f"{k} {v}" for k, v in env.items()), ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in columns) + " |")
    md = folder / f"{stem}.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def make_timer(cuda: bool, warmup: int = 25, rep: int = 100) -> Callable[[Callable], float]:
    """A kernel timer, milliseconds per call: do_bench's median on the GPU, a wall clock over two calls
    after one warm-up on the CPU (smoke runs, which test plumbing, not speed)."""
    if cuda:
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))

    def wall(fn, n: int = 2) -> float:
        fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e3

    return wall


def host_us(fn: Callable[[], None], n: int = 300, warmup: int = 30) -> float:
    """Microseconds per call of a stream of `n` calls of fn on small inputs (GPU work negligible, so the
    host is the bottleneck): launch overhead and Python, not GPU time. Synchronizes before and after."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t) / n * 1e6
