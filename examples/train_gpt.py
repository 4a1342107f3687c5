"""Train a small GPT on real text, bf16 against FP8, and compare the loss curves.

    python examples/train_gpt.py            # on a GPU: 4 blocks of d=1024, 1000 steps per variant
    python examples/train_gpt.py --tiny     # a CPU-sized run (the default without a GPU)

The text is Python's own documentation (the `pydoc_data.topics` module that ships with every Python:
about 0.5 MB of English), read as bytes (a vocabulary of 256). Every variant sees the same batches.
- bf16: plain PyTorch blocks (RMSNorm, grouped-KV causal attention, SwiGLU), float32 master weights
  under bfloat16 autocast, and a bfloat16 residual stream, as the FP8 runs have: the comparison isolates
  the FP8 GEMMs. "bf16 fp32 residual" keeps the embedding's float32 output as the residual stream (what
  autocast alone gives), to show what that choice moves.
- fp8 current / fp8 delayed: the same blocks from float8 ops (FP8 GEMMs in forward and backward,
  per-tensor current or delayed scaling), float32 master weights, bfloat16 activations, and the fused
  linear + cross-entropy head in bfloat16: the LM head stays in high precision, as TransformerEngine's
  and torchao's guides advise (its output is the logits themselves).
- fp8 current + fp8 head: the head's GEMMs in FP8 too (per-tensor current scaling), to show what that costs.
- fp8 converted / fp8 converted lean: the bf16 variant's own blocks, written in plain PyTorch, through
  `ops.convert` (the path for existing models; its defaults, or `Recipe(lean_activations=True)`), under the
  same autocast; the LM head stays bf16.
--seeds K trains every variant K times (seed k: initial weights and batch order); each FP8 run is compared
with the bf16 run of its own seed, and the verdict is on the mean gap. Writes train_gpt.json (the curves,
the losses per seed) and train_gpt.png (mean curves, when matplotlib is installed) in --out, and says
whether each FP8 variant ended within 1% of bf16's held-out loss.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

import float8.ops as ops
from float8 import DelayedScaling, Recipe

# Small layers: without this the small-layer policy would (rightly, for speed) run them in bf16 on a GPU.
FP8 = {
    "fp8 current": Recipe(min_fp8_gemm_flops=0),
    "fp8 delayed": Recipe(input=DelayedScaling(), weight=DelayedScaling(), grad=DelayedScaling(), min_fp8_gemm_flops=0),
    "fp8 current + fp8 head": Recipe(min_fp8_gemm_flops=0),
}


# The plain PyTorch blocks through ops.convert, with its defaults or lean activations.
CONVERTED = {
    "fp8 converted": Recipe(min_fp8_gemm_flops=0),
    "fp8 converted lean": Recipe(min_fp8_gemm_flops=0, lean_activations=True),
}


VARIANTS = ["bf16", "bf16 fp32 residual", *FP8, *CONVERTED]


def load_text() -> torch.Tensor:
    """Python's documentation topics as a tensor of bytes."""
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


