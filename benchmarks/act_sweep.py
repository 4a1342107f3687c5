"""Time the two passes of the fused SwiGLU -> FP8 kernels (forward: act_fp8 with transpose; backward:
dact_fp8) and the alternative tiles of their transposing pass, at the MLP block's shape.

    python -m benchmarks.act_sweep [--tokens 16384] [--ffn 14336]

Each variant's outputs are checked bit for bit against the default configuration's before it is timed.
Bytes per pass are the least the pass moves (bf16 in, FP8 out in both layouts), against the copy floor
measured in the same run.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import make_timer
from float8.kernels import activation as act

BF16, E4M3, E5M2 = torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2

VARIANTS = [
    dict(BLOCK_S=64, BLOCK_N=64, num_warps=4, T_MODE=0),
    dict(BLOCK_S=64, BLOCK_N=64, num_warps=4, T_MODE=1),
    dict(BLOCK_S=64, BLOCK_N=64, num_warps=4, T_MODE=2),
    dict(BLOCK_S=64, BLOCK_N=128, num_warps=8, T_MODE=0),
    dict(BLOCK_S=64, BLOCK_N=128, num_warps=8, T_MODE=1),
    dict(BLOCK_S=64, BLOCK_N=128, num_warps=8, T_MODE=2),
    dict(BLOCK_S=128, BLOCK_N=64, num_warps=8, T_MODE=1),
    dict(BLOCK_S=128, BLOCK_N=64, num_warps=8, T_MODE=2),
    dict(BLOCK_S=128, BLOCK_N=128, num_warps=8, T_MODE=1),
    dict(BLOCK_S=32, BLOCK_N=128, num_warps=4, T_MODE=1),
]


def _same(a, b) -> bool:
    bits = {1: torch.uint8, 4: torch.int32}[a.element_size()]  # NaN-safe: compare the bits
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits))


def sweep(tokens: int, ffn: int, device: str, variants=VARIANTS) -> list:
    """[(pass, config or None, ms, fraction of copy)]: the default passes, then every variant."""
    bench = make_timer(device == "cuda", warmup=10, rep=60)
    x = torch.randn(tokens, 2 * ffn, device=device).mul_(2).to(BF16)
    dy = torch.randn(tokens, ffn, device=device).to(BF16)
    copy = bench(lambda: x.clone())
    gbps = 4 * x.numel() / copy / 1e6  # read + written
    n_out = tokens * ffn
    zeros = lambda: torch.zeros((), dtype=torch.float32, device=device)  # noqa: E731
    empty = lambda *s, dt=torch.float32: torch.empty(s, dtype=dt, device=device)  # noqa: E731
    rows = []

    def frac(nbytes, ms):
        return nbytes / ms / 1e6 / gbps

    # forward: pass 1 reads x (2 bytes x 2 ffn); pass 2 reads x and writes data and data_t (1 + 1 per output)
    amax, scale_inv = zeros(), empty()
    t = bench(
        lambda: act.launch_fwd(x, "swiglu", None, None, None, None, amax, scale_inv, mode="amax", transpose=False)
    )
    rows.append(("fwd pass 1 (amax)", None, t, frac(4 * n_out, t)))
    ref = act.act_fp8_triton(x, "swiglu", None, E4M3, with_transpose=True)
    for cfg in [None, *variants]:
        out = act.act_fp8_triton(x, "swiglu", None, E4M3, with_transpose=True, config=cfg)
        if not all(_same(o, r) for o, r in zip(out, ref)):
            raise AssertionError(f"forward variant {cfg} wrote different bits than the default")
        data, data_t = empty(tokens, ffn, dt=E4M3), empty(ffn, tokens, dt=E4M3)
        t = bench(
            lambda: act.launch_fwd(
                x,
                "swiglu",
                None,
                data,
                data_t,
                None,
                ref[3],
                scale_inv,
                mode="current",
                transpose=True,
                fp8_dtype=E4M3,
                config=cfg,
            )
        )
        rows.append(("fwd pass 2 (cast + transpose)", cfg, t, frac(6 * n_out, t)))
    # backward: pass 1 reads dy and x (2 + 4 per output); pass 2 the same and writes dx, dx_t (2 + 2)
    # (no bias: the MLP block's case, with_dbias=False)
    ref = act.dact_fp8_triton(dy, x, "swiglu", None, E5M2, with_dbias=False)
    t = bench(
        lambda: act.launch_bwd(
            dy, x, "swiglu", None, None, None, None, None, amax, scale_inv, mode="amax", transpose=False
        )
    )
    rows.append(("bwd pass 1 (amax)", None, t, frac(6 * n_out, t)))
    parts = act.dbias_partials(dy, 2 * ffn)
    t = bench(
        lambda: act.launch_bwd(
            dy, x, "swiglu", None, None, None, parts, None, amax, scale_inv, mode="amax", transpose=False
        )
    )
    rows.append(("bwd pass 1 (amax, dbias)", None, t, frac(6 * n_out, t)))
    for cfg in [None, *variants]:
        out = act.dact_fp8_triton(dy, x, "swiglu", None, E5M2, with_dbias=False, config=cfg)
        if not all(_same(o, r) for o, r in zip(out[:4], ref[:4])):
            raise AssertionError(f"backward variant {cfg} wrote different bits than the default")
        dx, dx_t = empty(tokens, 2 * ffn, dt=E5M2), empty(2 * ffn, tokens, dt=E5M2)
        t = bench(
            lambda: act.launch_bwd(
                dy,
                x,
                "swiglu",
                None,
                dx,
                dx_t,
                None,
                None,
                ref[3],
                scale_inv,
                mode="current",
                transpose=True,
                fp8_dtype=E5M2,
                config=cfg,
            )
        )
        rows.append(("bwd pass 2 (cast + transpose)", cfg, t, frac(10 * n_out, t)))
    return rows


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    rows = sweep(args.tokens, args.ffn, args.device)
    print(f"SwiGLU FP8 passes, x ({args.tokens}, {2 * args.ffn}) bf16, default transposing tile {act.TRANSPOSE_CONFIG}")
    for name, cfg, ms, f in rows:
        print(f"  {name:32s} {'default' if cfg is None else cfg}: {ms:.4f} ms, {100 * f:.0f}% of copy")
    return rows


if __name__ == "__main__":
    main()
