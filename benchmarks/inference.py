"""python -m benchmarks.inference [--tiny] [--profile] [--out DIR] [--models llama,hf] [--variants a,b]
[--tokens 1,16,128,4096] [--rounds 5] [--calls 20] [--decode-tokens 64] [--budget-s 480]: FP8 inference on
the paths users run, against bf16 and torchao (public APIs only).

Models, random weights, bf16: 8 blocks, d=4096, 32 query / 8 KV heads of 128, SwiGLU 14336, vocab 32768 (2.0B
parameters). "llama": plain torch (embedding, benchmarks/llama.py's block without rotary, RMSNorm, LM head);
"hf": transformers.LlamaForCausalLM of the same sizes, SDPA. Variants, each a fresh build of the same
weights: bf16 and float8 (ops.convert(model, fp8_weights=True)), eager, compiled (torch.compile),
cudagraphs (mode="reduce-overhead") and graphed (ops.graphed_inference: CUDA graphs of the eager forward);
float8 fp8-input graphed and eager (Recipe(inference_fp8_input_from=17): x quantized per row, FP8 x FP8 at 17-128
tokens);
float8 blockwise eager (128x128 block-scaled FP8 weights, as a hub FP8 checkpoint loads: ops.convert(model,
fp8_weights=True, recipe=Recipe.blockwise())); float8 calibrated eager (input scales fixed by ops.calibrate on
two batches of 512 random tokens); torchao rowwise (Float8DynamicActivationFloat8WeightConfig(PerRow()))
eager and compiled. float8 compiles with fullgraph=True; on the HF model it falls back to False and says so.

Stages (the report is rewritten as it goes; past --budget-s the rest is recorded as skipped):
  bandwidth  2 x bytes / time of a 1 GiB dst.copy_(src); floor_ms = weight bytes a forward reads / bandwidth
  forward    per model, batch 1, inference_mode: variants built once, warmed up per token count (compiles
             happen here, one per shape), timed in interleaved rounds (median of --calls calls, CUDA events).
             ms: median over rounds; vs_bf16_*: median of the ratios within a round (clocks drift);
             pct_of_floor at <= 16 tokens; peak_MiB at the largest token count, above what was held before.
  profile    (--profile) cProfile of 50 eager float8 llama forwards at 16 tokens: where the host time goes.
  generate   HF: tokens/s of generate(), greedy, static cache, batch 1 and 16, 16-token prompt, --rounds calls
             each (eager variants in interleaved rounds; generate_stage says how the ratios go). "compiled" is
             transformers' own compile of the decoding step (CompileConfig(mode="reduce-overhead")), what it
             does by itself on a GPU with a static cache; "eager" passes disable_compile=True.
Compile time: a whole-model compile took 30-110 s per shape on the H100 here (2026-11-25), so the full matrix
does not fit the default budget. Eager work comes first; each compiling stage gets a share of the budget and
compiles the decode sizes first (COMPILE_PRIORITY); what does not fit is recorded as skipped.
Outputs: the area "inference" (or --area) in --out (default benchmarks/results/; benchmarks.harness.record: latest.json,
latest.md, a row per figure in history.csv). --tiny (the default on a CPU): tiny
sizes; compiled, CUDA-graph and torchao variants are skipped on a CPU, with the reason.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import importlib.metadata
import io
import pathlib
import pstats
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

import float8.ops as ops
from benchmarks.harness import environment, free_memory, step_peak_bytes, time_steps, write_report
from benchmarks.llama import TINY, Block, LlamaShape

ROOT = pathlib.Path(__file__).resolve().parents[1]
VARIANTS = {  # name: (weights, torch.compile mode; None: eager)
    "bf16 eager": ("bf16", None),
    "bf16 compiled": ("bf16", "default"),
    "bf16 cudagraphs": ("bf16", "reduce-overhead"),
    "float8 eager": ("float8", None),
    "float8 compiled": ("float8", "default"),
    "float8 cudagraphs": ("float8", "reduce-overhead"),
    # ops.graphed_inference: a plain CUDA graph of the eager forward per shape, no dynamo guards
    "bf16 graphed": ("bf16", "graphed"),
    "float8 graphed": ("float8", "graphed"),
    # Recipe(inference_fp8_input_from=17): x quantized per row, FP8 x FP8 at 17-128 tokens (kernels/rowwise_input_mm.py)
    "float8 fp8-input graphed": ("float8-fp8-input", "graphed"),
    "float8 fp8-input eager": ("float8-fp8-input", None),
    # 128x128 block-scaled FP8 weights, the layout of hub FP8 checkpoints (float8.load_checkpoint gives these)
    "float8 blockwise eager": ("float8-block", None),
    # Recipe.rowwise(): one scale per weight row and, above 128 tokens, per input row (one pass, no amax kernel)
    "float8 rowwise eager": ("float8-rowwise", None),
    "float8 rowwise compiled": ("float8-rowwise", "default"),
    # Input scales fixed by ops.calibrate (docs/inference.md): one cast per activation above 128 tokens, no
    # amax pass; below, the weight-only kernel casts nothing either way
    "float8 calibrated eager": ("float8-calibrated", None),
    "torchao rowwise eager": ("torchao", None),
    "torchao rowwise compiled": ("torchao", "default"),
}
GENERATE_VARIANTS = [
    "bf16 eager",
    "bf16 compiled",
    "float8 eager",
    "float8 compiled",
    "torchao rowwise eager",
    "torchao rowwise compiled",
]
COMPILE_PRIORITY = [  # every variant with a mode (tests/examples/test_benchmarks_smoke.py)
    "float8 graphed",
    "float8 fp8-input graphed",
    "bf16 graphed",
    "float8 cudagraphs",
    "bf16 cudagraphs",
    "float8 compiled",
    "float8 rowwise compiled",
    "bf16 compiled",
    "torchao rowwise compiled",
]
PROMPT, BATCHES, PROFILE_CALLS = 16, (1, 16), 50
COLUMNS = [
    "model",
    "tokens",
    "variant",
    "ms",
    "vs_bf16_eager",
    "vs_bf16_compiled",
    "vs_bf16_same_mode",
    "pct_of_floor",
    "peak_MiB",
    "fullgraph",
    "warmup_s",
    "error",
    "skipped",
]
GEN_COLUMNS = ["variant", "batch", "new_tokens", "cache", "ms", "tokens_per_s", "vs_bf16", "note", "error", "skipped"]


class Skip(Exception):
    """A variant that does not apply here: recorded as `skipped`, not as an error."""


def err(e: BaseException) -> str:
    """One table-safe line naming the exception."""
    return f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")[:400]


@dataclass
class Run:
    """What the stages share: the options, the device, the clock held against --budget-s, and the report."""

    args: argparse.Namespace
    device: torch.device
    shape: LlamaShape
    env: dict
    t0: float = field(default_factory=time.perf_counter)
    report: dict = field(default_factory=lambda: {"generate": [], "floors": {}, "stages": {}, "profile": None})
    rows: List[dict] = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {msg}", file=sys.stderr, flush=True)

    def skip_reason(self, compiled: bool = False, deadline: float = float("inf")) -> Optional[str]:
        """Why not to run what comes next (the budget is spent; a compile past its stage's deadline or on
        a CPU), or None."""
        if self.elapsed() > self.args.budget_s:
            return f"over the time budget (--budget-s {self.args.budget_s:.0f}) at {self.elapsed():.0f} s"
        if compiled and not self.cuda:
            return "compiled and CUDA-graph variants run on a GPU only (CPU smoke run)"
        if compiled and time.perf_counter() > deadline:
            return "not compiled: this stage's share of --budget-s for compiles was spent (30-110 s a shape)"
        return None

    def compile_deadline(self, stages_left: int) -> float:
        """When a stage stops starting compiles: what is left of the budget is shared equally by this
        stage, the later stages that compile, and the work that compiles nothing."""
        return time.perf_counter() + max(0.0, self.args.budget_s - self.elapsed()) / (stages_left + 1)

    def variants(self, names) -> List[str]:
        """The names --variants picks (comma-separated substrings), in table order."""
        keys = [k.strip() for k in (self.args.variants or "").split(",") if k.strip()]
        return [n for n in names if not keys or any(k in n for k in keys)]

    def save(self) -> pathlib.Path:
        """Rewrite the JSON and markdown report with everything measured so far; returns the .md path."""
        self.report["elapsed_s"] = round(self.elapsed(), 1)
        return write_report(
            self.args.area,
            self.args.out,
            self.env,
            self.rows,
            COLUMNS,
            self.report,
            markdown=markdown_sections(self.report),
        )


def build_bf16(model: str, s: LlamaShape, device: torch.device) -> torch.nn.Module:
    """A fresh bf16 model in eval mode; the same seed gives every variant the same weights."""
    torch.manual_seed(0)
    with torch.device(device):
        if model == "llama":  # ids (batch, tokens) -> logits; a block maps (batch, tokens, d) to the same
            blocks = [Block(s) for _ in range(s.blocks)]
            llama = torch.nn.Sequential(
                torch.nn.Embedding(s.vocab, s.d),
                *blocks,
                torch.nn.RMSNorm(s.d, eps=1e-6),
                torch.nn.Linear(s.d, s.vocab, bias=False),
            )
            return llama.to(torch.bfloat16).eval()
        import transformers

        cfg = transformers.LlamaConfig(
            vocab_size=s.vocab,
            hidden_size=s.d,
            intermediate_size=s.ffn,
            num_hidden_layers=s.blocks,
            num_attention_heads=s.heads,
            num_key_value_heads=s.kv_heads,
            head_dim=s.head_dim,
            max_position_embeddings=8192,
            tie_word_embeddings=False,  # tied, the head could not be FP8-only
        )
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
        return hf.to(device).eval()


def quantize_weights(model: torch.nn.Module, weights: str, device: torch.device) -> torch.nn.Module:
    """The variant's weights, in place: bf16 as built, float8 FP8-only weights, or torchao's rowwise FP8."""
    if weights == "float8":
        ops.convert(model, fp8_weights=True)
    elif weights == "float8-fp8-input":
        from float8 import Recipe

        ops.convert(model, fp8_weights=True, recipe=Recipe(inference_fp8_input_from=17))
    elif weights == "float8-calibrated":
        ops.convert(model, fp8_weights=True)
        vocab = (
            model.get_input_embeddings().num_embeddings
            if hasattr(model, "get_input_embeddings")
            else model[0].num_embeddings
        )
        g = torch.Generator().manual_seed(1)  # calibration data apart from the timed inputs
        batches = [torch.randint(0, vocab, (1, 512), generator=g).to(device) for _ in range(2)]
        ops.calibrate(model, batches)
    elif weights == "float8-block":
        from float8 import Recipe

        dims = {d for m in model.modules() if isinstance(m, torch.nn.Linear) for d in m.weight.shape}
        if any(d % 128 for d in dims):
            raise Skip(f"128x128 weight blocks need Linear dims that are multiples of 128 (here {sorted(dims)})")
        ops.convert(model, fp8_weights=True, recipe=Recipe.blockwise())
    elif weights == "float8-rowwise":
        from float8 import Recipe

        ops.convert(model, fp8_weights=True, recipe=Recipe.rowwise())
    elif weights == "torchao":
        if device.type != "cuda":
            raise Skip(
                "torchao's Float8DynamicActivationFloat8WeightConfig needs a CUDA GPU (compute capability >= 8.9)"
            )
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

        quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return model


def weight_counts(model: torch.nn.Module) -> dict:
    """What one forward reads, counted on the bf16 model: the Linear weights, the other parameters (norms),
    and one embedding row per token (not the whole table)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    embeds = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    lin, table = sum(m.weight.numel() for m in linears), sum(m.weight.numel() for m in embeds)
    other = sum(p.numel() for p in model.parameters()) - lin - table
    return {"linear_params": lin, "linears": len(linears), "other_params": other, "embed_dim": embeds[0].embedding_dim}


