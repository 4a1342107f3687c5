"""python -m benchmarks.readme_tables [--check] [--results FILE] [DOC ...]: the README's tables of measured
figures, generated from benchmarks/results/latest.json (the latest run of each benchmark area).

A table stands between `<!-- results:NAME -->` and `<!-- /results -->` in a document (DOCS unless others
are named); NAME is a key of TABLES, which says which figure each cell shows (area, case, variant, metric).
Everything between the markers is rewritten: a caption naming the runs (device, date, versions),
then the table. A figure the latest run does not have shows as "—". --check rewrites nothing and exits 1
when a document's tables differ from what latest.json gives (tests/test_readme_results_tables.py runs the
same check, so the documents cannot drift from the recorded results).
"""

from __future__ import annotations

import argparse
import difflib
import json
import pathlib
import re
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

from benchmarks.harness import RESULTS, ROOT

DOCS = ["README.md", "docs/performance.md", "docs/inference.md"]  # the documents that hold generated tables
BLOCK = re.compile(r"(<!-- results:(\S+) -->\n)(.*?)(<!-- /results -->)", re.DOTALL)


def ms(v: float) -> str:
    return f"{v:.1f}" if v >= 100 else f"{v:#.3g}"


def times(v: float) -> str:
    return f"{v:.2f}×"


def pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def mib(v: float) -> str:
    return f"{v / 1024:.2f} GiB" if v >= 1024 else f"{v:.0f} MiB"


def db(v: float) -> str:
    return f"{v:.1f} dB"


Cell = Tuple[str, str, Callable[[float], str]]  # variant, metric, format; (None, text, None): the text itself


@dataclass
class Row:
    label: str
    area: str
    case: str
    cells: List[Cell]


@dataclass
class Table:
    title: str
    header: List[str]
    rows: List[Row]


def kernel(label: str, case: str) -> Row:
    """One of benchmarks.kernels' kernels at 16384x8192: ours, against eager and compiled torch."""
    metrics = [("ms", ms), ("fraction_of_copy", pct), ("speedup_vs_eager", times), ("speedup_vs_compiled", times)]
    return Row(label, "kernels", f"{case} 16384x8192", [("ours", m, f) for m, f in metrics])


def bench(label: str, area: str, case: str) -> Row:
    """A case of the suite: ours eager, against bf16 eager and compiled and torchao tensorwise."""
    speedups = [("ours", f"speedup_vs_{b}", times) for b in ("bf16", "bf16_compiled", "torchao")]
    return Row(label, area, case, [("ours", "ms", ms), *speedups])


def llama(label: str, variant: str) -> Row:
    """A variant of benchmarks.step_llama's whole training step."""
    speedups = [
        (variant, f"speed_vs_{b}", times) for b in ("bf16_eager", "bf16_compiled", "torchao_tensorwise_compiled")
    ]
    return Row(label, "step_llama", "step_llama", [(variant, "ms_per_step", ms), *speedups])


def inference(tokens: int, model: str = "llama") -> Row:
    """benchmarks.inference at one token count, eager: bf16's time, the others against it."""
    variants = ("float8 eager", "torchao rowwise eager")
    cells = [("bf16 eager", "ms", ms), *[(v, "vs_bf16_eager", times) for v in variants]]
    return Row(f"{model}, {tokens}", "inference", f"model {model}, tokens {tokens}", cells)


def inference_compiled(tokens: int, model: str = "llama") -> Row:
    """benchmarks.inference --area inference_compiled at one token count: torch.compile (default mode)."""
    cells = [
        ("bf16 compiled", "ms", ms),
        ("float8 compiled", "vs_bf16_compiled", times),
        ("torchao rowwise compiled", "vs_bf16_compiled", times),
        ("float8 compiled", "vs_bf16_eager", times),
    ]
    return Row(str(tokens), "inference_compiled", f"model {model}, tokens {tokens}", cells)


