"""python -m benchmarks <case> [--tiny] [--out DIR] [--variants a,b]: whole-training-step benchmarks.

Cases: step_llama (the Llama-style model, every variant). The per-kernel and per-layer suite is still
`python -m float8.bench` (its move here is not done yet)."""

from __future__ import annotations

import argparse

import torch

from benchmarks import step_llama
from benchmarks.harness import environment, write_report

CASES = {"step_llama": step_llama}
COLUMNS = {
    "step_llama": ["variant", "ms_per_step", "tokens_per_s", "peak_GiB", "speed_vs_bf16_eager", "speed_vs_bf16_compiled",
                   "speed_vs_torchao_tensorwise_compiled", "final_loss", "error"],
}  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU smoke test)")
    p.add_argument("--out", default="examples/results", help="folder for the JSON and markdown report")
    p.add_argument("--variants", default=None, help="comma-separated variant names (default: all)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    variants = args.variants.split(",") if args.variants else None
    rows = CASES[args.case].run(device, args.tiny or device.type == "cpu", variants)
    md = write_report(args.case, args.out, environment(device), rows, COLUMNS[args.case])
    print(md.read_text())


if __name__ == "__main__":
    main()