def floor_ms(c: dict, tokens: int, fp8: bool, bandwidth: float) -> float:
    """Milliseconds to read the weights once: FP8 ones 1 B per element plus a float32 scale per Linear
    (per-tensor; torchao's per-row scales add 4 B per output row, under 0.1% here), bf16 ones 2 B."""
    linear = c["linear_params"] + 4 * c["linears"] if fp8 else 2 * c["linear_params"]
    return round((linear + 2 * (c["other_params"] + tokens * c["embed_dim"])) / bandwidth * 1e3, 4)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device copy, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (time_steps(lambda: dst.copy_(src), device, warmup=3, reps=10) / 1e3)


@dataclass
class Variant:
    """One variant of a model: the call that runs its forward, and what it measured per token count."""

    name: str
    model: Optional[torch.nn.Module] = None
    call: Optional[Callable] = None
    fullgraph: Optional[bool] = None
    failed: dict = field(default_factory=dict)  # {"error": ...} or {"skipped": ...}: not built
    status: Dict[int, dict] = field(default_factory=dict)  # the same, per token count
    times: Dict[int, Dict[int, float]] = field(default_factory=lambda: collections.defaultdict(dict))
    warmup_s: Dict[int, float] = field(default_factory=dict)
    peak_MiB: Optional[int] = None
    note: Optional[str] = None

    @property
    def mode(self) -> Optional[str]:
        return VARIANTS[self.name][1]