def inference_graphs(tokens: int, model: str = "llama") -> Row:
    """benchmarks.inference --area inference_graphs: torch.compile(mode="reduce-overhead") (CUDA graphs)."""
    cells = [
        ("bf16 eager", "ms", ms),
        ("bf16 cudagraphs", "ms", ms),
        ("float8 cudagraphs", "ms", ms),
        ("bf16 cudagraphs", "vs_bf16_eager", times),
        ("float8 cudagraphs", "vs_bf16_eager", times),
    ]
    return Row(str(tokens), "inference_graphs", f"model {model}, tokens {tokens}", cells)


def inference_graphed(tokens: int, model: str = "llama") -> Row:
    """benchmarks.inference --area inference_graphed: ops.graphed_inference (CUDA graphs of the eager forward)."""
    cells = [
        ("bf16 eager", "ms", ms),
        ("bf16 graphed", "ms", ms),
        ("float8 graphed", "ms", ms),
        ("float8 graphed", "vs_bf16_same_mode", times),
        ("float8 graphed", "vs_bf16_eager", times),
    ]
    return Row(f"{model}, {tokens}", "inference_graphed", f"model {model}, tokens {tokens}", cells)


def lce(label: str, variant: str, reference: bool = False) -> Row:
    """A variant of benchmarks.memory's fused LM head + loss; the reference has no SQNR of its own."""
    sqnr = (None, "ref", None) if reference else (variant, "dw_sqnr_db", db)
    cells = [(variant, "ms", ms), (variant, "vs_naive", times), (variant, "peak_above_grads_MiB", mib), sqnr]
    return Row(label, "memory_lce", "lce", cells)


TABLES: Dict[str, Table] = {
    "kernels": Table(
        "Quantization kernels, 16384×8192 bf16 → E4M3; of copy bandwidth: the bytes each moves, at the measured copy rate",
        ["kernel", "ms", "of copy bandwidth", "vs eager", "vs `torch.compile`"],
        [
            kernel("current-scaling quantize (amax + cast)", "quantize tensorwise (current)"),
            kernel("current-scaling quantize + transpose", "quantize + transpose (current)"),
            kernel("per-row quantize", "quantize rowwise"),
            kernel("128×128 block quantize", "quantize blockwise 128x128"),
        ],
    ),
    "training": Table(
        "Training, forward+backward and whole AdamW steps; speedup = baseline time / ours (above 1: ours is faster)",
        ["case", "ours ms", "vs bf16 eager", "vs bf16 compiled", "vs torchao tensorwise"],
        [
            bench("Linear 8192×8192×8192", "bench_linear", "c Linear fwd+bwd 8192x8192x8192"),
            bench("Linear 16384×4096×14336", "bench_linear", "c Linear fwd+bwd 16384x4096x14336"),
            bench("MLP block, 16384 tokens", "bench_mlp", "d MLP block fwd+bwd 16384x4096x14336"),
            llama("Llama-style, 8 blocks, AdamW step, eager", "float8 ops eager"),
            llama("the same, `ops.convert`ed and compiled", "float8 converted compiled"),
        ],
    ),
    "inference": Table(
        "Inference with FP8-only weights, eager, batch 1: the 2.0B Llama-style model (llama) and the same shape as a Hugging Face LlamaForCausalLM (hf); ratios against bf16 eager in the same round",
        ["model, tokens", "bf16 eager ms", "float8 eager", "torchao rowwise eager"],
        [inference(t) for t in (1, 16, 128, 4096)] + [inference(t, "hf") for t in (16, 4096)],
    ),
    "inference_compiled": Table(
        "Inference compiled (torch.compile, default mode), the same model; ratios against bf16 in the same round",
        ["tokens", "bf16 compiled ms", "float8 compiled", "torchao rowwise compiled", "float8 compiled vs bf16 eager"],
        [inference_compiled(16)],
    ),
    "inference_graphs": Table(
        'Inference under CUDA graphs (torch.compile, mode="reduce-overhead"), the same model, each call synchronized',
        [
            "tokens",
            "bf16 eager ms",
            "bf16 graphed ms",
            "float8 graphed ms",
            "bf16 graphed vs bf16 eager",
            "float8 graphed vs bf16 eager",
        ],
        [inference_graphs(16)],
    ),
    "inference_graphed": Table(
        "Inference under `ops.graphed_inference` (CUDA graphs of the eager forward), batch 1, each call synchronized",
        [
            "model, tokens",
            "bf16 eager ms",
            "bf16 graphed ms",
            "float8 graphed ms",
            "float8 vs bf16, both graphed",
            "float8 graphed vs bf16 eager",
        ],
        [inference_graphed(t, m) for m in ("llama", "hf") for t in (1, 16, 128)],
    ),
    "lce": Table(
        "Fused linear + cross-entropy, V=128256, H=4096, 16384 tokens; vs naive: time ratio (below 1: faster)",
        ["", "ms", "vs naive", "above the gradients", "dw SQNR"],
        [
            lce("naive", "naive (F.linear + .float() + F.cross_entropy)", reference=True),
            lce("float8 bf16, float32 dw", "float8 bf16"),
            lce('float8 bf16, `dw_accumulation="weight_dtype"`', "float8 bf16, dw in bf16"),
            lce("the same, `chunk_tokens=1024`", "float8 bf16, dw in bf16, 1024-token chunks"),
            lce("float8 FP8 GEMMs (`recipe=Recipe()`; dW GEMM in bf16)", "float8 FP8 GEMMs"),
            lce('the same, `dw_accumulation="float32"` (FP8 dW GEMM)', "float8 FP8 GEMMs, FP8 dw in float32"),
            lce("Liger-Kernel 0.8.5", "Liger-Kernel 0.8.5"),
        ],
    ),
}


