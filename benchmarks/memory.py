"""Memory benchmarks of issue 10, one run: the fused LM head + loss, FP8-only inference, and what a training
step holds.

    python -m benchmarks.memory [--out DIR] [--tiny] [--only lce,inference,train,activations]

lce: loss and gradients of a (V=128256, H=4096) LM head on 16384 bf16 tokens, forward+backward: the naive
    F.cross_entropy(F.linear(x, w).float(), t), float8's linear_cross_entropy in bf16 and with FP8 GEMMs,
    Liger-Kernel's and Cut Cross-Entropy's fused losses (when they import). Time (median), peak memory
    above the inputs, and the same less the gradients' own bytes; loss and gradients against the naive.
inference: a ~1B-parameter stack of Llama blocks (d=2048, 16 blocks), bf16 against FP8-only weights
    (ops.convert(..., fp8_weights=True)): weight bytes by torch.cuda.memory_allocated, forward time at
    4096 tokens and at decode-shaped 16/64/128 tokens.
train: 8 Llama blocks (d=4096, FFN 14336, 32 heads, 8 KV heads), 8x2048 tokens, AdamW (fused), whole
    steps: memory allocated between steps and the step's peak: bf16 eager, float8.ops eager (also with
    Recipe(lean_activations=True), and with ops.requantize_weights after each optimizer step) and
    torchao's tensorwise float8 training compiled.
activations: peaks of a training step (weights, AdamW states and activations) of the seed #1119 layer
    (hidden 4096, FFN 16384, 32 heads and 8 KV heads of 128, biases, LayerNorm, GELU, no mask, 32x1024
    tokens) and of the MLP block (RMSNorm, SwiGLU, d=4096, FFN 14336, 16384 tokens), bf16 against float8.ops
    (default and lean-activation recipes) and against the bf16 layer itself through ops.convert (both recipes).
The training cases' loss is out.sum(), as in the seed thread's script (TE #1119): no float32 copy of the
output joins the peak.
Public APIs only. Timings are medians of CUDA-event times after warm-up; on a CPU (--tiny) it only checks
the plumbing. Each case is recorded as it ends, as the area memory_<case> in DIR (default benchmarks/results/;
a DIR/x.json given stands for DIR; benchmarks.harness.record: latest.json with the case's whole result,
latest.md, history.csv).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.harness import environment, figures_from_rows, record

MiB = 2**20


def _lean():
    from float8 import Recipe

    return Recipe(lean_activations=True)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, dev, warm=2, reps=8):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _peak_above(fn, dev):
    """(peak bytes allocated during fn above what was allocated before it, bytes left allocated after)."""
    if dev.type != "cuda":
        fn()
        return 0, 0
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base


def _sqnr(ref, got):
    ref, got = ref.double(), got.double()
    return round(float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum().clamp_min(1e-300))), 1)


# ---- lce ---------------------------------------------------------------------------------------------------


def _lce_variants():
    from float8 import Recipe
    from float8.ops.functional import linear_cross_entropy

    variants = {
        "naive (F.linear + .float() + F.cross_entropy)": lambda x, w, t: F.cross_entropy(F.linear(x, w).float(), t),
        "float8 bf16": lambda x, w, t: linear_cross_entropy(x, w, t),
        "float8 bf16, dw in bf16": lambda x, w, t: linear_cross_entropy(x, w, t, dw_accumulation="weight_dtype"),
        "float8 bf16, dw in bf16, 1024-token chunks": lambda x, w, t: linear_cross_entropy(
            x, w, t, dw_accumulation="weight_dtype", chunk_tokens=1024
        ),
        # The default with a recipe: the weight gradient's GEMM in bf16, summed in the gradient (weight_dtype)
        "float8 FP8 GEMMs": lambda x, w, t: linear_cross_entropy(x, w, t, recipe=Recipe()),
        "float8 FP8 GEMMs, dw in bf16, 2048-token chunks": lambda x, w, t: linear_cross_entropy(
            x, w, t, recipe=Recipe(), chunk_tokens=2048
        ),
        "float8 FP8 GEMMs, FP8 dw in float32": lambda x, w, t: linear_cross_entropy(
            x, w, t, recipe=Recipe(), dw_accumulation="float32"
        ),
    }
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        variants["Liger-Kernel 0.8.5"] = lambda x, w, t: liger(w, x, t)
    except Exception as e:  # noqa: BLE001 - a peer that does not import is reported, not fatal
        print(f"liger-kernel not measured: {type(e).__name__}: {e}")
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        variants["Cut Cross-Entropy 25.1.1"] = lambda x, w, t: cce(x, w, t)
    except Exception as e:  # noqa: BLE001
        print(f"cut-cross-entropy not measured: {type(e).__name__}: {e}")
    return variants


def bench_lce(dev, tiny):
    n, h, v = (256, 64, 1000) if tiny else (16384, 4096, 128256)
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(n, h, device=dev, generator=g) * 1.0).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(v, h, device=dev, generator=g) * 0.02).to(torch.bfloat16).requires_grad_(True)
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    grad_bytes = (x.numel() + w.numel()) * 2
    rows, ref = [], None
    for name, fn in _lce_variants().items():

        def step():
            x.grad = w.grad = None
            fn(x, w, t).backward()

        try:
            ms = _time_ms(step, dev, warm=2, reps=3 if tiny else 8)
            x.grad = w.grad = None
            peak, _ = _peak_above(step, dev)
            loss = fn(x, w, t).detach().float()
        except Exception as e:  # noqa: BLE001 - recorded as a failed variant
            rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"[:300]})
            print(f"{name}: FAILED {e}")
            continue
        got = (loss, x.grad.detach().clone(), w.grad.detach().clone())
        if ref is None:
            ref = got
        row = {
            "variant": name,
            "ms": round(ms, 2),
            "peak_MiB": round(peak / MiB, 1),
            "peak_above_grads_MiB": round((peak - grad_bytes) / MiB, 1),
            "loss": round(float(loss), 5),
            "dx_sqnr_db": _sqnr(ref[1], got[1]),
            "dw_sqnr_db": _sqnr(ref[2], got[2]),
        }
        rows.append(row)
        print(row)
        x.grad = w.grad = None
        gc.collect()
    base = rows[0].get("ms")
    for r in rows:
        if base and "ms" in r:
            r["vs_naive"] = round(r["ms"] / base, 3)
    return {"shape": {"tokens": n, "hidden": h, "vocab": v}, "grad_bytes_MiB": round(grad_bytes / MiB, 1), "rows": rows}


# ---- inference -----------------------------------------------------------------------------------------------


def _stack(dev, cfg, fp8):
    import float8.ops as ops
    from benchmarks.distributed import Block, ops_block
    from float8 import Recipe

    d, heads, kv, hd, ffn, blocks = cfg
    torch.manual_seed(0)
    with torch.device(dev):
        if not fp8:
            return torch.nn.Sequential(*[Block(d, heads, kv, hd, ffn) for _ in range(blocks)]).to(torch.bfloat16)
        model = torch.nn.Sequential(*[ops_block(d, heads, kv, hd, ffn, recipe=Recipe()) for _ in range(blocks)]).to(
            torch.bfloat16
        )
    return ops.convert(model, fp8_weights=True)


def bench_inference(dev, tiny):
    from float8 import memory_footprint

    cfg = (64, 4, 2, 16, 128, 2) if tiny else (2048, 16, 4, 128, 8192, 16)
    token_counts = (16, 64) if tiny else (16, 64, 128, 4096)
    out = {"config": dict(zip(("d", "heads", "kv_heads", "head_dim", "ffn", "blocks"), cfg)), "rows": []}
    times = {}
    for name, fp8 in (("bf16", False), ("float8 FP8-only weights", True)):
        gc.collect()
        before = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
        model = _stack(dev, cfg, fp8)
        gc.collect()
        held = (torch.cuda.memory_allocated() - before) if dev.type == "cuda" else 0
        row = {
            "variant": name,
            "params": sum(p.numel() for p in model.parameters()),
            "allocated_MiB": round(held / MiB, 1),
            "footprint_MiB": round(memory_footprint(model) / MiB, 1),
        }
        with torch.inference_mode():
            for m in token_counts:
                x = torch.randn(1, m, cfg[0], device=dev, dtype=torch.bfloat16)
                ms = _time_ms(lambda: model(x), dev, warm=3, reps=5 if tiny else 20)
                row[f"ms_{m}_tokens"] = round(ms, 3)
                times[(name, m)] = ms
        out["rows"].append(row)
        print(row)
        model = None  # freed before the next variant (a del would unbind what the timing lambda reads)
    out["host_profile"] = _host_profile(dev, cfg)
    bf, f8 = out["rows"]
    if bf["allocated_MiB"]:
        out["weights_ratio"] = round(f8["allocated_MiB"] / bf["allocated_MiB"], 3)
    out["speedup"] = {m: round(times[("bf16", m)] / times[("float8 FP8-only weights", m)], 3) for m in token_counts}
    return out


def _host_profile(dev, cfg, calls=5):
    """Where the host time of an FP8-only forward at 16 tokens goes: cProfile's top functions by own time."""
    import cProfile
    import io
    import pstats

    model = _stack(dev, cfg, True)
    x = torch.randn(1, 16, cfg[0], device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():
        for _ in range(3):
            model(x)
        _sync(dev)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            model(x)
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()[-6000:]


# ---- train ---------------------------------------------------------------------------------------------------


def bench_train(dev, tiny):
    from benchmarks.distributed import Block, ops_block

    cfg = (64, 4, 2, 16, 128, 2) if tiny else (4096, 32, 8, 128, 14336, 8)
    batch, seq = (2, 32) if tiny else (8, 2048)
    d, heads, kv, hd, ffn, blocks = cfg
    import float8.ops as ops

    rows = []
    variants = [
        "bf16 eager",
        "float8 eager",
        "float8 eager, lean activations",
        "float8 eager + requantize_weights",
        "torchao tensorwise + compile",
    ]
    for name in variants:
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        torch.manual_seed(0)
        with torch.device(dev):
            if name.startswith("float8"):
                recipe = _lean() if "lean" in name else None
                model = torch.nn.Sequential(*[ops_block(d, heads, kv, hd, ffn, recipe) for _ in range(blocks)])
            else:
                model = torch.nn.Sequential(*[Block(d, heads, kv, hd, ffn) for _ in range(blocks)])
        model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
        run = model
        if name.startswith("torchao"):
            try:
                if dev.type != "cuda":
                    raise RuntimeError("torchao's float8 training needs a CUDA GPU")
                from torchao.float8 import convert_to_float8_training

                convert_to_float8_training(model)
                run = torch.compile(model)
            except Exception as e:  # noqa: BLE001 - a peer that does not run is reported, not fatal
                rows.append({"variant": name, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"{name}: not measured: {e}")
                model = opt = None
                continue
        requantize = name.endswith("requantize_weights")
        x = torch.randn(batch, seq, d, device=dev, dtype=torch.bfloat16)

        def step():
            opt.zero_grad(set_to_none=True)
            run(x).sum().backward()  # the seed thread's loss (TE #1119)
            opt.step()
            if requantize:
                ops.requantize_weights(model)

        for _ in range(2):
            step()  # optimizer states exist from here on
        between, peak = [], []
        for _ in range(3):
            if dev.type == "cuda":
                torch.cuda.synchronize()
                between.append(torch.cuda.memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            step()
            if dev.type == "cuda":
                torch.cuda.synchronize()
                peak.append(torch.cuda.max_memory_allocated())
        ms = _time_ms(step, dev, warm=1, reps=2 if tiny else 5)
        row = {
            "variant": name,
            "ms_per_step": round(ms, 1),
            "between_steps_GiB": round(max(between) / 2**30, 2) if between else None,
            "step_peak_GiB": round(max(peak) / 2**30, 2) if peak else None,
        }
        rows.append(row)
        print(row)
        model = opt = x = run = None  # freed before the next variant
    return {"config": {"d": d, "ffn": ffn, "blocks": blocks, "tokens": batch * seq}, "rows": rows}


# ---- activations -----------------------------------------------------------------------------------------------


class Seed1119Layer(torch.nn.Module):
    """The transformer layer of the seed thread (TransformerEngine's layer config) in plain PyTorch: LayerNorm,
    QKV with bias, grouped-query attention through SDPA's enable_gqa (no mask), projection with bias,
    LayerNorm, FC1 with bias, GELU, FC2 with bias, both on residual branches."""

    def __init__(self, d, ffn, heads, kv, hd):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv, hd
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, (heads + 2 * kv) * hd)
        self.proj = torch.nn.Linear(heads * hd, d)
        self.fc1, self.fc2 = torch.nn.Linear(d, ffn), torch.nn.Linear(ffn, d)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, self.h + 2 * self.kv, self.hd).transpose(1, 2)
        q, k, v = qkv.split([self.h, self.kv, self.kv], dim=1)
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=self.kv != self.h).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def seed1119_ops(d, ffn, heads, kv, hd, recipe=None):
    """The same layer from float8.ops."""
    import float8.ops as ops

    return ops.Sequential(
        ops.Residual(),
        ops.LayerNorm(d),
        ops.Linear(d, (heads + 2 * kv) * hd),
        ops.Attention(heads, hd, num_kv_heads=kv, causal=False),
        ops.Linear(heads * hd, d),
        ops.AddResidual(),
        ops.Residual(),
        ops.LayerNorm(d),
        ops.Linear(d, ffn),
        ops.GELU(),
        ops.Linear(ffn, d),
        ops.AddResidual(),
        recipe=recipe,
    )