def make_call(model_name: str, v: Variant) -> Callable:
    """ids -> logits. Compiled ones compile once per shape (dynamic=False); a CUDA-graph call marks a new
    step first, so that a replay may reuse the memory of the previous one's (unread) outputs."""
    fn = v.model
    if v.mode == "graphed":
        fn = ops.graphed_inference(v.model)
    elif v.mode is not None:
        fn = torch.compile(v.model, mode=None if v.mode == "default" else v.mode, fullgraph=v.fullgraph, dynamic=False)
    fwd = (lambda ids: fn(input_ids=ids, use_cache=False).logits) if model_name == "hf" else fn
    if v.mode != "reduce-overhead":
        return fwd

    def graphed(ids):
        torch.compiler.cudagraph_mark_step_begin()
        return fwd(ids)

    return graphed


def build_variant(run: Run, model_name: str, name: str) -> Variant:
    """A fresh build of one variant, or one that says why there is none."""
    weights, mode = VARIANTS[name]
    v = Variant(name, fullgraph=weights.startswith("float8") if mode not in (None, "graphed") else None)
    try:
        why = run.skip_reason(compiled=mode is not None)
        if why:
            raise Skip(why)
        v.model = quantize_weights(build_bf16(model_name, run.shape, run.device), weights, run.device)
        v.call = make_call(model_name, v)
        run.log(f"{model_name}: built {name}")
    except Skip as e:
        v.failed = {"skipped": str(e)}
    except Exception as e:  # noqa: BLE001 - a variant that does not build is recorded, not fatal
        v.failed = {"error": err(e)}
        run.log(f"{model_name}: {name} failed to build: {err(e)}")
    free_memory()
    return v