class TorchBlock(torch.nn.Module):
    """Pre-norm block in plain PyTorch: attention with grouped KV heads, then a SwiGLU MLP."""

    def __init__(self, d, heads, kv, ffn):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, d // heads
        self.attn_norm, self.mlp_norm = torch.nn.RMSNorm(d, eps=1e-6), torch.nn.RMSNorm(d, eps=1e-6)
        self.wqkv = torch.nn.Linear(d, (heads + 2 * kv) * self.hd, bias=False)
        self.wo = torch.nn.Linear(d, d, bias=False)
        self.w_in = torch.nn.Linear(d, 2 * ffn, bias=False)
        self.w_out = torch.nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        b, n, d = x.shape
        h = self.wqkv(self.attn_norm(x)).view(b, n, -1, self.hd).transpose(1, 2)
        q, k, v = h.split([self.heads, self.kv, self.kv], dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, n, d))
        gate, up = self.w_in(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w_out(F.silu(gate) * up)


def fp8_block(d, heads, kv, ffn, recipe):
    """The same block from float8 ops."""
    hd = d // heads
    return ops.Sequential(
        ops.Residual(),
        ops.RMSNorm(d),
        ops.Linear(d, (heads + 2 * kv) * hd, bias=False),
        ops.Attention(heads, hd, num_kv_heads=kv),
        ops.Linear(d, d, bias=False),
        ops.AddResidual(),
        ops.Residual(),
        ops.RMSNorm(d),
        ops.Linear(d, 2 * ffn, bias=False),
        ops.SwiGLU(),
        ops.Linear(ffn, d, bias=False),
        ops.AddResidual(),
        recipe=recipe,
    )


class GPT(torch.nn.Module):
    """Byte embedding, blocks, final norm and LM head; forward(tokens, targets) -> mean loss."""

    def __init__(self, cfg, recipe=None, fp32_residual=False, fp8_head=False, convert_recipe=None):
        super().__init__()
        self.fp32_residual = fp32_residual
        d, heads, kv, ffn, blocks = cfg["d"], cfg["heads"], cfg["kv"], cfg["ffn"], cfg["blocks"]
        self.fp8 = recipe is not None
        self.embed = torch.nn.Embedding(256, d)
        if self.fp8:
            self.blocks = torch.nn.ModuleList(fp8_block(d, heads, kv, ffn, recipe) for _ in range(blocks))
            # An FP8 head runs per-tensor current scaling (a fused loss keeps no amax history); else bf16 GEMMs.
            head_recipe = Recipe(min_fp8_gemm_flops=0) if fp8_head else None
            self.head = ops.Sequential(ops.RMSNorm(d), ops.LinearCrossEntropy(d, 256, recipe=head_recipe))
        else:
            self.blocks = torch.nn.ModuleList(TorchBlock(d, heads, kv, ffn) for _ in range(blocks))
            if convert_recipe is not None:  # the blocks' Linears become float8 ones; the head stays bf16
                ops.convert(self.blocks, recipe=convert_recipe)
            self.norm, self.lm_head = torch.nn.RMSNorm(d, eps=1e-6), torch.nn.Linear(d, 256, bias=False)

    def forward(self, tokens, targets):
        if self.fp8:  # float32 master weights, bfloat16 activations
            x = self.embed(tokens).to(torch.bfloat16)
            for block in self.blocks:
                x = block(x)
            return self.head(x, targets)
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
            x = self.embed(tokens)  # float32: autocast leaves embeddings alone
            if not self.fp32_residual:
                x = x.to(torch.bfloat16)
            for block in self.blocks:
                x = block(x)
            logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, 256), targets.reshape(-1))