def _step_peaks(model, x, dev):
    """(fwd+bwd peak, AdamW step peak, ms per step): peaks are max_memory_allocated, weights included."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")

    def fwd_bwd():
        model(x).sum().backward()  # the seed thread's loss (TE #1119): no float32 copy of the output

    def step():
        opt.zero_grad(set_to_none=True)
        fwd_bwd()
        opt.step()

    for _ in range(2):
        step()
    peaks = []
    for fn in (fwd_bwd, step):
        opt.zero_grad(set_to_none=True)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() / MiB if dev.type == "cuda" else 0.0)
    ms = _time_ms(step, dev, warm=1, reps=3)
    opt = None
    return peaks[0], peaks[1], ms


def bench_activations(dev, tiny):
    import float8.ops as ops
    from benchmarks.blocks import Bf16MLP, fp8_mlp

    layer_cfg = (64, 256, 4, 2, 16) if tiny else (4096, 16384, 32, 8, 128)
    layer_tokens = (2, 32) if tiny else (32, 1024)
    mlp_cfg, mlp_tokens = ((64, 96), (2, 32)) if tiny else ((4096, 14336), (8, 2048))
    cases = {
        "seed #1119 layer": (
            lambda: Seed1119Layer(*layer_cfg),
            lambda r: seed1119_ops(*layer_cfg, recipe=r),
            layer_cfg[0],
            layer_tokens,
        ),
        "MLP block": (lambda: Bf16MLP(*mlp_cfg), lambda r: fp8_mlp(*mlp_cfg, recipe=r), mlp_cfg[0], mlp_tokens),
    }
    out = {}
    for case, (make_bf16, make_ours, d, (b, s)) in cases.items():
        rows = []
        variants = (
            ("bf16 eager", make_bf16),
            ("float8 eager", lambda: make_ours(None)),
            ("float8 eager, lean activations", lambda: make_ours(_lean())),
            # The layer as users write it (plain torch), converted: the path the README recommends.
            ("float8 ops.convert", lambda: ops.convert(make_bf16().to(torch.bfloat16))),
            (
                "float8 ops.convert, lean activations",
                lambda: ops.convert(make_bf16().to(torch.bfloat16), recipe=_lean()),
            ),
        )
        for name, make in variants:
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            torch.manual_seed(0)
            with torch.device(dev):
                model = make().to(torch.bfloat16)
            x = torch.randn(b, s, d, device=dev, dtype=torch.bfloat16)
            fb, st, ms = _step_peaks(model, x, dev)
            rows.append(
                {
                    "variant": name,
                    "fwd_bwd_peak_MiB": round(fb, 1),
                    "step_peak_MiB": round(st, 1),
                    "ms_per_step": round(ms, 2),
                }
            )
            print(case, rows[-1])
            del model, x
        bf = rows[0]
        for ours in rows[1:] if bf["step_peak_MiB"] else ():
            ours["step_peak_vs_bf16"] = round(ours["step_peak_MiB"] / bf["step_peak_MiB"], 3)
            ours["fwd_bwd_peak_vs_bf16"] = round(ours["fwd_bwd_peak_MiB"] / bf["fwd_bwd_peak_MiB"], 3)
            ours["ms_vs_bf16"] = round(bf["ms_per_step"] / ours["ms_per_step"], 3)
        out[case] = {"tokens": b * s, "rows": rows}
    return out


def figures(case: str, part: dict) -> list:
    """A case's figures for history.csv: a figure per number of each row of its tables (activations: a
    table per model)."""
    if "rows" in part:
        return figures_from_rows(part["rows"], case)
    return [
        f
        for name, sub in part.items()
        if isinstance(sub, dict) and "rows" in sub
        for f in figures_from_rows(sub["rows"], f"{case}: {name}")
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--only", default="lce,inference,train,activations")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    env = environment(dev)
    for case in args.only.split(","):
        t0 = time.perf_counter()
        result[case] = {
            "lce": bench_lce,
            "inference": bench_inference,
            "train": bench_train,
            "activations": bench_activations,
        }[case](dev, args.tiny)
        print(f"== {case}: {time.perf_counter() - t0:.0f} s", flush=True)
        record(f"memory_{case}", args.out, env, figures(case, result[case]), None, result[case])
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return result


if __name__ == "__main__":
    main()