def warm_up(run: Run, model_name: str, v: Variant, ids: torch.Tensor) -> None:
    """Three calls: compiles happen here (one per shape), and a CUDA-graph variant runs, records, replays.
    A float8 HF variant that does not compile with fullgraph=True is compiled again without it."""
    try:
        for _ in range(3):
            v.call(ids)
    except Exception as e:
        if not (v.fullgraph and model_name == "hf"):
            raise
        v.note, v.fullgraph = f"fullgraph=True failed: {err(e)}", False
        run.log(f"{model_name}: {v.name}: {v.note}; compiling with fullgraph=False")
        v.call = make_call(model_name, v)
        for _ in range(3):
            v.call(ids)


def warm_order(variants: List[Variant], tokens: List[int]) -> List[tuple]:
    """(tokens, variant) pairs: every eager variant at every token count, then the compiled ones by token
    count, smallest first, in COMPILE_PRIORITY order, so that a budget that runs out leaves decode sizes."""
    eager = [(t, v) for v in variants if v.mode is None for t in tokens]
    ranked = sorted((v for v in variants if v.mode is not None), key=lambda v: COMPILE_PRIORITY.index(v.name))
    return eager + [(t, v) for t in sorted(tokens) for v in ranked]


def forward_stage(run: Run, model_name: str, deadline: float) -> None:
    """Build every variant, warm each up at every token count (starting compiles only until deadline),
    time them in interleaved rounds, take the peak at the largest token count; one row per (tokens, variant)."""
    tokens, progress = run.args.tokens, run.report["stages"].setdefault(f"forward {model_name}", {"warmup_s": {}})
    variants = [build_variant(run, model_name, name) for name in run.variants(VARIANTS)]
    built = [v for v in variants if not v.failed]
    gen = torch.Generator(device=run.device).manual_seed(0)
    ids = {t: torch.randint(0, run.shape.vocab, (1, t), device=run.device, generator=gen) for t in tokens}
    for t, v in warm_order(built, tokens):
        why, start = run.skip_reason(v.mode is not None, deadline), time.perf_counter()
        try:
            if why:
                raise Skip(why)
            warm_up(run, model_name, v, ids[t])
            v.warmup_s[t] = progress["warmup_s"][f"{v.name} @ {t}"] = round(time.perf_counter() - start, 1)
        except Skip as e:
            v.status[t] = {"skipped": str(e)}
        except Exception as e:  # noqa: BLE001
            v.status[t] = {"error": err(e)}
        run.log(f"{model_name}: warm-up {v.name} at {t} tokens: {v.status.get(t) or f'{v.warmup_s[t]} s'}")
        run.save()  # a run killed during its compiles still says how long each took
    progress["rounds"] = 0
    for r in range(run.args.rounds):
        if run.skip_reason():
            break
        for t in tokens:
            for v in (v for v in built if t not in v.status):
                try:
                    v.times[t][r] = time_steps(lambda: v.call(ids[t]), run.device, warmup=1, reps=run.args.calls)
                except Exception as e:  # noqa: BLE001
                    v.status[t] = {"error": err(e)}
        progress["rounds"] += 1
        run.log(f"{model_name}: round {r + 1}/{run.args.rounds} done")
    for v in (v for v in built if v.times.get(max(tokens)) and run.cuda):
        free_memory()
        before = torch.cuda.memory_allocated()
        v.peak_MiB = round((step_peak_bytes(lambda: v.call(ids[max(tokens)]), run.device) - before) / 2**20)
    run.rows += forward_rows(run, model_name, variants)
    variants.clear()
    built.clear()
    torch._dynamo.reset()  # this stage's compiled code and CUDA graphs go with its models
    free_memory()


