"""What one piece of an eager step costs the host: allocations, a torch op, a Triton launch, an autograd
Function, and float8's ops called alone, each timed over a stream of calls on tiny tensors (GPU work
negligible). The pieces that benchmarks.host's whole steps are made of.

    python -m benchmarks.host_parts [--out DIR]

Recorded as the area "host_parts" in DIR (default benchmarks/results/; benchmarks.harness.record).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.harness import add_out_argument, environment, figure, host_us, record


@triton.jit
def _scale_shift(x_ptr, y_ptr, n, a, b, c1, c2, c3, c4, c5, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    # Twelve arguments, about as many as float8's norm and activation kernels take.
    offs = tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * a + b, mask=m)


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.view_as(a)

    @staticmethod
    def backward(ctx, g):
        return g


def measure() -> dict:
    """Microseconds per call of each piece (CUDA)."""
    import float8.ops as ops

    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(16, 64, device=dev, dtype=bf16)
    y = torch.empty_like(x)
    w = torch.randn(64, device=dev, dtype=bf16)
    xg = x.clone().requires_grad_()
    norm, gelu = ops.RMSNorm(64).to(dev, bf16), ops.GELU()
    torch_seq = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.RMSNorm(64), torch.nn.GELU()).to(
        dev, bf16
    )
    ours_seq = ops.Sequential(ops.Linear(64, 64, bias=False), ops.RMSNorm(64), ops.GELU()).to(dev, bf16)
    pieces = {
        "torch.empty": lambda: torch.empty((16, 64), dtype=bf16, device=dev),
        "torch.zeros(())": lambda: torch.zeros((), dtype=torch.float32, device=dev),
        "x.add_(0)": lambda: x.add_(0),
        "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (64,), w, 1e-6),
        "Triton launch, 12 arguments": lambda: _scale_shift[(1,)](
            x, y, 1024, 1.0, 0.0, 1, 2, 3, 4, 5, BLOCK=1024, FLAG=True
        ),
        "autograd Function apply": lambda: _Identity.apply(xg),
    }
    from float8 import Recipe

    forced = ops.Sequential(
        ops.Linear(64, 64, bias=False), ops.RMSNorm(64), ops.GELU(), recipe=Recipe(min_fp8_gemm_flops=0)
    ).to(dev, bf16)
    with torch.no_grad():
        pieces.update(
            {
                "ops.RMSNorm forward (no grad)": lambda: norm(x),
                "ops.GELU forward (no grad)": lambda: gelu(x),
                "torch.nn Linear->RMSNorm->GELU forward (no grad)": lambda: torch_seq(x),
                "ops.Sequential of the same, default recipe, forward (no grad)": lambda: ours_seq(x),
                "ops.Sequential of the same, FP8 forced, forward (no grad)": lambda: forced(x),
            }
        )
        return {name: round(host_us(fn, n=2000, warmup=50), 1) for name, fn in pieces.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_argument(p)
    args = p.parse_args(argv)
    result = measure()
    for name, us in result.items():
        print(f"{us:8.1f} us  {name}")
    figures = [figure("host time per call", name, "us", us) for name, us in result.items()]
    record("host_parts", args.out, environment(torch.device("cuda")), figures, None, {"us_per_call": result})
    return result


if __name__ == "__main__":
    main()
