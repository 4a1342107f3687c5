"""Forward+backward of an MLP block (and Linear layers) built from float8.ops, against bf16 eager and bf16
torch.compile, in one process on one GPU: time (do_bench median) and peak memory.

    python -m float8.bench.blocks --out DIR [--tokens 16384] [--quick]

Writes DIR/blocks_<gpu>.json (records: case, shape, ours_ms, bf16_ms, bf16_compiled_ms, peak_mem_ours,
peak_mem_bf16, device, torch, triton, date) and DIR/blocks_<gpu>.md, and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re

import torch
import torch.nn.functional as F


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


class Bf16MLP(torch.nn.Module):
    """The same block in plain PyTorch: RMSNorm -> Linear(d, 2f) -> SwiGLU -> Linear(f, d)."""

    def __init__(self, d, f):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d, eps=1e-6)
        self.up = torch.nn.Linear(d, 2 * f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        a, b = self.up(self.norm(x)).chunk(2, dim=-1)
        return self.down(F.silu(a) * b)


def fp8_mlp(d, f):
    import float8.ops as ops

    return ops.Sequential(
        ops.RMSNorm(d), ops.Linear(d, 2 * f, bias=False), ops.SwiGLU(), ops.Linear(f, d, bias=False)
    )


def _fwd_bwd(model, x, dy):
    def step():
        for p in model.parameters():
            p.grad = None
        model(x).backward(dy)

    return step


def _measure(step, warmup=3):
    from triton.testing import do_bench

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = do_bench(step, warmup=25, rep=200, return_mode="median")
    return ms, peak


def bench_mlp(tokens: int, d: int, f: int):
    dev = "cuda"
    x = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(tokens, d, device=dev, dtype=torch.bfloat16) * 0.01
    ref = Bf16MLP(d, f).to(dev, torch.bfloat16)
    ours = fp8_mlp(d, f).to(dev, torch.bfloat16)
    with torch.no_grad():
        ours[0].weight.copy_(ref.norm.weight)
        ours[1].weight.copy_(ref.up.weight)
        ours[3].weight.copy_(ref.down.weight)
    xg = x.clone().requires_grad_(True)
    results = {}
    results["bf16"] = _measure(_fwd_bwd(ref, xg, dy))
    compiled = torch.compile(ref)
    results["bf16_compiled"] = _measure(_fwd_bwd(compiled, xg, dy))
    results["ours"] = _measure(_fwd_bwd(ours, xg, dy))
    # Numerics of the same step: output against bf16, in dB.
    with torch.no_grad():
        y_ref, y = ref(x).float(), ours(x).float()
    sqnr = float(10 * torch.log10(y_ref.pow(2).sum() / (y_ref - y).pow(2).sum()))
    del ref, ours, compiled
    return results, sqnr


def bench_linear(m: int, k: int, n: int):
    import float8.ops as ops

    dev = "cuda"
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    ref = torch.nn.Linear(k, n, bias=False).to(dev, torch.bfloat16)
    ours = ops.Linear(k, n, bias=False).to(dev, torch.bfloat16)
    results = {"bf16": _measure(_fwd_bwd(ref, x, dy))}
    results["bf16_compiled"] = _measure(_fwd_bwd(torch.compile(ref), x, dy))
    results["ours"] = _measure(_fwd_bwd(ours, x, dy))
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="examples/results")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    args = p.parse_args(argv)
    import triton

    name = torch.cuda.get_device_name()
    meta = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
    }
    def record(case, shape, res, **extra):
        return {
            "case": case,
            "shape": list(shape),
            "ours_ms": res["ours"][0],
            "bf16_ms": res["bf16"][0],
            "bf16_compiled_ms": res["bf16_compiled"][0],
            "torchao_ms": None,
            "peak_mem_ours": res["ours"][1],
            "peak_mem_bf16": res["bf16"][1],
            "peak_mem_bf16_compiled": res["bf16_compiled"][1],
            **extra,
            **meta,
        }

    d, f, tokens = (512, 1024, 1024) if args.quick else (4096, 14336, args.tokens)
    res, sqnr = bench_mlp(tokens, d, f)
    records = [record("mlp_block", (tokens, d, f), res, output_sqnr_db_vs_bf16=sqnr)]
    quick = [(1024, 512, 512)]
    full = [(1024, 4096, 4096), (2048, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096)]
    for shape in quick if args.quick else full:
        records.append(record("linear_fwd_bwd", shape, bench_linear(*shape)))
    os.makedirs(args.out, exist_ok=True)
    slug = _slug(name)
    with open(os.path.join(args.out, f"blocks_{slug}.json"), "w") as fh:
        json.dump(records, fh, indent=1)
    lines = [
        f"Forward+backward, {name}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}",
        "",
        "| case | shape | ours ms | bf16 eager ms | bf16 compiled ms | vs eager | vs compiled | peak MiB ours | peak MiB bf16 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        lines.append(
            f"| {r['case']} | {tuple(r['shape'])} | {r['ours_ms']:.3f} | {r['bf16_ms']:.3f} | {r['bf16_compiled_ms']:.3f} | "
            f"{r['bf16_ms'] / r['ours_ms']:.2f}x | {r['bf16_compiled_ms'] / r['ours_ms']:.2f}x | "
            f"{r['peak_mem_ours'] / 2**20:.0f} | {r['peak_mem_bf16'] / 2**20:.0f} |"
        )
    table = "\n".join(lines)
    with open(os.path.join(args.out, f"blocks_{slug}.md"), "w") as fh:
        fh.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
