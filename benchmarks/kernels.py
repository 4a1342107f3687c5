"""Benchmark the quantization kernels against eager PyTorch and torch.compile of the same math.

    python -m benchmarks.kernels [--out DIR]            # on a CUDA machine
    python -m benchmarks.kernels [--out DIR] --sweep    # also time the tile/block variants of our kernels
    python -m benchmarks.kernels [--out DIR] --cpu-smoke  # tiny shape, reference paths only (CI)

For a 16384x8192 bfloat16 input (normal * 3, well past the L2 cache), with triton.testing.do_bench
(warmup=25, rep=100, median): a device-to-device copy first (x.clone(): 2 + 2 bytes/element), the floor
every kernel is measured against; then each kernel as ours (the Triton launcher), eager (its *_ref on the
GPU) and compiled (torch.compile of the same *_ref). Bytes counted per element of x, the least traffic
of the algorithm as we run it:
  cast 3 (read 2, write 1), quantize 5 (amax pass reads 2 more), cast_transpose 4, quantize_transpose 6,
  rowwise 3 (rows of 8192 stay in registers), blockwise 1x128 3 + 4/128 (one fp32 scale per block),
  blockwise 128x128 3, dequantize 3 (read 1, write 2).
Before timing, each of our outputs is checked bit for bit against the eager reference on the same input,
so a fast but wrong kernel cannot report. Also: host time per call on a small input (launch overhead).
Records the area "kernels" in DIR (default benchmarks/results/; benchmarks.harness.record: latest.json with
the whole result, latest.md with the tables, history.csv) and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import platform

import torch

import float8.kernels as K
from benchmarks.harness import command_line, figure, host_us, make_timer, record

_cast = importlib.import_module("float8.kernels.cast")
_quant = importlib.import_module("float8.kernels.quantize")
_ct = importlib.import_module("float8.kernels.cast_transpose")
_row = importlib.import_module("float8.kernels.rowwise")
_block = importlib.import_module("float8.kernels.blockwise")
_dq = importlib.import_module("float8.kernels.dequantize")

E4M3 = torch.float8_e4m3fn


def cases(x: torch.Tensor, scale: torch.Tensor, fp8: torch.Tensor, fp8_scale_inv: torch.Tensor):
    """(name, bytes per element, ours, reference, args). ours/reference take the same args."""
    blk_bytes = 3 + 4 / 128
    return [
        ("cast (given scale, + amax)", 3, _cast.cast_triton, _cast.cast_ref, (x, scale, E4M3)),
        ("quantize tensorwise (current)", 5, _quant.quantize_tensorwise_triton, K.quantize_tensorwise_ref, (x, E4M3)),
        ("cast + transpose (given scale)", 4, _ct.cast_transpose_triton, _ct.cast_transpose_ref, (x, scale, E4M3)),
        (
            "quantize + transpose (current)",
            6,
            _ct.quantize_transpose_tensorwise_triton,
            _ct.quantize_transpose_tensorwise_ref,
            (x, E4M3),
        ),
        ("quantize rowwise", 3, _row.quantize_rowwise_triton, K.quantize_rowwise_ref, (x, E4M3)),
        (
            "quantize blockwise 1x128",
            blk_bytes,
            _block.quantize_blockwise_triton,
            K.quantize_blockwise_ref,
            (x, 1, 128, E4M3),
        ),
        (
            "quantize blockwise 128x128",
            3,
            _block.quantize_blockwise_triton,
            K.quantize_blockwise_ref,
            (x, 128, 128, E4M3),
        ),
        ("dequantize (per tensor)", 3, _dq.dequantize_triton, K.dequantize_ref, (fp8, fp8_scale_inv, torch.bfloat16)),
    ]


def _as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)))


def check(all_cases) -> list[str]:
    """Assert ours == eager reference, bit for bit, for every output of every case."""
    lines = []
    for name, _, ours, ref, args in all_cases:
        got, want = _as_list(ours(*args)), _as_list(ref(*args))
        assert len(got) == len(want), name
        for i, (g, w) in enumerate(zip(got, want)):
            assert same_bits(g, w), f"--check: {name}: output {i} differs from the reference"
        lines.append(f"check ok: {name} ({len(got)} outputs bit-identical to the reference)")
    return lines


def run(args) -> dict:
    cpu = args.cpu_smoke
    device = "cpu" if cpu else "cuda"
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernels needs a CUDA GPU (or --cpu-smoke)")
    M, N = (128, 256) if cpu else tuple(args.shape)
    gen = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn((M, N), generator=gen, device=device) * 3).to(torch.bfloat16)
    scale = torch.tensor([0.37], device=device)
    fp8, _, fp8_scale_inv, _ = K.quantize_tensorwise_ref(x, E4M3)
    all_cases = cases(x, scale, fp8, fp8_scale_inv)
    if cpu:  # the Triton launchers need a GPU (or the interpreter): time the reference paths only
        all_cases = [(n, b, r, r, a) for n, b, _, r, a in all_cases]
    notes = check(all_cases)
    for n in notes:
        print(n)
    if args.check_only:
        return {}

    bench = make_timer(not cpu)
    numel = x.numel()
    copy_ms = bench(lambda: x.clone())
    copy_gbps = 2 * 2 * numel / copy_ms / 1e6
    meta = {
        "device": "cpu" if cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "shape": [M, N],
        "dtype": "bfloat16",
        "timer": "wall clock (cpu smoke)" if cpu else "triton.testing.do_bench(warmup=25, rep=100, median)",
        "copy_ms": copy_ms,
        "copy_gbps": copy_gbps,
    }
    records = []
    for name, bpe, ours, ref, cargs in all_cases:
        impls = {"ours": ours, "eager": ref}
        if not args.no_compile:
            # The CPU smoke run only exercises the plumbing: a backend that needs no C++ compiler.
            impls["compiled"] = torch.compile(ref, backend="eager" if cpu else "inductor")
        ms = {k: bench(lambda f=f: f(*cargs)) for k, f in impls.items()}
        for impl, t in ms.items():
            gbps = bpe * numel / t / 1e6
            records.append(
                {
                    "kernel": name,
                    "impl": impl,
                    "ms": t,
                    "bytes_per_elem": bpe,
                    "gbps": gbps,
                    "frac_of_copy": gbps / copy_gbps,
                    "speedup_vs_eager": ms["eager"] / t,
                    "speedup_vs_compiled": ms["compiled"] / t if "compiled" in ms else None,
                }
            )
    small = torch.randn((256, 256), device=device).to(torch.bfloat16)
    host = []
    if not cpu:
        for name, fn in [
            ("launcher quantize_tensorwise_triton", lambda: _quant.quantize_tensorwise_triton(small, E4M3)),
            ("op float8::quantize_tensorwise", lambda: K.quantize_tensorwise(small, E4M3)),
            ("launcher cast_triton", lambda: _cast.cast_triton(small, scale, E4M3)),
            ("op float8::quantize_tensorwise, a given scale", lambda: K.quantize_tensorwise(small, E4M3, scale)),
            ("eager quantize_tensorwise_ref", lambda: K.quantize_tensorwise_ref(small, E4M3)),
        ]:
            host.append({"what": name, "us_per_call": host_us(fn, n=200, warmup=10)})
    sweep = run_sweep(x, scale, bench, numel, copy_gbps) if args.sweep and not cpu else []
    return {"meta": meta, "records": records, "host": host, "sweep": sweep, "checks": notes}


def run_sweep(x, scale, bench, numel, copy_gbps):
    """Time our kernels' alternative configurations (nothing else changes)."""
    out = []
    for cfg in [
        dict(BLOCK_M=64, BLOCK_K=128, num_warps=8, TRANS_INPUT=True),
        dict(BLOCK_M=64, BLOCK_K=128, num_warps=8, TRANS_INPUT=False),
        dict(BLOCK_M=128, BLOCK_K=128, num_warps=8, TRANS_INPUT=True),
        dict(BLOCK_M=64, BLOCK_K=64, num_warps=4, TRANS_INPUT=True),
        dict(BLOCK_M=128, BLOCK_K=64, num_warps=8, TRANS_INPUT=True),
        dict(BLOCK_M=32, BLOCK_K=128, num_warps=4, TRANS_INPUT=True),
    ]:
        t = bench(lambda: _ct.cast_transpose_triton(x, scale, E4M3, config=cfg))
        frac = 4 * numel / t / 1e6 / copy_gbps
        out.append({"kernel": "cast + transpose", "config": cfg, "ms": t, "frac_of_copy": frac})
    saved = (_cast.BLOCK, _cast.NUM_WARPS)
    try:
        for block, warps in [(2048, 4), (4096, 4), (4096, 8), (8192, 8)]:
            _cast.BLOCK, _cast.NUM_WARPS = block, warps
            t = bench(lambda: _cast.cast_triton(x, scale, E4M3))
            out.append(
                {
                    "kernel": "cast",
                    "config": {"BLOCK": block, "num_warps": warps},
                    "ms": t,
                    "frac_of_copy": 3 * numel / t / 1e6 / copy_gbps,
                }
            )
    finally:
        _cast.BLOCK, _cast.NUM_WARPS = saved
    return out


