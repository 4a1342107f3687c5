"""python -m benchmarks.record DIR [DIR ...] [--into benchmarks/results]: bring results written elsewhere
(a run with `--out DIR` on the GPU machine, its folder copied back) into the results folder.

Each DIR holds what benchmarks.harness.record writes: latest.json, history.csv (latest.md is regenerated).
Every area of DIR's latest.json replaces that area in the target's (the others stay), DIR's history rows
are appended to the target's history.csv (a row already there is not added twice), and the extra files
that travel with results (EXTRA_FILES, when DIR has them) are copied over. DIRs are taken in the order
given, so with two runs of one area the later DIR's stays.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys

from benchmarks.harness import RESULTS, append_history, load_latest, save_latest

# Undated files beside latest.json that README/docs show or that a run leaves for people to read.
EXTRA_FILES = ["bench.png", "gpu_tier.log"]


def merge(source: pathlib.Path, into: pathlib.Path = RESULTS) -> list:
    """Merge one results folder into another; returns the areas taken."""
    new = load_latest(source)
    if not new and not (source / "history.csv").exists():
        raise FileNotFoundError(f"{source} holds neither latest.json nor history.csv")
    into.mkdir(parents=True, exist_ok=True)
    latest = load_latest(into)
    latest.update(new)
    if (source / "history.csv").exists():
        have = (
            set((into / "history.csv").read_text().splitlines(keepends=True))
            if (into / "history.csv").exists()
            else set()
        )
        rows = (source / "history.csv").read_text().splitlines(keepends=True)[1:]  # its header is ours
        append_history(into, [r if r.endswith("\n") else r + "\n" for r in rows if r not in have])
    for name in EXTRA_FILES:
        if (source / name).exists() and (source / name).resolve() != (into / name).resolve():
            shutil.copyfile(source / name, into / name)
    save_latest(into, latest)
    return sorted(new)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.record", description=__doc__.split("\n")[0])
    p.add_argument("dirs", nargs="+", help="results folders to take in, in order")
    p.add_argument(
        "--into", default=str(RESULTS), help="the results folder to merge into (default benchmarks/results/)"
    )
    args = p.parse_args(argv)
    into = pathlib.Path(args.into)
    for d in args.dirs:
        try:
            areas = merge(pathlib.Path(d), into)
        except FileNotFoundError as e:
            sys.exit(str(e))
        print(f"{d}: {', '.join(areas) or 'history rows only'} -> {into}")
    print("now regenerate the README's tables: python -m benchmarks.readme_tables")


if __name__ == "__main__":
    main()
