"""What is alive at the peak of one training step, and where each tensor was allocated.

    python -m benchmarks.peak [--tiny] [--case mlp|seed1119|both|train|converted|llama] [--out DIR]

Runs the activation cases of `benchmarks.memory` (bf16, float8.ops with the default and the lean-activation
recipe; AdamW, bf16 weights, loss out.sum()), records the
CUDA caching allocator's history over one forward+backward after two warm-up steps, replays it to find the
moment of the highest allocation, and lists the blocks alive then, grouped by the innermost frame of this
project or of the model's file that allocated them (the same frame twice: one line with a count). The
weights, gradients and optimizer states that were allocated before the recording are one line ("before").
--case train: the 8 Llama blocks of the memory bench's train case (float8.ops, default and lean recipes).
--case converted: the same 8 blocks written in plain torch.nn, in bf16 and through `ops.convert` (default and
lean recipes): the path users take with their own models. The other cases list the converted model too.
--case llama: benchmarks.step_llama's whole model and whole step (zero_grad, forward, backward, AdamW foreach),
one report per variant of `--variants` (eager, compiled, torchao); code torch.compile generated is named by its
source line.
CUDA only (the allocator's history); on a CPU it says so and stops. Each case is recorded as the area
peak_<case> in DIR (default benchmarks/results/; benchmarks.harness.record): its reports as text, and the peaks
and what was held before the step as figures.
"""

from __future__ import annotations

import argparse
import collections
import gc
import linecache
import re

import torch

from benchmarks.harness import environment, figure, record

MiB = 2**20
LLAMA_VARIANTS = "bf16 eager,float8 converted eager,float8 converted eager lean,bf16 compiled,float8 converted compiled,torchao tensorwise compiled"


def _site(frames) -> str:
    """The innermost frame in float8 (or the bench's model file): where the tensor comes from. Code that
    torch.compile generated is named by its source line (the buffer and the kernel or op that fills it)."""
    for f in frames:
        name = f.get("filename", "")
        if "/float8/" in name and "/bench/peak.py" not in name:
            return f"{name.split('/float8/')[-1]}:{f.get('line')} {f.get('name')}"
    for f in frames:
        name = f.get("filename", "")
        if "torchinductor" in name:
            return "compiled: " + " ".join(linecache.getline(name, f.get("line", 0)).split())[:100]
        if "torch/" not in name and name.endswith(".py"):
            return f"{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


def live_at_peak(trace, before: int):
    """(peak bytes, {site: [count, bytes]}) by replaying allocator events (alloc / free_completed)."""
    live, total, peak, at_peak = {}, before, before, {}
    for e in trace:
        action = e["action"]
        if action == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed":
            # A block allocated before the recording (a gradient that zero_grad frees) counts out too.
            total -= live.pop(e["addr"])[0] if e["addr"] in live else e["size"]
    sites = collections.defaultdict(lambda: [0, 0])
    for size, frames in at_peak.values():
        s = sites[_site(frames)]
        s[0] += 1
        s[1] += size
    return peak, sites