def _triton_version():
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        f"# Quantization kernels, {m['device']}",
        "",
        f"{m['date']}, torch {m['torch']}, triton {m['triton']}; input {m['shape'][0]}x{m['shape'][1]} {m['dtype']}; "
        f"{m['timer']}.",
        f"Device-to-device copy: {m['copy_ms']:.4f} ms = {m['copy_gbps']:.0f} GB/s (bytes read + written), the floor.",
        "",
        "| kernel | impl | B/elem | ms | GB/s | of copy | vs eager | vs compiled |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["records"]:
        vc = "" if r["speedup_vs_compiled"] is None else f"{r['speedup_vs_compiled']:.2f}x"
        lines.append(
            f"| {r['kernel']} | {r['impl']} | {r['bytes_per_elem']:.2f} | {r['ms']:.4f} | {r['gbps']:.0f} | "
            f"{100 * r['frac_of_copy']:.0f}% | {r['speedup_vs_eager']:.2f}x | {vc} |"
        )
    if result["host"]:
        lines += ["", "Host time per call, 256x256 bf16 (launch overhead):", "", "| call | us |", "| --- | ---: |"]
        lines += [f"| {h['what']} | {h['us_per_call']:.1f} |" for h in result["host"]]
    if result["sweep"]:
        lines += [
            "",
            "Sweep of our kernels' configurations:",
            "",
            "| kernel | config | ms | of copy |",
            "| --- | --- | ---: | ---: |",
        ]
        lines += [
            f"| {s['kernel']} | {s['config']} | {s['ms']:.4f} | {100 * s['frac_of_copy']:.0f}% |"
            for s in result["sweep"]
        ]
    return "\n".join(lines) + "\n"