def _lookup(latest: dict) -> Dict[tuple, float]:
    return {
        (area, f["case"], f["variant"], f["metric"]): f["value"] for area, s in latest.items() for f in s["figures"]
    }


def caption(table: Table, latest: dict) -> str:
    """The title, then the runs the table reads: device and versions, then each date with its areas."""
    runs: Dict[str, Dict[str, List[str]]] = {}
    for area in dict.fromkeys(r.area for r in table.rows):
        s = latest.get(area)
        if s is None:
            runs.setdefault("no run recorded", {}).setdefault("", []).append(area)
            continue
        versions = ", ".join(f"{k} {s[k]}" for k in ("torch", "triton", "torchao") if s.get(k))
        runs.setdefault(f"{s['device']} ({versions})", {}).setdefault(s["date"], []).append(area)
    where = "; ".join(
        f"{machine}: "
        + ", ".join(f"{date} ({', '.join(areas)})" if date else ", ".join(areas) for date, areas in dates.items())
        for machine, dates in runs.items()
    )
    return f"{table.title}. {where}."


def render(name: str, latest: dict) -> str:
    """The text between a table's markers: its caption, a blank line, the table."""
    table = TABLES[name]
    figures = _lookup(latest)
    lines = [
        caption(table, latest),
        "",
        "| " + " | ".join(table.header) + " |",
        "| --- |" + " ---: |" * (len(table.header) - 1),
    ]
    for row in table.rows:
        cells = []
        for variant, metric, fmt in row.cells:
            value = figures.get((row.area, row.case, variant, metric))
            cells.append(metric if variant is None else "—" if value is None else fmt(value))
        lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def regenerate(text: str, latest: dict) -> str:
    """`text` with every results block rewritten from `latest`; an unknown table name raises KeyError."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2), latest) + m.group(4), text)


def load(path: pathlib.Path = RESULTS / "latest.json") -> dict:
    return json.loads(path.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readme_tables", description=__doc__.split("\n")[0])
    p.add_argument(
        "docs", nargs="*", default=[str(ROOT / d) for d in DOCS], help="documents to rewrite (default: DOCS)"
    )
    p.add_argument("--results", default=str(RESULTS / "latest.json"), help="the latest.json to read")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a document's tables are stale")
    args = p.parse_args(argv)
    latest = load(pathlib.Path(args.results))
    stale = 0
    for doc in map(pathlib.Path, args.docs):
        old = doc.read_text()
        new = regenerate(old, latest)
        if new == old:
            continue
        if args.check:
            stale += 1
            sys.stdout.writelines(
                difflib.unified_diff(old.splitlines(True), new.splitlines(True), str(doc), "generated")
            )
        else:
            doc.write_text(new)
            print(f"rewrote the tables of {doc}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
