"""Where one forward+backward spends its GPU time: per-kernel totals from torch.profiler, ours against
torchao tensorwise (compiled) on the same shape, and the cuBLASLt rates of each of a Linear's three GEMMs
in both operand orders, with and without fast accumulation.

    python -m benchmarks.breakdown [--linear M K N ...] [--mlp] [--gemms] [--steps 5]

It is the profile behind the roofline column of `python -m benchmarks`: what is GEMM, what is not.
"""

from __future__ import annotations

import argparse
import collections

import torch

BF16, E4M3, E5M2 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2


def kernel_table(step, steps: int = 5) -> list:
    """[(kernel name, us per step, calls per step)], largest first, from a profile of `steps` steps."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total, calls = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            calls[e.name] += 1
    return [(name, us / steps, calls[name] / steps) for name, us in total.most_common()]


def print_table(title: str, rows: list, top: int = 14) -> None:
    whole = sum(us for _, us, _ in rows)
    print(f"--- {title}: {whole / 1e3:.3f} ms of kernels per step")
    for name, us, n in rows[:top]:
        gemm = "GEMM " if any(s in name.lower() for s in ("gemm", "sm90", "cutlass", "xmma", "nvjet")) else "     "
        print(f"  {gemm}{us / 1e3:8.3f} ms  x{n:4.1f}  {name[:110]}")


def _step(model, x, dy):
    params = [p for p in model.parameters() if p.requires_grad]

    def run():
        for p in params:
            p.grad = None
            torch.autograd.graph.increment_version(p)  # as an optimizer step: weights re-quantized
        x.grad = None
        model(x).backward(dy)

    return run


def _torchao(ref):
    import copy

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    m = convert_to_float8_training(copy.deepcopy(ref), config=Float8LinearConfig.from_recipe_name("tensorwise"))
    return torch.compile(m, dynamic=False)


def host_and_wall(step, n: int = 3) -> str:
    """Host time to enqueue n steps (no sync inside) against their wall time: host-bound if close."""
    import time

    from triton.testing import do_bench

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    med = do_bench(step, warmup=10, rep=200, return_mode="median")
    return (
        f"host {1e3 * (t1 - t0) / n:.3f} ms/step to enqueue, wall {1e3 * (t2 - t0) / n:.3f} ms/step, "
        f"do_bench median {med:.3f} ms"
    )


def compare(title: str, ref, ours, x, dy, steps: int) -> None:
    step = _step(ours, x, dy)
    print_table(f"{title} ours", kernel_table(step, steps))
    print(f"  ours: {host_and_wall(step)}")
    try:
        step = _step(_torchao(ref), x, dy)
        print_table(f"{title} torchao tensorwise + compile", kernel_table(step, steps))
        print(f"  torchao: {host_and_wall(step)}")
    except ImportError as e:
        print(f"--- {title} torchao: not importable ({e})")
    torch._dynamo.reset()


def linear(m: int, k: int, n: int, steps: int) -> None:
    import float8.ops as ops

    x = torch.randn(m, k, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=BF16)
    ref = torch.nn.Linear(k, n, bias=False).to("cuda", BF16)
    ours = ops.Linear(k, n, bias=False).to("cuda", BF16)
    compare(f"Linear {m}x{k}x{n}", ref, ours, x, dy, steps)


def mlp(steps: int, tokens: int = 16384, d: int = 4096, f: int = 14336) -> None:
    from benchmarks.blocks import Bf16MLP, fp8_mlp

    x = torch.randn(tokens, d, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn(tokens, d, device="cuda", dtype=BF16)
    compare(f"MLP {tokens}x{d}x{f}", Bf16MLP(d, f).to("cuda", BF16), fp8_mlp(d, f).to("cuda", BF16), x, dy, steps)


def gemm_orders(m: int, k: int, n: int) -> None:
    """Each GEMM of a Linear (fprop, dgrad, wgrad) as C = A @ B and as C.t() = B.t() @ A.t(), with and
    without fast accumulation: which operand order cuBLASLt runs faster at this shape."""
    from triton.testing import do_bench

    one = torch.ones((), device="cuda")

    def fp8(r, c, dtype=E4M3):
        return torch.randn(r, c, device="cuda").to(dtype)

    # (name, rows, inner, cols, dtype of A, dtype of B)
    gemms = [("fprop", m, k, n, E4M3, E4M3), ("dgrad", m, n, k, E5M2, E4M3), ("wgrad", n, m, k, E5M2, E4M3)]
    print(f"--- GEMM rates, Linear {m}x{k}x{n} (TFLOP/s; A row-major, B column-major)")
    for name, r, inner, c, da, db in gemms:
        a, b = fp8(r, inner, da), fp8(c, inner, db).t()
        bt, at = fp8(c, inner, db), fp8(r, inner, da).t()
        flops = 2 * r * inner * c
        row = []
        for fast in (False, True):
            ms1 = do_bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=BF16, use_fast_accum=fast), rep=100)
            ms2 = do_bench(lambda: torch._scaled_mm(bt, at, one, one, out_dtype=BF16, use_fast_accum=fast), rep=100)
            row.append(f"fast={fast!s:5}: A@B {flops / ms1 / 1e9:6.0f}, (B.t()@A.t()).t() {flops / ms2 / 1e9:6.0f}")
        print(f"  {name} ({r}x{inner}x{c}): " + " | ".join(row))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--linear", type=int, nargs=3, action="append", metavar=("M", "K", "N"))
    p.add_argument("--mlp", action="store_true")
    p.add_argument("--gemms", action="store_true", help="GEMM rates per operand order for each --linear shape")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for shape in args.linear or []:
        if args.gemms:
            gemm_orders(*shape)
        linear(*shape, steps=args.steps)
    if args.mlp:
        mlp(args.steps)


if __name__ == "__main__":
    main()