def median_ratio(base: Optional[Variant], tokens: int, ours: Dict[int, float]) -> Optional[float]:
    """Median over the rounds both timed of base ms / ours ms, each ratio within one round."""
    ref = base.times.get(tokens, {}) if base else {}
    ratios = [ref[r] / ours[r] for r in ours if r in ref]
    return round(statistics.median(ratios), 3) if ratios else None


def forward_rows(run: Run, model_name: str, variants: List[Variant]) -> List[dict]:
    """One row per (tokens, variant): median ms, speedups, % of the weight-read floor, peak, or why not."""
    by_name, bandwidth = {v.name: v for v in variants if not v.failed}, run.report["floors"].get("copy_Bps")
    counts = weight_counts(build_bf16(model_name, run.shape, torch.device("meta")))  # sizes only, no memory
    if bandwidth:
        floors = {w: {t: floor_ms(counts, t, w == "fp8", bandwidth) for t in run.args.tokens} for w in ("bf16", "fp8")}
        run.report["floors"][model_name] = {**counts, "floor_ms": floors}
    rows = []
    for t in run.args.tokens:
        for v in variants:
            row = {
                "model": model_name,
                "tokens": t,
                "variant": v.name,
                "fullgraph": v.fullgraph,
                "note": v.note,
                "warmup_s": v.warmup_s.get(t),
                **v.failed,
                **v.status.get(t, {}),
            }
            times = v.times.get(t, {})
            if times:
                row.update(
                    ms=round(statistics.median(times.values()), 3), ms_rounds=[round(x, 3) for x in times.values()]
                )
                row["vs_bf16_eager"] = median_ratio(by_name.get("bf16 eager"), t, times)
                row["vs_bf16_compiled"] = median_ratio(by_name.get("bf16 compiled"), t, times)
                if v.mode is not None:  # against bf16 run the same way (graphed against graphed, ...)
                    same = next(n for n, (w, mode) in VARIANTS.items() if w == "bf16" and mode == v.mode)
                    row["vs_bf16_same_mode"] = median_ratio(by_name.get(same), t, times)
                if bandwidth and t <= 16:
                    floor = floors["bf16" if VARIANTS[v.name][0] == "bf16" else "fp8"][t]
                    row.update(floor_ms=floor, pct_of_floor=round(100 * floor / row["ms"], 1))
                row["peak_MiB"] = v.peak_MiB if t == max(run.args.tokens) else None
            elif not v.failed and not v.status.get(t):
                row["skipped"] = "no timing round ran (time budget)"
            rows.append({k: val for k, val in row.items() if val is not None})
    return rows


