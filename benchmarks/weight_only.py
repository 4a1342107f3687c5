"""The weight-only FP8 GEMM (float8.kernels.fp8_weight_mm) at decode sizes, against bf16 and FP8 x FP8.

    python -m benchmarks.weight_only [--out DIR] [--tokens 24,32 --area A]   # on a CUDA machine: tile sweep
    python -m benchmarks.weight_only --tiny [--out DIR]   # plumbing only (CPU, reference path)

For the Linears of the benchmark models (benchmarks/llama.py and Hugging Face's Llama: d 4096, GQA 32/8 of
128, SwiGLU 14336, vocab 32768) at 1-128 tokens, GPU time (do_bench_cudagraph median: host time left out)
of: bf16 F.linear; the FP8 x FP8 path (the activation quantized, then torch._scaled_mm through
`x8 @ w8.t()`); and fp8_weight_mm with every tile of a sweep in both orientations, each output checked
against fp8_weight_mm_ref before it is timed. The weight-read floor is the FP8 weight's bytes over the
measured copy bandwidth. The tile with the least time summed over the layers, per token count
(`best_per_bucket`), is what kernels/weight_only.py CONFIGS holds.
Also host time per call at 16 tokens: nn.Linear (bf16) against a converted Linear with an FP8-only weight.
Records the area "weight_only" in DIR (default benchmarks/results/; benchmarks.harness.record), the sweep's
rows as they come in DIR/weight_only.rows.jsonl (what is left of a run that ran out of time).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

import float8.ops as ops
from benchmarks.harness import environment, figure, host_us, make_timer, markdown_table, record, results_dir
from float8 import Float8Tensor
from float8.kernels import weight_only

# (K, N) of the Linears of the benchmark models: benchmarks/llama.py (fused QKV and gate/up) and Hugging Face's
# LlamaForCausalLM (separate q, k, v, gate, up).
SHAPES = {
    "q/o 4096x4096": (4096, 4096),
    "k/v 4096->1024": (4096, 1024),
    "qkv 4096->6144": (4096, 6144),
    "gate/up 4096->14336": (4096, 14336),
    "gate+up 4096->28672": (4096, 28672),
    "down 14336->4096": (14336, 4096),
    "head 4096->32768": (4096, 32768),
}
TOKENS = (1, 16, 32, 64, 128)
L2_FLUSH_BYTES = 256 * 2**20


def candidate_tiles(m: int):
    """((BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SWAP), split) to sweep for m tokens, in both orientations
    (SWAP: the widened weight as the MMA's A operand), plus the table's wide-layer tile. split None: the
    table's split of K for that tile; "decode": K split as at <= 16 tokens too (DECODE_STEPS_PER_SPLIT).
    At 17-32 tokens the 16-token family (narrow unswapped tiles, long BLOCK_K) is swept too, both ways: the
    table's 32-row tile made a graphed forward 1.17-1.22x slower at 24-32 tokens than at 16 (2026-11-27)."""
    block_m = max(16, 1 << (m - 1).bit_length())
    if block_m <= 16:
        plain = itertools.product((32, 64), (128, 256, 512), (4,), (3, 5))
        swap = itertools.product((64, 128), (128, 256), (4, 8), (3, 4, 5))
    else:
        plain = itertools.product((64, 128), (64, 128), (4, 8), (3, 4))
        swap = itertools.product((64, 128), (64, 128), (4, 8), (3, 4, 5))
    tiles = [((block_m, n, k, w, s, False), None) for n, k, w, s in plain]
    tiles += [((block_m, n, k, w, s, True), None) for n, k, w, s in swap]
    if block_m == 32:
        decode = [(block_m, n, k, 4, s, False) for n, k, s in itertools.product((32, 64), (256, 512), (3, 4, 5))]
        tiles += [(t, split) for t in decode for split in (None, "decode")]
    return tiles + ([(weight_only.WIDE_CONFIG, None)] if m > 64 else [])


def split_for(tile, split, n: int, k: int, device) -> int | None:
    """The split of K a candidate asks for (None: the table's rule for its tile)."""
    if split != "decode":
        return None
    programs = weight_only._sm_count(device.index)
    return weight_only.split_k_for(n, k, tile[1], tile[2], programs, weight_only.DECODE_STEPS_PER_SPLIT)


def copy_bandwidth(timer, device) -> float:
    """Bytes per ms of a device-to-device copy of 1 GiB (read + write counted)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timer(lambda: dst.copy_(src))


def sweep(timer, device, tokens, shapes, tiles_for, bandwidth, log=None):
    """One row per (layer, tokens): bf16, FP8 x FP8 and every tile's time (each tile's output checked against
    the reference first), the table's tile and its time. Rows go to `log` (JSON lines) as they come."""
    rows = []
    for (name, (k, n)), m in itertools.product(shapes.items(), tokens):
        torch.manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        # Enough copies of the weight that together they overflow the L2 cache (50 MiB on the H100): in a
        # model's forward every layer's weight comes from memory, so a weight read from L2 call after call
        # would time a case no model has (a 4096x4096 bf16 weight read at 3.8 TB/s, above the copy rate).
        copies = max(1, min(16, -(-L2_FLUSH_BYTES // (n * k))))
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        w8s = [Float8Tensor.quantize(w) for w in ws]
        data, scale_inv = w8s[0].fp8_data, w8s[0].scale_inv
        want = weight_only.fp8_weight_mm_ref(x, data, scale_inv).double()
        # What summing K float32 products in another order may change, plus one bf16 ulp (the rounding).
        allowed = 2 * k * 2.0**-24 * (x.double().abs() @ data.double().abs().t()) * scale_inv.double()
        allowed += 2.0**-8 * want.abs()

        def per_call(fn):  # ms of one call, each call on the next weight copy
            return timer(lambda: [fn(i) for i in range(copies)]) / copies

        row = {
            "layer": name,
            "K": k,
            "N": n,
            "tokens": m,
            "weight_copies": copies,
            "bf16_ms": per_call(lambda i: F.linear(x, ws[i])),
            "fp8xfp8_ms": per_call(lambda i: Float8Tensor.quantize(x) @ w8s[i].t()),
            "floor_ms": n * k / bandwidth,
            "tiles": {},
        }

        def run(candidate, i=0):
            w8 = w8s[i]
            if candidate is None:  # CPU: the op, i.e. its reference
                return weight_only.fp8_weight_mm(x, w8.fp8_data, w8.scale_inv)
            tile, split = candidate
            split_k = split_for(tile, split, n, k, x.device)
            return weight_only.fp8_weight_mm_triton(x, w8.fp8_data, w8.scale_inv, config=tile, split_k=split_k)

        for candidate in tiles_for(m):
            try:
                got = run(candidate)
            except OutOfResources:  # too many stages of too large a tile for shared memory: not a candidate
                continue
            bad = int(((got.double() - want).abs() > allowed).sum())
            if bad:
                raise AssertionError(f"tile {candidate} at {name}, {m} tokens: {bad} outputs off")
            key = (
                "None" if candidate is None else str(candidate[0]) + (f" split {candidate[1]}" if candidate[1] else "")
            )
            row["tiles"][key] = per_call(lambda i: run(candidate, i))
        best_tile = min(row["tiles"], key=row["tiles"].get)
        row.update(
            best_ms=row["tiles"][best_tile],
            best_tile=best_tile,
            table_tile=str(weight_only.config_for(m, n, weight_only._sm_count(x.device.index) if x.is_cuda else 0)),
            table_ms=per_call(lambda i: weight_only.fp8_weight_mm(x, w8s[i].fp8_data, w8s[i].scale_inv)),
        )
        row["of_floor"] = row["floor_ms"] / row["table_ms"]
        row["vs_bf16"] = row["bf16_ms"] / row["table_ms"]
        row["vs_fp8xfp8"] = row["fp8xfp8_ms"] / row["table_ms"]
        rows.append(row)
        if log is not None:
            log.write(json.dumps(row) + "\n")
            log.flush()
        print(
            f"{name:22s} M={m:4d} bf16 {row['bf16_ms'] * 1e3:7.1f} us  fp8xfp8 {row['fp8xfp8_ms'] * 1e3:7.1f}  "
            f"table {row['table_ms'] * 1e3:7.1f}  best {row['best_ms'] * 1e3:7.1f} {best_tile}  "
            f"floor {row['floor_ms'] * 1e3:6.1f}  best at {row['floor_ms'] / row['best_ms']:.0%} of floor",
            flush=True,
        )
    return rows


def best_per_bucket(rows):
    """For each token count, the tile with the least time summed over the layers (the heavy layers weigh
    most, as in a model's forward), and that sum against the per-layer best tiles' sum."""
    out = {}
    for m in sorted({r["tokens"] for r in rows}):
        at = [r for r in rows if r["tokens"] == m]
        common = set.intersection(*(set(r["tiles"]) for r in at))
        total = {t: sum(r["tiles"][t] for r in at) for t in common}
        tile = min(total, key=total.get)
        out[m] = {
            "tile": tile,
            "sum_ms": total[tile],
            "per_layer_best_sum_ms": sum(r["best_ms"] for r in at),
            "floor_sum_ms": sum(r["floor_ms"] for r in at),
            "bf16_sum_ms": sum(r["bf16_ms"] for r in at),
        }
    return out


def host_rows(device, k=4096, n=4096, m=16):
    """Host microseconds per call at m tokens: nn.Linear in bf16, and a converted Linear with an FP8 weight."""
    lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device, torch.bfloat16)
    conv = ops.convert(
        torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device, torch.bfloat16), fp8_weights=True
    )
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        return {"nn.Linear bf16 us": host_us(lambda: lin(x)), "float8 FP8-only weight us": host_us(lambda: conv(x))}


def figures(rows, buckets, host, copy_gbps) -> list:
    """Per layer and token count: bf16, FP8 x FP8, the weight-only kernel with the table's tile (and its
    ratios) and with the best tile, the floor; per token count the same summed over the layers; host time."""
    out = [figure("copy", "dst.copy_(src)", "GB/s", copy_gbps)]
    for r in rows:
        case = f"{r['layer']}, tokens {r['tokens']}"
        out += [
            figure(case, "bf16 F.linear", "ms", r["bf16_ms"]),
            figure(case, "FP8 x FP8", "ms", r["fp8xfp8_ms"]),
            figure(case, "weight-only, best tile", "ms", r["best_ms"]),
            figure(case, "floor", "ms", r["floor_ms"]),
        ]
        out += [
            figure(case, "weight-only", metric, r[key])
            for metric, key in (
                ("ms", "table_ms"),
                ("fraction_of_floor", "of_floor"),
                ("speedup_vs_bf16", "vs_bf16"),
                ("speedup_vs_fp8xfp8", "vs_fp8xfp8"),
            )
        ]
    for m, b in buckets.items():
        case = f"all layers, tokens {m}"
        out += [
            figure(case, variant, "ms", b[key])
            for variant, key in (
                ("weight-only", "sum_ms"),
                ("weight-only, best tile per layer", "per_layer_best_sum_ms"),
                ("floor", "floor_sum_ms"),
                ("bf16 F.linear", "bf16_sum_ms"),
            )
        ]
    out += [figure("host time per call, 16 tokens", name.removesuffix(" us"), "us", us) for name, us in host.items()]
    return out


def markdown(rows, buckets, host, copy_gbps) -> str:
    """The sweep's table (GPU time in us), the per-token-count sums and the host times."""
    us = lambda v: f"{v * 1e3:.1f}"  # noqa: E731
    table = [
        {
            "layer": r["layer"],
            "tokens": r["tokens"],
            "bf16": us(r["bf16_ms"]),
            "FP8 x FP8": us(r["fp8xfp8_ms"]),
            "weight-only": us(r["table_ms"]),
            "best tile": us(r["best_ms"]),
            "floor": us(r["floor_ms"]),
            "of floor": f"{r['of_floor']:.0%}",
            "vs bf16": f"{r['vs_bf16']:.2f}x",
        }
        for r in rows
    ]
    sums = [
        {
            "tokens": m,
            "tile": b["tile"],
            "weight-only": us(b["sum_ms"]),
            "bf16": us(b["bf16_sum_ms"]),
            "floor": us(b["floor_sum_ms"]),
        }
        for m, b in buckets.items()
    ]
    return "\n".join(
        [
            f"GPU time per call, us (do_bench_cudagraph median; copy bandwidth {copy_gbps:.0f} GB/s):",
            "",
            markdown_table(table, list(table[0]) if table else ["layer"]),
            "Summed over the layers, the tile per token count:",
            "",
            markdown_table(sums, ["tokens", "tile", "weight-only", "bf16", "floor"]),
            "Host time per call, 16 tokens: " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()),
            "",
        ]
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/)")
    p.add_argument("--tiny", action="store_true", help="CPU plumbing run: one small shape, reference path")
    p.add_argument("--tokens", default=None, help=f"comma-separated token counts (default {TOKENS})")
    p.add_argument("--area", default="weight_only", help="the results area this run replaces")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:  # GPU time without the host: small kernels would otherwise time our launch overhead
        from triton.testing import do_bench_cudagraph

        timer = lambda fn: float(do_bench_cudagraph(fn, rep=20, return_mode="median"))  # noqa: E731
    else:
        timer = make_timer(False)
    if cuda:
        shapes, tiles_for = SHAPES, candidate_tiles
        tokens = tuple(int(t) for t in a.tokens.split(",")) if a.tokens else TOKENS
        bandwidth = copy_bandwidth(timer, device)
    else:  # the reference path; the tile argument is not read on the CPU
        shapes, tokens, tiles_for, bandwidth = {"tiny 64->32": (64, 32)}, (1, 16), lambda m: [None], 1e6
    env = environment(device)
    out, kept = results_dir(a.out), cuda or a.out is not None  # as record: a CPU run only where --out points
    if kept:
        out.mkdir(parents=True, exist_ok=True)
    with open(out / "weight_only.rows.jsonl", "w") if kept else contextlib.nullcontext() as log:
        rows = sweep(timer, device, tokens, shapes, tiles_for, bandwidth, log)
    buckets = best_per_bucket(rows)
    for m, b in buckets.items():
        print(f"M={m}: {b}", flush=True)
    host = host_rows(device) if cuda else host_rows(device, 64, 32)
    print(host, flush=True)
    copy_gbps = bandwidth / 1e6
    detail = {"copy_GBps": copy_gbps, "rows": rows, "best_per_bucket": buckets, "host": host}
    args = rows, buckets, host, copy_gbps
    md = record(a.area, a.out, env, figures(*args), markdown(*args), detail)
    if kept:
        print(f"wrote {md.with_suffix('.json')}, {md} and {md.with_name('history.csv')}")


if __name__ == "__main__":
    main()
