"""Before/after: the same benchmark cases from two versions of the library, run alternately on one machine.

    python -m benchmarks.before_after --before DIR [DIR ...] --after DIR [DIR ...] [--md OUT.md]

Each DIR holds the latest.json that `python -m benchmarks --cases ... --out DIR` wrote with one version
installed (its bench_* areas; an older version's bench_<gpu>.json is read too). Runs alternate (before,
after, before, after) so clock drift hits both alike; per case, the table gives each side's median time and
memory, after/before, and each side's speedup over its own bf16 baseline (timed in the same process), which
is the drift-free comparison.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics


def _records(dirs):
    out = {}
    for d in dirs:
        runs = []
        for path in glob.glob(os.path.join(d, "bench_*.json")):  # written by versions before benchmarks/results/
            with open(path) as f:
                runs += json.load(f)
        if os.path.exists(os.path.join(d, "latest.json")):
            with open(os.path.join(d, "latest.json")) as f:
                areas = json.load(f)
            runs += [r for area, s in areas.items() if area.startswith("bench_") for r in s["detail"]["records"]]
        for r in runs:
            if r.get("ours_ms") is not None:
                out.setdefault(r["label"], []).append(r)
    return out


def _median(rs, key):
    vals = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def table(before_dirs, after_dirs) -> str:
    before, after = _records(before_dirs), _records(after_dirs)
    rows = [
        "| case | before ms | after ms | after / before | vs bf16 eager before | after | peak MiB before / after |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label in before:
        if label not in after:
            continue
        b, a = before[label], after[label]
        bm, am = _median(b, "ours_ms"), _median(a, "ours_ms")
        bs, as_ = _median(b, "speedup_vs_bf16"), _median(a, "speedup_vs_bf16")
        bp, ap = _median(b, "peak_mem_ours"), _median(a, "peak_mem_ours")
        mem = f"{bp / 2**20:.0f} / {ap / 2**20:.0f}" if bp and ap else ""
        sp = (f"{bs:.2f}x", f"{as_:.2f}x") if bs and as_ else ("", "")
        rows.append(f"| {label} | {bm:.3f} | {am:.3f} | {am / bm:.3f} | {sp[0]} | {sp[1]} | {mem} |")
    return "\n".join(rows)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(prog="python -m benchmarks.before_after", description=__doc__.split("\n")[0])
    p.add_argument("--before", nargs="+", required=True)
    p.add_argument("--after", nargs="+", required=True)
    p.add_argument("--md", default=None, help="also write the table to this file")
    p.add_argument("--json", default=None, help="also write every run's records (label, ms, speedup, memory) here")
    args = p.parse_args(argv)
    text = table(args.before, args.after)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    if args.json:
        keep = ("label", "ours_ms", "bf16_ms", "speedup_vs_bf16", "peak_mem_ours", "fraction_of_floor")
        runs = {
            side: {label: [{k: r.get(k) for k in keep} for r in rs] for label, rs in _records(dirs).items()}
            for side, dirs in (("before", args.before), ("after", args.after))
        }
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return text


if __name__ == "__main__":
    main()
