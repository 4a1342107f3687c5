"""The weight-only FP8 GEMM (float8.kernels.fp8_weight_mm) at decode sizes, against bf16 and FP8 x FP8.

    python -m benchmarks.weight_only --out DIR           # on a CUDA machine: tile sweep, table, JSON
    python -m benchmarks.weight_only --tiny --out DIR    # plumbing only (CPU, reference path)

For the Linears of a Llama-style model (d 4096, GQA 32/8 of 128, SwiGLU 14336, vocab 32768) at 1-128 tokens,
GPU time (do_bench_cudagraph median: host time left out) of: bf16 F.linear; the FP8 x FP8 path (the activation quantized, then
torch._scaled_mm through `x8 @ w8.t()`); and fp8_weight_mm with every tile of a small sweep, each output
checked against fp8_weight_mm_ref before it is timed. The weight-read floor is the FP8 weight's bytes over
the measured copy bandwidth. The best tile per token bucket is what kernels/weight_only.py CONFIGS holds.
Also host time per call at 16 tokens: nn.Linear (bf16) against a converted Linear with an FP8-only weight.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib

import torch
import torch.nn.functional as F

import float8.ops as ops
from float8 import Float8Tensor
from float8.kernels import weight_only
from benchmarks.harness import environment, host_us, make_timer

SHAPES = {"q/o 4096x4096": (4096, 4096), "k/v 4096->1024": (4096, 1024), "gate/up 4096->14336": (4096, 14336),
          "down 14336->4096": (14336, 4096), "head 4096->32768": (4096, 32768)}  # fmt: skip
TOKENS = (1, 16, 32, 64, 128)


def candidate_tiles(m: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) to sweep for m tokens."""
    block_m = max(16, 1 << (m - 1).bit_length())
    if block_m <= 32:
        grid = itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4, 6))
    else:
        grid = itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4))
    return [(block_m, n, k, w, s) for n, k, w, s in grid]


def copy_bandwidth(timer, device) -> float:
    """Bytes per ms of a device-to-device copy of 1 GiB (read + write counted)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timer(lambda: dst.copy_(src))


def sweep(timer, device, tokens, shapes, tiles_for, bandwidth):
    rows = []
    for (name, (k, n)), m in itertools.product(shapes.items(), tokens):
        torch.manual_seed(0)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        w8 = Float8Tensor.quantize(w)
        data, scale_inv = w8.fp8_data, w8.scale_inv
        want = weight_only.fp8_weight_mm_ref(x, data, scale_inv).double()
        # What summing K float32 products in another order may change, plus one bf16 ulp (the rounding).
        allowed = 2 * k * 2.0**-24 * (x.double().abs() @ data.double().abs().t()) * scale_inv.double()
        allowed += 2.0**-8 * want.abs()
        row = {"layer": name, "tokens": m, "bf16_ms": timer(lambda: F.linear(x, w)),
               "fp8xfp8_ms": timer(lambda: Float8Tensor.quantize(x) @ w8.t()),
               "floor_ms": n * k / bandwidth}  # fmt: skip
        def run(tile):
            if tile is None:  # CPU: the op, i.e. its reference
                return weight_only.fp8_weight_mm(x, data, scale_inv)
            return weight_only.fp8_weight_mm_triton(x, data, scale_inv, config=tile)

        best = None
        for tile in tiles_for(m):
            got = run(tile)
            bad = int(((got.double() - want).abs() > allowed).sum())
            if bad:
                raise AssertionError(f"tile {tile} at {name}, {m} tokens: {bad} outputs off")
            ms = timer(lambda: run(tile))
            if best is None or ms < best[0]:
                best = (ms, tile)
        row.update(weight_only_ms=best[0], tile=best[1], table_tile=list(weight_only.config_for(m)),
                   table_ms=timer(lambda: weight_only.fp8_weight_mm(x, data, scale_inv)))  # fmt: skip
        row["of_floor"] = row["floor_ms"] / row["table_ms"]
        row["vs_bf16"] = row["bf16_ms"] / row["table_ms"]
        row["vs_fp8xfp8"] = row["fp8xfp8_ms"] / row["table_ms"]
        rows.append(row)
        print(f"{name:22s} M={m:4d} bf16 {row['bf16_ms']*1e3:7.1f} us  fp8xfp8 {row['fp8xfp8_ms']*1e3:7.1f}  "
              f"weight-only {row['table_ms']*1e3:7.1f} (best {best[0]*1e3:7.1f} {best[1]})  "
              f"floor {row['floor_ms']*1e3:6.1f}  {row['of_floor']:.0%} of floor", flush=True)  # fmt: skip
    return rows


def host_rows(device, k=4096, n=4096, m=16):
    """Host microseconds per call at m tokens: nn.Linear in bf16, and a converted Linear with an FP8 weight."""
    lin = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device, torch.bfloat16)
    conv = ops.convert(torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device, torch.bfloat16), fp8_weights=True)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        return {"nn.Linear bf16 us": host_us(lambda: lin(x)), "float8 FP8-only weight us": host_us(lambda: conv(x))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="examples/results")
    p.add_argument("--tiny", action="store_true", help="CPU plumbing run: one small shape, reference path")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.tiny
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:  # GPU time without the host: small kernels would otherwise time our launch overhead
        from triton.testing import do_bench_cudagraph

        timer = lambda fn: float(do_bench_cudagraph(fn, rep=20, return_mode="median"))  # noqa: E731
    else:
        timer = make_timer(False)
    if cuda:
        shapes, tokens, tiles_for = SHAPES, TOKENS, candidate_tiles
        bandwidth = copy_bandwidth(timer, device)
    else:  # the reference path; the tile argument is not read on the CPU
        shapes, tokens, tiles_for, bandwidth = {"tiny 64->32": (64, 32)}, (1, 16), lambda m: [None], 1e6
    rows = sweep(timer, device, tokens, shapes, tiles_for, bandwidth)
    host = host_rows(device) if cuda else host_rows(device, 64, 32)
    print(host, flush=True)
    env = environment(device)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"weight_only_{env['device'].lower().replace(' ', '-')}.json"
    path.write_text(json.dumps({"env": env, "copy_GBps": bandwidth / 1e6, "rows": rows, "host": host}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
