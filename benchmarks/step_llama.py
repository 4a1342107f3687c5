"""python -m benchmarks.step_llama [--tiny] [--out DIR] [--variants a,b] [--batch B --seq S] [--separate-gate-up]
[--separate-qkv]:
whole training steps of the Llama-style model (benchmarks/llama.py): zero_grad, forward, backward and an AdamW
step (foreach), for each variant, at B x S tokens (default 8 x 2048); with --separate-gate-up its plain-torch
MLP has a gate and an up projection, as Hugging Face's Llama (one gate-and-up projection otherwise); with
--separate-qkv its attention has q, k and v projections, as Hugging Face's Llama (one qkv otherwise). Reports
ms per step (each step started from a synchronized GPU, and 8 steps back to back), tokens/s, the step's peak
memory, and the kernels one step spends its time in, for the variants that say `breakdown`. Recorded as the
area "step_llama" in DIR (default benchmarks/results/; benchmarks.harness.record)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import List

import torch

from benchmarks.harness import (
    environment,
    free_memory,
    kernel_breakdown,
    markdown_table,
    step_peak_bytes,
    time_back_to_back,
    time_steps,
    write_report,
)
from benchmarks.llama import TINY, LlamaShape, build, compile_blocks
from float8 import Recipe

VARIANTS = [
    "bf16 eager",
    "bf16 compiled",
    "float8 ops eager",
    "float8 ops eager lean",
    "float8 ops compiled",
    "float8 ops compiled lean",
    "float8 converted eager",
    "float8 converted eager unfused",
    "float8 converted eager lean",
    "float8 converted eager all fp8",
    "float8 converted compiled",
    "float8 converted compiled all fp8",
    "float8 converted compiled lean",
    "torchao tensorwise compiled",
    "torchao rowwise compiled",
]
BREAKDOWN = {
    "float8 converted eager",
    "float8 converted compiled",
    "torchao tensorwise compiled",
    "float8 ops eager",
    "float8 ops compiled",
}


def variant_model(variant: str, s: LlamaShape, device) -> torch.nn.Module:
    """The Llama-style model of one variant (VARIANTS), on `device`, compiled per block where the name says so."""
    if variant.startswith("bf16"):
        model = build("torch", s, device)
    elif variant.startswith("float8 ops"):
        if s.separate_gate_up or s.separate_qkv:
            raise ValueError(
                "float8 ops blocks have one qkv and one gate-and-up projection: no separate-projection form"
            )
        model = build("ops", s, device, Recipe(lean_activations=True) if "lean" in variant else None)
    elif variant.startswith("float8 converted"):
        recipe = Recipe(lean_activations=True) if "lean" in variant else None
        if "all fp8" in variant:  # no small-layer policy: every Linear in FP8, as torchao converts them
            recipe = Recipe(min_fp8_gemm_flops=0)
        model = build("converted", s, device, recipe, fuse_swiglu="unfused" not in variant)
    elif variant.startswith("torchao"):
        if device.type != "cuda":
            raise RuntimeError("torchao's float8 training needs a CUDA GPU")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        model = build("torch", s, device)
        config = Float8LinearConfig.from_recipe_name("rowwise") if "rowwise" in variant else Float8LinearConfig()
        convert_to_float8_training(model, config=config)
    else:
        raise ValueError(variant)
    if "compiled" in variant:
        compile_blocks(model)
    return model


def build_step(variant: str, s: LlamaShape, device):
    """(step, losses): one whole training step of `variant` (zero_grad, forward, backward, AdamW foreach),
    and the list each step appends its loss to."""
    model = variant_model(variant, s, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, s.vocab, (s.batch, s.seq), device=device, generator=gen)
    target = torch.randint(0, s.vocab, (s.batch, s.seq), device=device, generator=gen)
    losses: List[float] = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, target)
        loss.backward()
        opt.step()
        losses.append(loss.detach())

    return step, losses


def run_variant(variant: str, s: LlamaShape, device, breakdown: bool) -> dict:
    """One variant's record: ms per step, tokens/s, peak GiB (and its kernel breakdown)."""
    step, losses = build_step(variant, s, device)
    for _ in range(3):
        step()  # compile, autotune, and the optimizer's states exist from here on
    ms = time_steps(step, device, warmup=0, reps=5 if device.type == "cuda" else 2)
    ms_b2b = time_back_to_back(step, device, steps=8 if device.type == "cuda" else 2)
    held = torch.cuda.memory_allocated() if device.type == "cuda" else None  # between steps
    peak = step_peak_bytes(step, device)
    row = {
        "variant": variant,
        "tokens": s.batch * s.seq,
        "attention": "q, k, v" if s.separate_qkv else "qkv",
        "mlp": "gate, up" if s.separate_gate_up else "gate-up",
        "ms_per_step": round(ms, 1),
        "ms_per_step_back_to_back": round(ms_b2b, 1),
        "tokens_per_s": round(s.batch * s.seq / ms * 1e3),
        "peak_GiB": None if peak is None else round(peak / 2**30, 2),
        "peak_above_held_GiB": None if peak is None else round((peak - held) / 2**30, 2),
        "final_loss": round(float(losses[-1]), 4),
    }
    if breakdown:
        row["kernels"] = kernel_breakdown(step, device)
    del step
    free_memory()
    return row