def generate_setup(run: Run, model: torch.nn.Module, name: str, batch: int) -> tuple[dict, Optional[Callable]]:
    """(row, call) of one variant's generate() at one batch size, warmed up (compiles happen here): static
    cache, else the default cache (with which transformers compiles nothing); the row says which and why.
    call is None where neither ran."""
    n, gen = run.args.decode_tokens, torch.Generator(device=run.device).manual_seed(0)
    prompt = torch.randint(0, run.shape.vocab, (batch, PROMPT), device=run.device, generator=gen)
    kw = dict(
        attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )
    if VARIANTS[name][1] is None:
        kw["disable_compile"] = True
    else:
        from transformers import CompileConfig

        kw["compile_config"] = CompileConfig(mode="reduce-overhead")  # transformers' default: fullgraph=False
    row, notes, call = {"variant": name, "batch": batch, "new_tokens": n}, [], None
    for cache in ("static", "dynamic"):
        extra = {"cache_implementation": "static"} if cache == "static" else {}
        try:
            for _ in range(2):  # warm-up: compiles, CUDA-graph recording
                if model.generate(prompt, **kw, **extra).shape[1] != PROMPT + n:
                    raise RuntimeError(f"generate() did not give {n} new tokens")
            call = lambda kw=kw, extra=extra: model.generate(prompt, **kw, **extra)  # noqa: E731
            row["cache"] = cache
            break
        except Exception as e:  # noqa: BLE001 - fall back to the default cache, and say why
            notes.append(f"cache={cache}: {err(e)}")
            run.log(f"hf generate {name} batch {batch}: {notes[-1]}")
    if notes:
        row["error" if call is None else "note"] = " / ".join(notes)[:600]
    return row, call


def generate_stage(run: Run, deadline: float) -> None:
    """generate() tokens/s of the HF model: the eager variants, then the compiled ones while the deadline
    allows. At each batch size the eager variants are timed in interleaved rounds (one generate() per
    variant a round: the host's speed drifts by tens of percent over a run, and eager decoding waits for the
    host); the compiled ones one after another (`generate_rounds`). Batch sizes are not interleaved:
    transformers makes a new static cache when the batch changes. ms: the median of the calls; vs_bf16 (to
    bf16 eager or compiled, the same batch): the median of the ratios within a round, or for the compiled
    variants the ratio of the medians. One fresh model per kind of weights serves its eager and compiled
    variants (transformers compiles its call, not the model)."""
    names, models, failed = run.variants(GENERATE_VARIANTS), {}, {}
    for weights in dict.fromkeys(VARIANTS[n][0] for n in names):
        try:
            models[weights] = quantize_weights(build_bf16("hf", run.shape, run.device), weights, run.device)
        except Skip as e:
            failed[weights] = {"skipped": str(e)}
        except Exception as e:  # noqa: BLE001
            failed[weights] = {"error": err(e)}
        free_memory()
    rows = run.report["generate"]
    for compiled in (False, True):
        for batch in BATCHES:
            group = []
            for name in (n for n in names if (VARIANTS[n][1] is not None) == compiled):
                weights, why = VARIANTS[name][0], run.skip_reason(compiled, deadline)
                if weights in failed or why:
                    rows.append({"variant": name, "batch": batch, **failed.get(weights, {"skipped": why})})
                    continue
                row, call = generate_setup(run, models[weights], name, batch)
                rows.append(row)
                if call is not None:
                    group.append((row, call, []))
            generate_rounds(
                run, group, "bf16 compiled" if compiled else "bf16 eager", deadline, interleave=not compiled
            )
            run.save()
    models.clear()
    torch._dynamo.reset()
    free_memory()