def profile_step(model, x) -> str:
    """One report: the peak of a forward+backward of `model` on x (AdamW states already made)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        model(x).sum().backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    text = profile_call(lambda: model(x).sum().backward())
    del opt
    return text


def profile_call(run) -> str:
    """The report of one call of `run` (after its warm-ups): the allocator's peak during it, what was
    allocated before it, and the blocks alive at the peak by the site that allocated them."""
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    run()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    peak, sites = live_at_peak(trace, before)
    lines = [
        f"max_memory_allocated {torch.cuda.max_memory_allocated() / MiB:.0f} MiB; replayed peak {peak / MiB:.0f} MiB",
        f"  {before / MiB:9.1f} MiB  before the step (weights, AdamW states, caches)",
    ]
    for site, (n, size) in sorted(sites.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {size / MiB:9.1f} MiB  x{n:<3d} {site}")
    return "\n".join(lines)


def profile_llama(variant: str, tiny: bool) -> str:
    """One report: the peak of a whole training step (zero_grad, forward, backward, AdamW foreach) of the
    Llama-style model of benchmarks.step_llama, `variant` one of its VARIANTS."""
    from benchmarks.llama import TINY, LlamaShape
    from benchmarks.step_llama import build_step

    step, _ = build_step(variant, TINY if tiny else LlamaShape(), torch.device("cuda"))
    for _ in range(3):
        step()
    return profile_call(step)


REPORT = re.compile(r"== (\S+) (.+)\nmax_memory_allocated (\d+) MiB; replayed peak (\d+) MiB\n\s*([\d.]+) MiB  before")


def figures(texts) -> list:
    """The figures of `profile_step` reports (each headed "== <case> <variant>"): the step's peak as the
    allocator counts it and as replayed, and what was allocated before the step."""
    out = []
    for case, variant, peak, replayed, before in REPORT.findall("\n".join(texts)):
        out += [
            figure(case, variant, "max_allocated_MiB", int(peak)),
            figure(case, variant, "replayed_peak_MiB", int(replayed)),
            figure(case, variant, "before_step_MiB", float(before)),
        ]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--case", default="both", choices=["mlp", "seed1119", "both", "train", "converted", "llama"])
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/)")
    p.add_argument(
        "--variants", default=LLAMA_VARIANTS, help="--case llama: benchmarks.step_llama variants, comma-separated"
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("peak: needs CUDA (the caching allocator's history); nothing to do on this machine")
        return
    from benchmarks.blocks import Bf16MLP, fp8_mlp
    from benchmarks.memory import Seed1119Layer, seed1119_ops

    layer_cfg = (64, 256, 4, 2, 16) if args.tiny else (4096, 16384, 32, 8, 128)
    mlp_cfg = (64, 96) if args.tiny else (4096, 14336)
    block_cfg = (64, 4, 2, 16, 128) if args.tiny else (4096, 32, 8, 128, 14336)
    import float8.ops as ops
    from benchmarks.distributed import Block, ops_block
    from float8 import Recipe

    cases = {
        "seed1119": (
            (2, 32) if args.tiny else (32, 1024),
            layer_cfg[0],
            lambda: Seed1119Layer(*layer_cfg),
            lambda r: seed1119_ops(*layer_cfg, recipe=r),
        ),
        "mlp": (
            (2, 32) if args.tiny else (8, 2048),
            mlp_cfg[0],
            lambda: Bf16MLP(*mlp_cfg),
            lambda r: fp8_mlp(*mlp_cfg, r),
        ),
        "train": (
            (2, 32) if args.tiny else (8, 2048),
            block_cfg[0],
            None,
            lambda r: torch.nn.Sequential(*[ops_block(*block_cfg, recipe=r) for _ in range(2 if args.tiny else 8)]),
        ),
        "converted": (
            (2, 32) if args.tiny else (8, 2048),
            block_cfg[0],
            lambda: torch.nn.Sequential(*[Block(*block_cfg) for _ in range(2 if args.tiny else 8)]),
            None,
        ),
    }
    env = environment(torch.device("cuda"))
    if args.case == "llama":
        report = []
        for variant in args.variants.split(","):
            gc.collect()
            torch.cuda.empty_cache()
            text = f"== llama {variant.replace(' ', '_')}\n" + profile_llama(variant, args.tiny)
            print(text, flush=True)
            report.append(text)
            gc.collect()
        text = "```\n" + "\n\n".join(report) + "\n```\n"
        record("peak_llama", args.out, env, figures(report), text, {"reports": report})
        return
    for case in ["seed1119", "mlp"] if args.case == "both" else [args.case]:
        (b, s), d, make_bf16, make_ours = cases[case]

        def converted(recipe, make_bf16=make_bf16):
            return ops.convert(make_bf16().to(torch.bfloat16), recipe=recipe)

        variants = (
            ("bf16", make_bf16),
            ("float8", lambda: make_ours(None)),
            ("float8 lean", lambda: make_ours(Recipe(lean_activations=True))),
            ("ops.convert", lambda: converted(None)),
            ("ops.convert lean", lambda: converted(Recipe(lean_activations=True))),
        )
        variants = [
            (n, m)
            for n, m in variants
            if (make_ours is not None or not n.startswith("float8"))
            and (make_bf16 is not None or n.startswith("float8"))
        ]
        report = []
        for name, make in variants:
            gc.collect()
            torch.cuda.empty_cache()
            torch.manual_seed(0)
            with torch.device("cuda"):
                model = make().to(torch.bfloat16)
            x = torch.randn(b, s, d, device="cuda", dtype=torch.bfloat16)
            text = f"== {case} {name}\n" + profile_step(model, x)
            print(text, flush=True)
            report.append(text)
            del model, x
        text = "```\n" + "\n\n".join(report) + "\n```\n"
        record(f"peak_{case}", args.out, env, figures(report), text, {"reports": report})


if __name__ == "__main__":
    main()