def run(
    device, tiny: bool, variants=None, batch=None, seq=None, separate_gate_up=False, separate_qkv=False
) -> List[dict]:
    """Every variant (or those named), one record each; a variant that fails records its error."""
    s = TINY if tiny else LlamaShape()
    s = dataclasses.replace(
        s, batch=batch or s.batch, seq=seq or s.seq, separate_gate_up=separate_gate_up, separate_qkv=separate_qkv
    )
    rows = []
    for variant in variants or VARIANTS:
        try:
            row = run_variant(variant, s, device, breakdown=variant in BREAKDOWN and not tiny)
        except Exception as e:  # noqa: BLE001 - a variant that does not run is recorded, not fatal
            row = {"variant": variant, "error": f"{type(e).__name__}: {e}"[:400]}
            free_memory()
        print({k: v for k, v in row.items() if k != "kernels"}, flush=True)
        if row.get("kernels"):
            print("  kernels", row["kernels"]["total_ms"], "ms:", row["kernels"]["groups"], flush=True)
        rows.append(row)
    base = {r["variant"]: r.get("ms_per_step") for r in rows}
    for r in rows:
        for ref in ("bf16 eager", "bf16 compiled", "torchao tensorwise compiled"):
            if r.get("ms_per_step") and base.get(ref):
                r[f"speed_vs_{ref.replace(' ', '_')}"] = round(base[ref] / r["ms_per_step"], 3)
    return rows


COLUMNS = [
    "variant",
    "tokens",
    "attention",
    "mlp",
    "ms_per_step",
    "ms_per_step_back_to_back",
    "tokens_per_s",
    "peak_GiB",
    "peak_above_held_GiB",
    "speed_vs_bf16_eager",
    "speed_vs_bf16_compiled",
    "speed_vs_torchao_tensorwise_compiled",
    "final_loss",
    "error",
]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_llama", description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU smoke test; the default without CUDA)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/)")
    p.add_argument("--variants", default=None, help="comma-separated variant names (default: all)")
    p.add_argument("--area", default="step_llama", help="the results area this run replaces")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; tiny 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; tiny 32)")
    p.add_argument(
        "--separate-gate-up",
        action="store_true",
        help="the plain-torch MLP with separate gate and up projections, as Hugging Face's Llama writes it",
    )
    p.add_argument(
        "--separate-qkv",
        action="store_true",
        help="the plain-torch attention with separate q, k and v projections, as Hugging Face's Llama has them",
    )
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    variants = args.variants.split(",") if args.variants else None
    tiny = args.tiny or device.type == "cpu"
    rows = run(device, tiny, variants, args.batch, args.seq, args.separate_gate_up, args.separate_qkv)
    print(markdown_table(rows, COLUMNS))
    write_report(args.area, args.out, environment(device), rows, COLUMNS)


if __name__ == "__main__":
    main()
