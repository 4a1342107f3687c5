"""What every benchmark case shares: one step timer, one peak-memory probe, the environment record and one
results writer (`record`: benchmarks/results/latest.json for machines, latest.md for people, history.csv
for every figure ever recorded). Cases use float8's public API only."""

from __future__ import annotations

import csv
import datetime
import gc
import io
import json
import pathlib
import statistics
import subprocess
import sys
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


def time_back_to_back(step: Callable[[], None], device: torch.device, steps: int = 8) -> float:
    """Milliseconds per step of `steps` calls run back to back, one synchronize after the last: a training
    loop that does not wait on the GPU every step (no `loss.item()`), where an eager step's host runs ahead.
    time_steps synchronizes before each step instead, so an eager step starts with its host behind."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / steps


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
    (
        "float8: casts, amax, transposes",
        ("_cast", "_amax", "_multi_", "_quantize", "_transpose", "_rowwise", "_block2d", "_pack_heads"),
    ),
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


def kernel_breakdown(step: Callable[[], None], device: torch.device, top: int = 40) -> dict:
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
    """Device, date, versions, the command and the commit: what a recorded number needs beside it."""
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
    env["command"] = command_line()
    return env


# ----------------------------------------------------------------------------------------------------------
# Results: one folder per run (benchmarks/results/ by default, or --out), the same layout everywhere.
#   latest.json  {area: section}: each area's last run (device, date, versions, command, commit, figures,
#                its markdown and its full record under "detail"); a run rewrites its own areas only
#   latest.md    the same for people, regenerated from latest.json
#   history.csv  one row per figure ever recorded: HISTORY_COLUMNS, appended by every run

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]
HISTORY_COLUMNS = ["date", "commit", "device", "area", "case", "variant", "metric", "value"]
ENV_KEYS = ["device", "date", "torch", "triton", "torchao", "command", "commit"]
_APPENDED: dict = {}  # (history.csv, area) -> the lines this process appended last for that area


def add_out_argument(parser) -> None:
    """`--out DIR` (also spelled `--json`, its older name) on a benchmark's argument parser: see results_dir."""
    parser.add_argument(
        "--out",
        "--json",
        dest="out",
        default=None,
        help="results folder (default benchmarks/results/; a file path given stands for its folder)",
    )


def results_dir(out: Optional[str] = None) -> pathlib.Path:
    """Where a run's results go: benchmarks/results/ unless given; a file path given (an old `--out x.json`
    or `--json x.json`) stands for its folder."""
    if out is None:
        return RESULTS
    path = pathlib.Path(out)
    return path.parent if path.suffix in (".json", ".md", ".txt", ".csv") else path


def command_line(argv: Optional[List[str]] = None, module: Optional[str] = None) -> str:
    """This process's command line as one would type it (`python -m benchmarks.x ...`); `module` names the
    module when it is known (a benchmark run in-process from another)."""
    argv = list(sys.argv if argv is None else argv)
    if module is None and argv and argv[0]:
        try:
            rel = pathlib.Path(argv[0]).resolve().relative_to(ROOT).with_suffix("")
            module = ".".join(rel.parts).removesuffix(".__main__")
        except ValueError:
            return " ".join(["python", *argv])
    return " ".join([f"python -m {module}", *argv[1:]]).strip()


def git_commit() -> str:
    """The checkout's short commit, or "unknown" (a copy of the tree without its git folder)."""
    try:
        command = ["git", "rev-parse", "--short", "HEAD"]
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def _date(value) -> str:
    """YYYY-MM-DD, or YYYY-MM-DDTHH:MM where the record has the time (UTC in the suite's records)."""
    text = str(value or datetime.date.today().isoformat())
    return text[:16] if "T" in text else text[:10]


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # NaN is no figure


def figure(case: str, variant: str, metric: str, value) -> dict:
    return {"case": str(case), "variant": str(variant), "metric": str(metric), "value": value}


def figures_from_rows(rows: List[dict], case: str = "", keys: List[str] = (), variant: str = "variant") -> List[dict]:
    """One figure per number of each row: the row's `keys` (with `case` before them; a key named "case" by
    its value alone) name its case, its `variant` field the variant, every other numeric field is a metric
    (lists, text and flags are not)."""
    out = []
    for row in rows:
        names = [case] if case else []
        names += [str(row[k]) if k == "case" else f"{k} {row[k]}" for k in keys if row.get(k) is not None]
        name = ", ".join(names)
        for metric, value in row.items():
            if metric not in keys and metric != variant and _number(value):
                out.append(figure(name, row.get(variant, ""), metric, value))
    return out