def generate_rounds(run: Run, group: list, ref: str, deadline: float, interleave: bool = True) -> None:
    """Time the (row, call, times) of one batch size, --rounds calls each until the deadline: in interleaved
    rounds, or (interleave=False: the compiled variants, whose CUDA graphs transformers records per model and
    which are not switched call by call here) all of one variant's calls in a row. A call that fails is
    recorded in its row and leaves the group."""
    rounds = run.args.rounds if run.cuda else 1
    order = [(r, e) for r in range(rounds) for e in list(group)]
    if not interleave:
        order = [(r, e) for e in list(group) for r in range(rounds)]
    for r, entry in order:
        row, call, times = entry
        if entry not in group or (r and run.skip_reason(False, deadline)):
            continue  # failed earlier, or past the budget: the calls timed so far stand
        try:
            times.append(time_steps(call, run.device, warmup=0, reps=1))
        except Exception as e:  # noqa: BLE001 - one variant's failure is its row's, not the stage's
            row["error"] = err(e)
            group.remove(entry)
    for row, _, times in group:
        ms = statistics.median(times)
        row.update(ms=round(ms, 1), tokens_per_s=round(row["new_tokens"] * row["batch"] / ms * 1e3, 1))
        base = [t for b, _, t in group if b["variant"] == ref]
        if base and interleave:  # the ratios within a round
            row["vs_bf16"] = round(statistics.median(b / o for b, o in zip(base[0], times)), 3)
        elif base:  # one variant after another: the medians' ratio
            row["vs_bf16"] = round(statistics.median(base[0]) / ms, 3)
        shown = {k: v for k, v in row.items() if k in ("tokens_per_s", "vs_bf16", "cache", "note")}
        run.log(f"hf generate {row['variant']} batch {row['batch']}: {shown}")


def source_group(path: str, name: str) -> str:
    """Which part of the stack a profiled function belongs to, by its source file (builtins by name)."""
    for folder in ("float8", "ops", "kernels"):
        if path.startswith(str(ROOT / folder) + "/"):
            return folder + "/"
    where = name if path == "~" else path.split("site-packages/")[-1]
    for lib in ("triton", "torch"):  # triton first: a venv under /opt/torch/ holds it
        if where.startswith(lib + "/") or (path == "~" and lib in name):
            return lib
    return "torch" if path == "~" and "PyCapsule" in name else "other"  # ATen ops are called through capsules


def profile_summary(prof: cProfile.Profile, calls: int) -> tuple:
    """(text, groups): the top 40 functions by own time, then each source group's time in ms per forward:
    the own time of its functions. cProfile's cumulative times nest across groups (torch calls ops/, which
    calls torch), so summed per group they would count a call once per group it passes through."""
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(40)
    own = collections.Counter()
    for (path, _, fname), (_, _, tottime, _, _) in stats.stats.items():
        own[source_group(path, fname)] += tottime
    groups = {g: round(t / calls * 1e3, 3) for g, t in own.most_common()}
    out.write(f"time per source group (own time of its functions), ms per forward over {calls} forwards:\n")
    out.writelines(f"{g:10s} {ms:9.3f}\n" for g, ms in groups.items())
    return out.getvalue(), groups


def profile_stage(run: Run, md: pathlib.Path) -> None:
    """cProfile of PROFILE_CALLS eager float8 llama forwards at 16 tokens, after a warm-up."""
    model = quantize_weights(build_bf16("llama", run.shape, run.device), "float8", run.device)
    ids = torch.randint(0, run.shape.vocab, (1, 16), device=run.device)
    time_steps(lambda: model(ids), run.device, warmup=5, reps=1)  # warm-up; ends synchronized
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(PROFILE_CALLS):
        model(ids)
    if run.cuda:
        torch.cuda.synchronize()  # the GPU work the host queued belongs to these calls
    prof.disable()
    text, groups = profile_summary(prof, PROFILE_CALLS)
    run.report["profile"] = {
        "model": "llama",
        "variant": "float8 eager",
        "tokens": 16,
        "calls": PROFILE_CALLS,
        "groups_ms_per_forward": groups,
        "text": text,
    }