def batches(data, steps, batch, seq, seed, device):
    """`steps` batches of random windows (the same ones for every variant, from `seed`)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        window = torch.stack([data[s : s + seq + 1] for s in start.tolist()]).to(device)
        yield window[:, :-1], window[:, 1:]


def learning_rate(step, steps, peak=1e-3, warmup=50):
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(variant, cfg, train_data, val_data, device, seed=0):
    """Train one variant from `seed`; returns its loss curve and held-out loss."""
    torch.manual_seed(seed)
    model = GPT(
        cfg,
        FP8.get(variant),
        fp32_residual=variant == "bf16 fp32 residual",
        fp8_head="fp8 head" in variant,
        convert_recipe=CONVERTED.get(variant),
    )
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    curve, start = [], time.perf_counter()
    for step, (x, y) in enumerate(batches(train_data, cfg["steps"], cfg["batch"], cfg["seq"], 1234 + seed, device)):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, cfg["steps"])
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve.append(loss.item())
        if not math.isfinite(curve[-1]):
            raise FloatingPointError(f"{variant}: the loss is {curve[-1]} at step {step}")
        _progress(f"{variant} s{seed}", step + 1, cfg["steps"], curve[-1], time.perf_counter() - start)
    with torch.no_grad():
        val = [
            model(x, y).item() for x, y in batches(val_data, cfg["val_batches"], cfg["batch"], cfg["seq"], 99, device)
        ]
    return {"curve": curve, "val_loss": sum(val) / len(val), "seconds": round(time.perf_counter() - start, 1)}


def _progress(variant, step, steps, loss, elapsed):
    every = max(1, steps // 20)
    if step % every and step != steps:
        return
    done = int(30 * step / steps)
    line = f"{variant:>22} [{'#' * done}{'.' * (30 - done)}] {step}/{steps} loss {loss:.3f} {elapsed:.0f}s"
    print(
        "\r" + line if sys.stdout.isatty() else line,
        end="" if sys.stdout.isatty() and step != steps else "\n",
        flush=True,
    )


def plot(results, path):
    """Loss curves (smoothed over 20 steps), bf16 and FP8, in one PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, r in results.items():
        c = torch.tensor(r["curves"]).mean(0)  # the mean over seeds
        smooth = c.unfold(0, 20, 1).mean(1) if len(c) >= 20 else c
        label = (
            f"{variant} (held-out {r['val_loss']:.3f}, {len(r['curves'])} seed{'s' if len(r['curves']) > 1 else ''})"
        )
        ax.plot(range(len(c) - len(smooth) + 1, len(c) + 1), smooth, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title("small GPT on Python's docs: bf16 against FP8")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a CPU-sized run (default without a GPU)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out", default=".", help="folder for train_gpt.json and train_gpt.png")
    p.add_argument("--seeds", type=int, default=1, help="runs per variant; the verdict is on the mean gap")
    p.add_argument("--first-seed", type=int, default=0, help="the seeds are first-seed .. first-seed + seeds - 1")
    p.add_argument(
        "--variants", default=None, help=f"comma-separated, from {VARIANTS} (bf16, the baseline, always runs)"
    )
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type == "cpu"
    cfg = (
        dict(d=64, heads=4, kv=2, ffn=128, blocks=2, batch=4, seq=32, steps=30, val_batches=2)
        if tiny
        else dict(d=1024, heads=16, kv=4, ffn=2816, blocks=4, batch=16, seq=512, steps=1000, val_batches=20)
    )
    cfg["steps"] = args.steps or cfg["steps"]
    data = load_text()
    split = int(0.9 * len(data))
    print(f"{len(data) / 1e6:.2f} MB of text, {cfg['steps']} steps of {cfg['batch']}x{cfg['seq']} tokens, {device}")
    variants = ["bf16", *[v for v in (args.variants.split(",") if args.variants else VARIANTS) if v != "bf16"]]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    runs = {v: [train(v, cfg, data[:split], data[split:], device, seed) for seed in seeds] for v in variants}
    results = {}
    for variant, rs in runs.items():
        vals = [r["val_loss"] for r in rs]
        # Paired: each seed's FP8 run against the bf16 run of the same seed (same initial weights, same batches).
        gaps = [r["val_loss"] / b["val_loss"] - 1 for r, b in zip(rs, runs["bf16"])]
        results[variant] = {
            "val_loss": sum(vals) / len(vals),
            "val_losses": vals,
            "vs_bf16_per_seed": [round(g, 4) for g in gaps],
            "vs_bf16": round(sum(gaps) / len(gaps), 4),
            "curves": [r["curve"] for r in rs],
            "seconds": [r["seconds"] for r in rs],
        }
    for variant, r in results.items():
        if variant.startswith("bf16"):
            verdict = ""
        elif tiny:  # 30 steps of a toy model say nothing about the 1% question: no verdict
            verdict = " (tiny run: no verdict on the 1% target)"
        else:
            verdict = " within 1%" if abs(r["vs_bf16"]) <= 0.01 else " NOT within 1%"
        per_seed = ", ".join(f"{100 * g:+.2f}%" for g in r["vs_bf16_per_seed"])
        print(
            f"{variant:>22}: held-out loss {r['val_loss']:.4f} ({100 * r['vs_bf16']:+.2f}% vs bf16, mean of {per_seed})"
            f"{verdict}, {sum(r['seconds']) / len(r['seconds']):.0f} s a run"
        )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "config": cfg,
        "seeds": list(seeds),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    (out / "train_gpt.json").write_text(json.dumps({**meta, "results": results}))
    png = plot(results, out / "train_gpt.png")
    print(f"wrote {out / 'train_gpt.json'}" + (f" and {png}" if png else " (no matplotlib: no plot)"))


if __name__ == "__main__":
    main()