def markdown_table(rows: List[dict], columns: List[str]) -> str:
    """A markdown table of `columns` (a missing or None cell is empty)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.5g}"
    return str(v)


def figures_markdown(figures: List[dict]) -> str:
    """Figures as tables, one per case: a row per variant, a column per metric."""
    cases: dict = {}
    for f in figures:
        cases.setdefault(f["case"], {}).setdefault(f["variant"], {})[f["metric"]] = f["value"]
    parts = []
    for case, variants in cases.items():
        metrics = list(dict.fromkeys(m for v in variants.values() for m in v))
        rows = [{"variant": v, **{m: _cell(x) for m, x in ms.items()}} for v, ms in variants.items()]
        parts.append((f"{case}:\n\n" if case else "") + markdown_table(rows, ["variant", *metrics]))
    return "\n".join(parts)


def section(env: dict, figures: List[dict], markdown: Optional[str] = None, detail=None, files=()) -> dict:
    """One area's entry of latest.json: the environment first (ENV_KEYS, then any other versions env
    holds), then its figures, its markdown, its full record and the extra files it wrote beside it."""
    s = {k: env.get(k) for k in ENV_KEYS}
    s["date"] = _date(env.get("date"))
    s["command"] = env.get("command") or command_line()
    s["commit"] = env.get("commit") or git_commit()
    s.update({k: v for k, v in env.items() if k not in s})
    s["figures"] = figures
    if markdown:
        s["markdown"] = markdown
    if detail is not None:
        s["detail"] = detail
    if files:
        s["files"] = list(files)
    return s


def history_rows(area: str, s: dict) -> List[List[str]]:
    """The history.csv rows of one section, a row per figure."""
    return [
        [
            s["date"],
            s.get("commit") or "unknown",
            s["device"],
            area,
            f["case"],
            f["variant"],
            f["metric"],
            f"{f['value']:.6g}" if isinstance(f["value"], float) else str(f["value"]),
        ]
        for f in s["figures"]
    ]


def _csv_lines(rows: List[List[str]]) -> List[str]:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue().splitlines(keepends=True)


def append_history(folder: pathlib.Path, lines: List[str], replace: List[str] = ()) -> None:
    """Append csv `lines` to <folder>/history.csv (its header first if new), after taking out one occurrence
    of each line of `replace` (what an earlier write of the same run appended)."""
    path = folder / "history.csv"
    old = path.read_text().splitlines(keepends=True) if path.exists() else _csv_lines([HISTORY_COLUMNS])
    for line in reversed(replace):
        for i in range(len(old) - 1, 0, -1):
            if old[i] == line:
                del old[i]
                break
    path.write_text("".join(old + list(lines)))


def load_latest(folder: pathlib.Path) -> dict:
    path = folder / "latest.json"
    return json.loads(path.read_text()) if path.exists() else {}


def save_latest(folder: pathlib.Path, latest: dict) -> pathlib.Path:
    """Write latest.json (areas in name order) and regenerate latest.md from it; returns latest.md."""
    latest = {area: latest[area] for area in sorted(latest)}
    (folder / "latest.json").write_text(json.dumps(latest, indent=1, default=str) + "\n")
    md = folder / "latest.md"
    md.write_text(latest_markdown(latest))
    return md


def _demote(markdown: str, levels: int = 2) -> str:
    """A section's own headings, moved under latest.md's area heading (not inside code blocks)."""
    out, fenced = [], False
    for line in markdown.splitlines():
        fenced ^= line.startswith("```")
        out.append("#" * levels + line if line.startswith("#") and not fenced else line)
    return "\n".join(out)


def latest_markdown(latest: dict) -> str:
    lines = [
        "# Benchmark results, latest run of each area",
        "",
        "Written by the benchmarks (benchmarks/harness.py `record`) from latest.json; every figure of every",
        "run is also a row of history.csv (README tables: `python -m benchmarks.readme_tables`).",
    ]
    for area, s in latest.items():
        env = ", ".join(f"{k} {s[k]}" for k in ("torch", "triton", "torchao") if s.get(k))
        where = f"{s['device']}, {s['date']}, {env}; commit {s.get('commit')}; `{s['command']}`"
        lines += ["", f"## {area}", "", where, ""]
        lines.append(_demote(s["markdown"]).rstrip() if s.get("markdown") else figures_markdown(s["figures"]).rstrip())
    return "\n".join(lines) + "\n"


def record(
    area: str, out: Optional[str], env: dict, figures: List[dict], markdown: Optional[str] = None, detail=None, files=()
) -> pathlib.Path:
    """Record one area's run in the results folder `out` (benchmarks/results/ when None): its section of
    latest.json replaced (the other areas kept), latest.md regenerated, its figures appended to history.csv.
    Written again by the same process (a report rewritten as a run goes), the area's rows of the earlier
    write are replaced, not repeated. A CPU run (a smoke test of the plumbing) goes into benchmarks/results/
    only when `out` names it. Returns latest.md."""
    folder = results_dir(out)
    if out is None and env.get("device") == "cpu":
        print(f"a CPU run is not recorded in {folder} unless --out names it ({area})")
        return folder / "latest.md"
    folder.mkdir(parents=True, exist_ok=True)
    s = section(env, figures, markdown, detail, files)
    latest = load_latest(folder)
    latest[area] = s
    key = (str((folder / "history.csv").resolve()), area)
    lines = _csv_lines(history_rows(area, s))
    append_history(folder, lines, replace=_APPENDED.get(key, ()))
    _APPENDED[key] = lines
    return save_latest(folder, latest)


def write_report(
    name: str,
    out: Optional[str],
    env: dict,
    rows: List[dict],
    columns: List[str],
    extra: Optional[dict] = None,
    markdown: str = "",
    keys: Optional[List[str]] = None,
    case: str = "",
) -> pathlib.Path:
    """`record` for a benchmark whose result is a list of rows: the area `name` gets the table of `columns`
    (then `markdown`), a figure per number of each row (its case named by `keys`, by default the columns
    before "variant", or `case`), and rows plus `extra` as its detail. Returns latest.md."""
    if keys is None:
        keys = columns[: columns.index("variant")] if "variant" in columns else []
    figures = figures_from_rows(rows, case or ("" if keys else name), keys)
    text = markdown_table(rows, columns) + (markdown or "")
    return record(name, out, env, figures, text, {"rows": rows, **(extra or {})})


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