def figures(result: dict) -> list:
    """The result's figures for history.csv: the copy floor; per kernel and implementation its ms, GB/s,
    fraction of the copy bandwidth and speedups over the baselines; host time per call; the sweep."""
    m = result["meta"]
    shape = "x".join(map(str, m["shape"]))
    out = [
        figure(f"copy {shape}", "x.clone()", "ms", m["copy_ms"]),
        figure(f"copy {shape}", "x.clone()", "GB/s", m["copy_gbps"]),
    ]
    metrics = (
        ("ms", "ms"),
        ("GB/s", "gbps"),
        ("fraction_of_copy", "frac_of_copy"),
        ("speedup_vs_eager", "speedup_vs_eager"),
        ("speedup_vs_compiled", "speedup_vs_compiled"),
    )
    for r in result["records"]:
        for metric, key in metrics:
            if r.get(key) is not None and not key.endswith(r["impl"]):  # not a baseline against itself
                out.append(figure(f"{r['kernel']} {shape}", r["impl"], metric, r[key]))
    out += [figure("host time per call, 256x256", h["what"], "us", h["us_per_call"]) for h in result["host"]]
    for w in result["sweep"]:
        out += [
            figure(f"sweep: {w['kernel']} {shape}", str(w["config"]), metric, w[key])
            for metric, key in (("ms", "ms"), ("fraction_of_copy", "frac_of_copy"))
        ]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/)")
    p.add_argument("--shape", type=int, nargs=2, default=[16384, 8192], metavar=("M", "K"))
    p.add_argument("--check-only", action="store_true", help="only check ours == reference, bit for bit")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    p.add_argument("--sweep", action="store_true", help="also time alternative tile/block configurations")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shape on the CPU, reference paths only")
    args = p.parse_args(argv)
    result = run(args)
    if not result:
        return result
    md = markdown(result)
    m = result["meta"]
    env = {k: m.get(k) for k in ("device", "date", "torch", "triton", "python")}
    env["command"] = command_line(None if argv is None else ["", *argv], module="benchmarks.kernels")
    record("kernels", args.out, env, figures(result), md, result)
    print(md)
    return result


if __name__ == "__main__":
    main()