def markdown_sections(report: dict) -> str:
    """What follows the forward table: generate(), the floors, the stages, the profile."""
    lines = [
        "",
        "## generate() (HF model, prompt 16 tokens)",
        "",
        "| " + " | ".join(GEN_COLUMNS) + " |",
        "|" + " --- |" * len(GEN_COLUMNS),
    ]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in GEN_COLUMNS) + " |" for r in report["generate"]]
    floors = report["floors"]
    if "copy_Bps" in floors:
        lines += ["", f"## weight-read floor: copy bandwidth {floors['copy_Bps'] / 1e9:.0f} GB/s", ""]
        lines += [
            f"- {m}: {f['linear_params'] / 1e6:.1f}M Linear weights; floor ms by tokens {f['floor_ms']}"
            for m, f in floors.items()
            if isinstance(f, dict)
        ]
    lines += ["", "## stages", ""] + [f"- {k}: {v}" for k, v in report["stages"].items()]
    if report.get("profile"):
        lines += ["", "## profile (float8 eager llama, 16 tokens)", "", "```", report["profile"]["text"], "```"]
    return "\n".join(lines) + "\n"


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.inference", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/)")
    p.add_argument(
        "--area",
        default="inference",
        help="the results area this run replaces (default inference): "
        "a run of some variants or token counts names its own, e.g. inference_compiled",
    )
    p.add_argument("--models", default="llama,hf", help="comma-separated: llama, hf")
    p.add_argument("--variants", default=None, help="comma-separated names or substrings (default: all)")
    p.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,16,128,4096; tiny 1,16)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5; tiny 1)")
    p.add_argument("--calls", type=int, default=None, help="calls per timing, median (default 20; tiny 2)")
    p.add_argument("--decode-tokens", type=int, default=None, help="generate()'s new tokens (default 64; tiny 4)")
    p.add_argument("--profile", action="store_true", help="also a cProfile of eager float8 llama forwards")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (the CPU smoke test; the default without CUDA)")
    p.add_argument("--budget-s", type=float, default=480.0, help="skip what remains after this long (default 480)")
    args = p.parse_args(argv)
    args.tiny = args.tiny or not torch.cuda.is_available()
    args.tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else [1, 16] + [128, 4096] * (not args.tiny)
    args.rounds = args.rounds or (1 if args.tiny else 5)
    args.calls = args.calls or (2 if args.tiny else 20)
    args.decode_tokens = args.decode_tokens or (4 if args.tiny else 64)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if any(m not in ("llama", "hf") for m in args.models):
        p.error(f"--models takes llama and hf, got {args.models}")
    return args


def stage(run: Run, name: str, fn: Callable[[], None]) -> None:
    """Run one stage unless the budget is spent, record how it ended, and rewrite the report."""
    why = run.skip_reason()
    run.log(f"stage {name}" + (f": skipped, {why}" if why else ""))
    if why:
        run.report["stages"][name] = f"skipped: {why}"
    else:
        try:
            fn()
            run.report["stages"].setdefault(name, {})["done_at_s"] = round(run.elapsed())
        except Exception as e:  # noqa: BLE001 - a stage that fails is recorded; the others still run
            run.report["stages"][name] = f"error: {err(e)}"
            run.log(f"stage {name} failed: {err(e)}")
            free_memory()
    run.save()


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device)
    try:
        env["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        env["transformers"] = None
    env["command"] = " ".join(["python -m benchmarks.inference"] + argv)
    run = Run(args, device, TINY if args.tiny else LlamaShape(), env)
    compiling = len(args.models) + ("hf" in args.models)  # stages that compile: forward per model, generate
    # Every compiled variant of a stage shares one code object (Module.__call__): one entry per variant
    # and shape, more than dynamo's default limit of 8 before it falls back to eager.
    limit = 8 + len(VARIANTS) * (len(args.tokens) + 2 * len(BATCHES))
    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=limit):
        nbytes = 2**30 if run.cuda else 2**24
        stage(run, "bandwidth", lambda: run.report["floors"].update(copy_Bps=copy_bandwidth(device, nbytes)))
        for i, m in enumerate(args.models):
            stage(
                run, f"forward {m}", lambda m=m, left=compiling - i: forward_stage(run, m, run.compile_deadline(left))
            )
        if args.profile:
            stage(run, "profile", lambda: profile_stage(run, run.save()))
        if "hf" in args.models:
            stage(run, "generate hf", lambda: generate_stage(run, run.compile_deadline(1)))
    md = run.save()
    print(md.read_text())
    run.log(f"wrote {md} and {md.with_suffix('.json').name}")
    return run.report


if __name__ == "__main__":
    main()
