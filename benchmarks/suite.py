"""The benchmark suite: float8 against bf16 eager, bf16 torch.compile and torchao float8 on one GPU.

All in one process, each case also measured against its roofline floor.

    python -m benchmarks [--out DIR] [--quick] [--cases a,b,c,d,e,f,g] [--cpu-smoke]
                           [--no-rowwise] [--budget-s S]

Cases (how they are measured: docs/design.md §8):
  a  quantize / cast / cast-transpose kernels against the copy-bandwidth floor (benchmarks.kernels, reused)
  b  FP8 GEMM: ours (`a @ b.t()` on pre-quantized Float8Tensors), raw torch._scaled_mm on the same FP8
     data, bf16 `x @ w.t()`; TFLOP/s
  c  Linear forward+backward: ours (float8.ops.Linear), bf16 nn.Linear eager and compiled, torchao
     tensorwise and rowwise (convert_to_float8_training, then torch.compile, as torchao recommends)
  d  MLP block forward+backward (RMSNorm -> Linear d->2f -> SwiGLU -> Linear f->d), time and peak memory
  e  transformer layer forward+backward (GQA attention through SDPA, SwiGLU FFN), time and peak memory
  f  host time per forward+backward of a tiny Linear (GPU work negligible; benchmarks.host, reused)
  g  whole training steps (zero_grad, forward, backward, AdamW foreach step) of the Linear and the MLP block,
     at the sizes where host time shows (1024 and 2048 tokens) and at a large one
Variants of c, d, g: ours eager and compiled, bf16 eager and compiled, torchao tensorwise and rowwise
(compiled).

Method. Timings: triton.testing.do_bench(warmup=25, rep=100, return_mode="median"); rep=250 for the block
cases (d, e) so their ~20 ms steps still give a dozen samples. Inputs are randn. Each timed forward+backward
step sets every .grad to None and bumps every parameter's version counter, as an optimizer step would: our
ops re-quantize their FP8 weights every step, like torchao does (without the bump they would reuse a cached
FP8 weight, which only gradient accumulation earns). Peak memory: torch.cuda.max_memory_allocated during one
step minus what was allocated before it (grads cleared first). Compiled variants use
torch.compile(dynamic=False); torch._dynamo is reset between cases. Cases c-e time their variants in
ROUNDS interleaved rounds and keep the median (fwd_bwd_variants says why).

Floors, measured in the same run: device-to-device copy bandwidth (clone of 1 GiB, bytes read + written) and
the FP8 GEMM rate (torch._scaled_mm at 8192^3, per-tensor scales), plus the bf16 GEMM rate for attention.
    floor_ms = FP8 GEMM FLOPs / FP8 rate (+ attention FLOPs / bf16 rate) + minimal bytes / copy bandwidth
    fraction_of_floor = floor_ms / ours_ms
A Linear forward+backward counts 3 GEMMs of 2*M*K*N. Minimal bytes: each input of the case read once and each
output written once, at the size ours takes and gives: FP8 operands and bf16 output for the GEMM; bf16 x, W,
dy in and y, dx, dW out for Linear and the blocks (norm weights and their grads included); for the kernels,
the bytes per element that benchmarks.kernels states.

torchao (float8 training, 0.18): fields stay null and the table says why when it does not import. Rowwise is
skipped (and the record says so) with --no-rowwise, or once the run has used --budget-s seconds.

Outputs in --out (default benchmarks/results/), through benchmarks.harness.record as each case ends: the
case's area bench_<case> of latest.json (its records under "detail") and latest.md (its table), its figures
appended to history.csv; at the end bench.png (speedup over bf16 eager; skipped with a note when matplotlib
is missing) and the whole table printed. Case a's benchmarks.kernels also records its own area, kernels.

--cpu-smoke runs the same orchestration on the CPU with tiny shapes, a wall-clock timer and no
torch.compile (the "compiled" variants run eagerly), so a test can check the plumbing and the schema.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import math
import platform
import statistics
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from benchmarks.harness import command_line, figure, host_us, make_timer, record, results_dir

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
REP = 100
BLOCK_REP = 250
ROUNDS = 3  # cases c-e, g: each variant timed in this many interleaved rounds after a warm-up (--rounds)
VARIANTS = ["ours", "ours_compiled", "bf16", "bf16_compiled", "torchao", "torchao_rowwise"]  # <key>_ms, peak_mem_<key>

# Shapes. Linear and GEMM shapes are (M, K, N); mlp is (tokens, d, f); layer as named.
SIZES = {
    "full": dict(
        kernels=(16384, 8192),
        gemm=[(4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 14336)],
        linear=[
            (1024, 4096, 4096),
            (2048, 4096, 4096),
            (4096, 8192, 8192),
            (8192, 8192, 8192),
            (16384, 4096, 14336),
            (16384, 14336, 4096),
        ],
        mlp=(16384, 4096, 14336),
        layer=dict(batch=8, seq=1024, d=4096, heads=32, kv_heads=8, head_dim=128, ffn=16384),
        step_linear=[(1024, 4096, 4096), (2048, 4096, 4096), (8192, 8192, 8192)],
        step_mlp=[(1024, 4096, 14336), (2048, 4096, 14336), (16384, 4096, 14336)],
        tiny=(16, 64, 64),
        copy_bytes=2**30,
        rate=8192,
        budget_s=420.0,
    ),
    "quick": dict(
        kernels=(8192, 8192),
        gemm=[(4096, 4096, 4096)],
        linear=[(4096, 4096, 4096)],
        mlp=(4096, 2048, 8192),
        layer=dict(batch=2, seq=1024, d=2048, heads=16, kv_heads=4, head_dim=128, ffn=8192),
        step_linear=[(2048, 4096, 4096)],
        step_mlp=[(2048, 2048, 8192)],
        tiny=(16, 64, 64),
        copy_bytes=2**30,
        rate=8192,
        budget_s=90.0,
    ),
    "smoke": dict(
        kernels=None,  # benchmarks.kernels --cpu-smoke picks its own tiny shape
        gemm=[(64, 64, 48)],
        linear=[(32, 64, 48)],
        mlp=(32, 64, 96),
        layer=dict(batch=2, seq=8, d=64, heads=4, kv_heads=2, head_dim=16, ffn=64),
        step_linear=[(32, 64, 48)],
        step_mlp=[(32, 64, 96)],
        tiny=(16, 64, 64),
        copy_bytes=2**20,
        rate=64,
        budget_s=math.inf,
    ),
}


# ----------------------------------------------------------------------------------------------------------
# Environment: device, timer, compile, torchao, calibration


@dataclass
class Env:
    device: str
    mode: str  # full | quick | smoke
    out: str
    sizes: dict
    meta: dict
    torchao: Optional[SimpleNamespace]
    torchao_note: Optional[str]
    no_rowwise: bool = False
    budget_s: float = math.inf
    rounds: int = ROUNDS  # interleaved timing rounds of cases c-e, g (fwd_bwd_variants)
    t0: float = field(default_factory=time.perf_counter)
    calib: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def bench(self, fn: Callable, rep: int = REP) -> float:
        """Milliseconds per call: do_bench median on the GPU, a plain wall clock in the CPU smoke run."""
        return make_timer(self.cuda, warmup=25, rep=rep)(fn)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def compile(self, model):
        return torch.compile(model, dynamic=False) if self.cuda else model

    def cleanup(self, reset: bool = True) -> None:
        gc.collect()
        if self.cuda:
            if reset:
                torch._dynamo.reset()
            torch.cuda.empty_cache()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def skip_reason(self, key: str) -> Optional[str]:
        if key.startswith("torchao") and self.torchao is None:
            return self.torchao_note
        if key == "torchao_rowwise" and self.no_rowwise:
            return "skipped: --no-rowwise"
        if key == "torchao_rowwise" and self.elapsed() > self.budget_s:
            return f"skipped: the run passed its time budget (--budget-s {self.budget_s:.0f}) at {self.elapsed():.0f} s"
        return None

    def randn(self, *shape, dtype=BF16, requires_grad=False) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=dtype, requires_grad=requires_grad)


def load_torchao():
    """(namespace with version/config/convert, None) or (None, why not)."""
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # ImportError, or an install that fails on import
        return None, f"torchao not importable ({type(e).__name__}: {str(e)[:200]})"
    return SimpleNamespace(
        version=torchao.__version__, config=Float8LinearConfig, convert=convert_to_float8_training
    ), None


def _triton_version() -> Optional[str]:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def make_env(args) -> Env:
    mode = "smoke" if args.cpu_smoke else "quick" if args.quick else "full"
    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks needs a CUDA GPU (or --cpu-smoke)")
    tao, note = load_torchao()
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "torchao": tao.version if tao else None,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode,
        "timer": (
            "wall clock, no torch.compile (cpu smoke)"
            if device == "cpu"
            else f"triton.testing.do_bench(warmup=25, rep={REP}; {BLOCK_REP} for blocks, median)"
        ),
    }
    sizes = SIZES[mode]
    budget = args.budget_s if args.budget_s is not None else sizes["budget_s"]
    meta["rounds"] = args.rounds
    return Env(device, mode, args.out, sizes, meta, tao, note, args.no_rowwise, budget, args.rounds)


def calibrate(env: Env) -> dict:
    """Copy bandwidth (GB/s, read + written), FP8 and bf16 GEMM rates (TFLOP/s), measured now."""
    x = env.randn(env.sizes["copy_bytes"] // 2)
    copy_ms = env.bench(lambda: x.clone())
    copy_gbps = 2 * x.numel() * x.element_size() / copy_ms / 1e6
    x = None  # freed before the GEMMs
    s = env.sizes["rate"]
    a8, b8 = env.randn(s, s).to(E4M3), env.randn(s, s).to(E4M3).t()  # B column-major, as cuBLASLt wants
    one = torch.ones((), device=env.device)
    fp8_ms = env.bench(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=BF16))
    a, b = env.randn(s, s), env.randn(s, s)
    bf16_ms = env.bench(lambda: a @ b.t())
    a8 = b8 = a = b = None
    env.cleanup()
    flops = 2 * s**3
    return {"copy_gbps": copy_gbps, "fp8_tflops": flops / fp8_ms / 1e9, "bf16_tflops": flops / bf16_ms / 1e9}


def floor_ms(env: Env, fp8_flops: float, nbytes: float, bf16_flops: float = 0.0) -> Optional[float]:
    c = env.calib
    if not c:
        return None
    return fp8_flops / (c["fp8_tflops"] * 1e9) + bf16_flops / (c["bf16_tflops"] * 1e9) + nbytes / (c["copy_gbps"] * 1e6)


# ----------------------------------------------------------------------------------------------------------
# Records


def new_record(env: Env, letter: str, case: str, label: str, shape, **extra) -> dict:
    rec = {"case": case, "letter": letter, "label": label, "shape": list(shape)}
    for key in VARIANTS:
        rec[f"{key}_ms"] = None
    rec["scaled_mm_ms"] = None
    for key in VARIANTS:
        rec[f"peak_mem_{key}"] = None
    rec.update(
        gemm_flops=None,
        floor_bytes=None,
        floor_ms=None,
        fraction_of_floor=None,
        speedup_vs_bf16=None,
        speedup_vs_bf16_compiled=None,
        speedup_vs_torchao=None,
        speedup_vs_torchao_rowwise=None,
        compiled_speedup_vs_bf16_compiled=None,
        compiled_speedup_vs_torchao=None,
        skipped={},
        errors={},
        error=None,
        notes=[],
    )
    rec.update(extra)
    rec.update(env.meta)
    rec.update(env.calib)
    return rec


def finish_record(rec: dict) -> dict:
    """Speedups and the fraction of the floor. With timed rounds (cases c-e, g), each speedup is the median
    over rounds of that round's ratio, so both times of a ratio come from the same round. Ours eager is
    held against every baseline; ours compiled against bf16 compiled and torchao (both compiled too)."""
    rounds = rec.get("rounds_ms") or {}

    def speedup(base: str, ours: str) -> Optional[float]:
        if not rec[f"{base}_ms"] or not rec[f"{ours}_ms"]:
            return None
        if base in rounds and ours in rounds:
            return statistics.median([b / o for b, o in zip(rounds[base], rounds[ours])])
        return rec[f"{base}_ms"] / rec[f"{ours}_ms"]

    for key in ["bf16", "bf16_compiled", "torchao", "torchao_rowwise"]:
        rec[f"speedup_vs_{key}"] = speedup(key, "ours")
    rec["compiled_speedup_vs_bf16_compiled"] = speedup("bf16_compiled", "ours_compiled")
    rec["compiled_speedup_vs_torchao"] = speedup("torchao", "ours_compiled")
    if rec["ours_ms"] and rec["floor_ms"]:
        rec["fraction_of_floor"] = rec["floor_ms"] / rec["ours_ms"]
    return rec


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:500]}"


def log(msg: str) -> None:
    try:
        from tqdm import tqdm

        tqdm.write(msg)
    except ImportError:
        print(msg, flush=True)


def run_variant(env: Env, rec: dict, key: str, measure_fn: Callable, reset: bool = True) -> None:
    """measure_fn() -> (ms, peak bytes or None) into rec; a skip or a failure is recorded, not raised.
    reset=False keeps torch._dynamo's compiled code (the variants of a case are timed again in rounds)."""
    reason = env.skip_reason(key)
    if reason:
        rec["skipped"][key] = reason
        return
    try:
        ms, peak = measure_fn()
        rec[f"{key}_ms"] = ms
        if peak is not None:
            rec[f"peak_mem_{key}"] = peak
        log(f"  {rec['label']} {tuple(rec['shape'])} {key}: {ms:.4f} ms")
    except Exception as e:
        rec["errors"][key] = _err(e)
        log(f"  {rec['label']} {tuple(rec['shape'])} {key}: FAILED {_err(e)}")
        traceback.print_exc(file=sys.stderr)
    finally:
        env.cleanup(reset)


def guarded(rec: dict, body: Callable) -> dict:
    """Run one shape's body; an exception outside the variants (e.g. OOM on the inputs) goes to rec['error']."""
    try:
        body()
    except Exception as e:
        rec["error"] = _err(e)
        traceback.print_exc(file=sys.stderr)
    return rec


# ----------------------------------------------------------------------------------------------------------
# Forward+backward measurement


class FwdBwd:
    """One training step's forward+backward: grads to None, parameter versions bumped (as an optimizer
    step would: cached FP8 weights are re-quantized), y = model(x), y.backward(dy)."""

    def __init__(self, model, x, dy, bump: bool = True):
        self.model, self.x, self.dy = model, x, dy
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.bump = bump

    def clear(self) -> None:
        for p in self.params:
            p.grad = None
        self.x.grad = None

    def __call__(self) -> None:
        self.clear()
        if self.bump:
            for p in self.params:
                torch.autograd.graph.increment_version(p)
        self.model(self.x).backward(self.dy)


class TrainStep(FwdBwd):
    """A whole training step: zero_grad (to None), y = model(x), y.backward(dy), AdamW step (foreach, the
    same eager optimizer for every variant). The optimizer moves the weights, so FP8 copies are made anew
    each step, as in training."""

    def __init__(self, model, x, dy):
        super().__init__(model, x, dy, bump=False)
        self.opt = torch.optim.AdamW(self.params, lr=1e-6, foreach=True)

    def __call__(self) -> None:
        self.clear()
        self.model(self.x).backward(self.dy)
        self.opt.step()


def peak_memory(env: Env, step: FwdBwd) -> Optional[int]:
    if not env.cuda:
        step()
        return None
    step.clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure(env: Env, step: FwdBwd, rep: int = REP):
    """(median ms, peak bytes): two warm-up steps (compiles), one step for memory, then do_bench."""
    for _ in range(2):
        step()
    env.sync()
    peak = peak_memory(env, step)
    return env.bench(step, rep), peak


def torchao_model(env: Env, ref: torch.nn.Module, recipe: str):
    """A copy of ref with its nn.Linear layers swapped by torchao (recipe "tensorwise" or "rowwise"), compiled."""
    tao = env.torchao
    model = tao.convert(copy.deepcopy(ref), config=tao.config.from_recipe_name(recipe))
    if not any(type(m).__name__ == "Float8Linear" for m in model.modules()):
        raise RuntimeError(f"torchao converted no nn.Linear of {type(ref).__name__}")
    return env.compile(model)


def fwd_bwd_variants(env: Env, rec: dict, builders: dict, x, dy, rep: int = REP, step_cls=FwdBwd) -> None:
    """Build, warm and time each builder's model in the order given (bf16 compiled before torchao, whose
    conversion patches inductor's min/max codegen process-wide), with its peak memory; that first timing
    is a warm-up and is not kept (it follows a build, a compile or a cleanup: at M = 1024 it read 0.29 ms
    for a step that then took 0.15). Then time them all env.rounds times, round-robin, and keep each variant's
    median round and, in finish_record, the median of each round's ratio. Timed one after the other, the
    same step moved by 5-7% between runs on the H100 (clocks follow power and heat); interleaved, the two
    sides of a ratio see the same drift. Every timed round is kept in rec["rounds_ms"]."""
    steps = {}

    def first(key, build):
        step = step_cls(build(), x, dy)
        out = measure(env, step, rep)
        steps[key] = step
        return out

    for key, build in builders.items():
        run_variant(env, rec, key, lambda key=key, build=build: first(key, build), reset=False)
    rounds = {key: [] for key in steps}
    for _ in range(env.rounds):
        for key, step in steps.items():
            try:
                rounds[key].append(env.bench(step, rep))
            except Exception as e:  # recorded like a failed first round: the variant's time is dropped
                rec["errors"][key] = _err(e)
    for key, times in rounds.items():
        rec[f"{key}_ms"] = None if key in rec["errors"] else statistics.median(times)
    rec["rounds_ms"] = rounds
    steps.clear()
    env.cleanup()


def standard_builders(env: Env, ref, ours) -> dict:
    """bf16 eager and compiled, ours eager and compiled, torchao tensorwise and rowwise compiled. Compiled
    variants share their eager twin's parameters."""
    return {
        "bf16": lambda: ref,
        "bf16_compiled": lambda: env.compile(ref),
        "ours": lambda: ours,
        "ours_compiled": lambda: env.compile(ours),
        "torchao": lambda: torchao_model(env, ref, "tensorwise"),
        "torchao_rowwise": lambda: torchao_model(env, ref, "rowwise"),
    }


def sqnr_db(ref, ours, x) -> float:
    """Output of ours against the bf16 reference on the same input and weights, in dB."""
    with torch.no_grad():
        want, got = ref(x).float(), ours(x).float()
    return float(10 * torch.log10(want.pow(2).sum() / (want - got).pow(2).sum()))


def copy_weights(pairs) -> None:
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)


def _nbytes_fwd_bwd(tokens: int, d_in: int, d_out: int, params: int) -> int:
    """bf16 bytes: x, params and dy read once; y, dx and the params' grads written once."""
    return 2 * 2 * (tokens * d_in + tokens * d_out + params)


# ----------------------------------------------------------------------------------------------------------
# Reference modules (plain PyTorch, bf16)


class Bf16TransformerLayer(torch.nn.Module):
    """Pre-norm layer: x + proj(attn(qkv(norm(x)))), then x + down(swiglu(up(norm(x)))). GQA through
    SDPA's enable_gqa (as float8.ops.Attention), causal (FlashAttention)."""

    def __init__(self, d, heads, kv_heads, head_dim, ffn):
        super().__init__()
        self.h, self.hk, self.hd = heads, kv_heads, head_dim
        self.norm1 = torch.nn.RMSNorm(d, eps=1e-6)
        self.qkv = torch.nn.Linear(d, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.proj = torch.nn.Linear(heads * head_dim, d, bias=False)
        self.norm2 = torch.nn.RMSNorm(d, eps=1e-6)
        self.up = torch.nn.Linear(d, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, d, bias=False)

    def attention(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, self.h + 2 * self.hk, self.hd).transpose(1, 2)
        q, k, v = qkv.split([self.h, self.hk, self.hk], dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.hk != self.h)
        return self.proj(o.transpose(1, 2).reshape(b, s, self.h * self.hd))

    def forward(self, x):
        x = x + self.attention(x)
        a, g = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(a) * g)


def fp8_transformer_layer(d, heads, kv_heads, head_dim, ffn):
    import float8.ops as ops

    return ops.Sequential(
        ops.Residual(),
        ops.RMSNorm(d),
        ops.Linear(d, (heads + 2 * kv_heads) * head_dim, bias=False),
        ops.Attention(heads, head_dim, num_kv_heads=kv_heads, causal=True),
        ops.Linear(heads * head_dim, d, bias=False),
        ops.AddResidual(),
        ops.Residual(),
        ops.RMSNorm(d),
        ops.Linear(d, 2 * ffn, bias=False),
        ops.SwiGLU(),
        ops.Linear(ffn, d, bias=False),
        ops.AddResidual(),
    )


# ----------------------------------------------------------------------------------------------------------
# Cases


def case_kernels(env: Env) -> list:
    """(a) benchmarks.kernels, reused: ours (Triton) against eager and compiled torch of the same math."""
    from benchmarks import kernels

    argv = [] if env.out is None else ["--out", env.out]
    if env.mode == "smoke":
        argv += ["--cpu-smoke", "--no-compile"]
    else:
        argv += ["--shape", *map(str, env.sizes["kernels"])]
        if env.mode == "quick":
            argv += ["--no-compile"]
    result = kernels.main(argv)
    shape, numel = result["meta"]["shape"], math.prod(result["meta"]["shape"])
    by_kernel = {}
    for r in result["records"]:
        by_kernel.setdefault(r["kernel"], {})[r["impl"]] = r
    records = []
    for name, impls in by_kernel.items():
        bpe = impls["ours"]["bytes_per_elem"]
        rec = new_record(
            env,
            "a",
            "kernels",
            f"a {name}",
            shape,
            kernel=name,
            bytes_per_elem=bpe,
            kernels_frac_of_copy=impls["ours"]["frac_of_copy"],
            notes=["bf16 = eager torch of the same math (the *_ref), bf16 compiled = its torch.compile"],
        )
        rec["ours_ms"] = impls["ours"]["ms"]
        rec["bf16_ms"] = impls["eager"]["ms"]
        rec["bf16_compiled_ms"] = impls.get("compiled", {}).get("ms")
        rec["floor_bytes"] = bpe * numel
        rec["floor_ms"] = floor_ms(env, 0, bpe * numel)
        if env.mode == "smoke":
            rec["notes"].append("cpu smoke: ours is the reference path")
        records.append(rec)
    return records


def case_gemm(env: Env) -> list:
    """(b) FP8 GEMM on pre-quantized operands: ours, raw torch._scaled_mm on the same bits, bf16."""
    from float8 import Float8Tensor

    records = []
    for m, k, n in env.sizes["gemm"]:
        rec = new_record(env, "b", "gemm", "b FP8 GEMM", (m, k, n))
        records.append(guarded(rec, lambda: _gemm_shape(env, rec, m, k, n, Float8Tensor)))
    return records


def _gemm_shape(env, rec, m, k, n, Float8Tensor):
    x, w = env.randn(m, k), env.randn(n, k)
    a, b = Float8Tensor.quantize(x), Float8Tensor.quantize(w)
    fa, fbt, sa, sb = a.fp8_data, b.fp8_data.t(), a.scale_inv, b.scale_inv

    def raw():
        return torch._scaled_mm(fa, fbt, scale_a=sa, scale_b=sb, out_dtype=BF16)

    rec["ours_matches_scaled_mm"] = bool(torch.equal(a @ b.t(), raw()))
    flops = 2 * m * k * n
    for key, fn in [("ours", lambda: a @ b.t()), ("scaled_mm", raw), ("bf16", lambda: x @ w.t())]:
        run_variant(env, rec, key, lambda fn=fn: (env.bench(fn), None))
    for key in ["ours", "scaled_mm", "bf16"]:
        ms = rec[f"{key}_ms"]
        rec[f"tflops_{key}"] = flops / ms / 1e9 if ms else None
    rec["gemm_flops"] = flops
    rec["floor_bytes"] = m * k + n * k + 2 * m * n
    rec["floor_ms"] = floor_ms(env, flops, rec["floor_bytes"])
    rec["notes"].append("bf16 compiled and torchao: not applicable (a GEMM alone)")


def case_linear(env: Env) -> list:
    """(c) Linear forward+backward, y = layer(x); y.backward(dy)."""
    records = []
    for m, k, n in env.sizes["linear"]:
        rec = new_record(env, "c", "linear", "c Linear fwd+bwd", (m, k, n))
        records.append(guarded(rec, lambda: _linear_shape(env, rec, m, k, n)))
    return records


def _linear_shape(env, rec, m, k, n, step_cls=None):
    import float8.ops as ops

    step_cls = step_cls or FwdBwd
    x, dy = env.randn(m, k, requires_grad=True), env.randn(m, n)
    ref = torch.nn.Linear(k, n, bias=False).to(env.device, BF16)
    ours = ops.Linear(k, n, bias=False).to(env.device, BF16)
    copy_weights([(ours.weight, ref.weight)])
    fwd_bwd_variants(env, rec, standard_builders(env, ref, ours), x, dy, step_cls=step_cls)
    _set_floor(env, rec, step_cls, 3 * 2 * m * k * n, _nbytes_fwd_bwd(m, k, n, k * n), k * n)


def _set_floor(env, rec, step_cls, flops, nbytes, params):
    """floor_ms from the GEMM FLOPs and the bytes of a forward+backward; a whole step (TrainStep) adds
    AdamW's: weight, gradient and both states read, weight and states written, all bf16 (the states take the
    parameters' dtype), 14 bytes per parameter."""
    if step_cls is TrainStep:
        nbytes += 14 * params
        rec["notes"].append("whole step: zero_grad, forward, backward, AdamW(foreach) step")
    rec["gemm_flops"], rec["floor_bytes"] = flops, nbytes
    rec["floor_ms"] = floor_ms(env, flops, nbytes)


def case_mlp(env: Env) -> list:
    """(d) MLP block forward+backward: RMSNorm -> Linear d->2f -> SwiGLU -> Linear f->d; time and memory."""
    tokens, d, f = env.sizes["mlp"]
    rec = new_record(env, "d", "mlp", "d MLP block fwd+bwd", (tokens, d, f))
    return [guarded(rec, lambda: _mlp(env, rec, tokens, d, f))]


def _mlp(env, rec, tokens, d, f, step_cls=None):
    from benchmarks.blocks import Bf16MLP, fp8_mlp

    step_cls = step_cls or FwdBwd
    x, dy = env.randn(tokens, d, requires_grad=True), env.randn(tokens, d)
    ref = Bf16MLP(d, f).to(env.device, BF16)
    ours = fp8_mlp(d, f).to(env.device, BF16)
    copy_weights(
        [(ours[0].weight, ref.norm.weight), (ours[1].weight, ref.up.weight), (ours[3].weight, ref.down.weight)]
    )
    rec["output_sqnr_db_vs_bf16"] = sqnr_db(ref, ours, x)
    fwd_bwd_variants(env, rec, standard_builders(env, ref, ours), x, dy, BLOCK_REP, step_cls=step_cls)
    params = d + 2 * f * d + f * d
    _set_floor(env, rec, step_cls, 3 * 2 * tokens * (d * 2 * f + f * d), _nbytes_fwd_bwd(tokens, d, d, params), params)


def case_layer(env: Env) -> list:
    """(e) transformer layer forward+backward (causal GQA attention, SwiGLU FFN); time and memory."""
    c = env.sizes["layer"]
    shape = [c[k] for k in ["batch", "seq", "d", "heads", "kv_heads", "head_dim", "ffn"]]
    rec = new_record(
        env,
        "e",
        "transformer_layer",
        "e transformer layer fwd+bwd",
        shape,
        shape_names=["batch", "seq", "d", "heads", "kv_heads", "head_dim", "ffn"],
    )
    return [guarded(rec, lambda: _layer(env, rec, **c))]


def _layer(env, rec, batch, seq, d, heads, kv_heads, head_dim, ffn):
    x, dy = env.randn(batch, seq, d, requires_grad=True), env.randn(batch, seq, d)
    ref = Bf16TransformerLayer(d, heads, kv_heads, head_dim, ffn).to(env.device, BF16)
    ours = fp8_transformer_layer(d, heads, kv_heads, head_dim, ffn).to(env.device, BF16)
    copy_weights(
        [
            (ours[1].weight, ref.norm1.weight),
            (ours[2].weight, ref.qkv.weight),
            (ours[4].weight, ref.proj.weight),
            (ours[7].weight, ref.norm2.weight),
            (ours[8].weight, ref.up.weight),
            (ours[10].weight, ref.down.weight),
        ]
    )
    rec["output_sqnr_db_vs_bf16"] = sqnr_db(ref, ours, x)
    fwd_bwd_variants(env, rec, standard_builders(env, ref, ours), x, dy, BLOCK_REP)
    tokens, qkv = batch * seq, (heads + 2 * kv_heads) * head_dim
    weights = d * qkv + heads * head_dim * d + d * 2 * ffn + ffn * d
    rec["gemm_flops"] = 3 * 2 * tokens * weights
    rec["attention_flops"] = 7 * batch * heads * seq * seq * head_dim  # causal: fwd 2*b*h*s^2*hd, bwd 2.5x
    rec["floor_bytes"] = _nbytes_fwd_bwd(tokens, d, d, weights + 2 * d)
    rec["floor_ms"] = floor_ms(env, rec["gemm_flops"], rec["floor_bytes"], rec["attention_flops"])
    rec["notes"].append("floor: attention FLOPs at the measured bf16 GEMM rate")


def case_host(env: Env) -> list:
    """(f) host time per tiny Linear forward+backward (benchmarks.host, reused) + compiled peers."""
    m, k, n = env.sizes["tiny"]
    rec = new_record(
        env,
        "f",
        "host",
        "f host time, tiny Linear fwd+bwd",
        (m, k, n),
        notes=[
            "ms per call from a stream of calls (host-bound); ours and bf16 eager from "
            "benchmarks.host.tiny_linear_steps (ours forced onto its FP8 path, small-layer policy off; "
            "it keeps its cached FP8 weight there); *_graphed: the same steps captured with "
            "torch.cuda.make_graphed_callables (ours re-quantizes its weight in the graph)"
        ],
    )
    return [guarded(rec, lambda: _host(env, rec, m, k, n))]


def _host(env, rec, m, k, n):
    from benchmarks import host

    if env.cuda:
        from float8 import Recipe

        # The FP8 path itself: with the default recipe a layer this small would run in bf16 (policy).
        bf16_step, ours_step = host.tiny_linear_steps(m, k, n, recipe=Recipe(min_fp8_gemm_flops=0))
        timer = host_us
    else:
        bf16_step, ours_step = _tiny_steps_cpu(env, m, k, n)
        timer = lambda fn: host_us(fn, n=5, warmup=1)  # noqa: E731  (CPU smoke: plumbing only)
    x, dy = env.randn(m, k, requires_grad=True), env.randn(m, n)
    lin = torch.nn.Linear(k, n, bias=False).to(env.device, BF16)
    steps = {
        "bf16": lambda: bf16_step,
        "ours": lambda: ours_step,
        **(
            {"ours_graphed": lambda: ours_step.graphed(), "bf16_graphed": lambda: bf16_step.graphed()}
            if env.cuda
            else {}
        ),
        "bf16_compiled": lambda: FwdBwd(env.compile(lin), x, dy, bump=False),
        "torchao": lambda: FwdBwd(torchao_model(env, lin, "tensorwise"), x, dy, bump=False),
    }
    for key, make in steps.items():
        run_variant(env, rec, key, lambda make=make: (timer(make()) / 1e3, None))


def _tiny_steps_cpu(env, m, k, n):
    """The CPU twin of benchmarks.host.tiny_linear_steps (which is CUDA-only)."""
    import float8.ops as ops

    x, dy = env.randn(m, k, requires_grad=True), env.randn(m, n)
    ref = torch.nn.Linear(k, n, bias=False).to(env.device, BF16)
    ours = ops.Linear(k, n, bias=False).to(env.device, BF16)
    return FwdBwd(ref, x, dy, bump=False), FwdBwd(ours, x, dy, bump=False)


def case_steps(env: Env) -> list:
    """(g) whole training steps with AdamW (TrainStep): the Linear and the MLP block of cases c and d."""
    records = []
    for m, k, n in env.sizes["step_linear"]:
        rec = new_record(env, "g", "step_linear", "g Linear train step", (m, k, n))
        records.append(guarded(rec, lambda: _linear_shape(env, rec, m, k, n, TrainStep)))
    for tokens, d, f in env.sizes["step_mlp"]:
        rec = new_record(env, "g", "step_mlp", "g MLP train step", (tokens, d, f))
        records.append(guarded(rec, lambda: _mlp(env, rec, tokens, d, f, TrainStep)))
    return records


CASES = {
    "a": ("kernels", case_kernels),
    "b": ("gemm", case_gemm),
    "c": ("linear", case_linear),
    "d": ("mlp", case_mlp),
    "e": ("transformer_layer", case_layer),
    "f": ("host", case_host),
    "g": ("steps", case_steps),
}


# ----------------------------------------------------------------------------------------------------------
# Outputs


def _fmt(v, spec=".3f", suffix="") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


def _mib(v) -> str:
    return "—" if v is None else f"{v / 2**20:.0f}"


def _shape(rec) -> str:
    return "x".join(map(str, rec["shape"]))


def markdown(env: Env, records: list) -> str:
    m, c = env.meta, env.calib
    tao = f"torchao {m['torchao']}" if m["torchao"] else f"**{env.torchao_note}: torchao columns are empty**"
    lines = [
        f"# float8 benchmark suite, {m['device']}",
        "",
        f"{m['date']}, torch {m['torch']}, triton {m['triton']}, {tao}; mode {m['mode']}; {m['timer']}; "
        f"{m['rounds']} interleaved rounds per variant (cases c-e, g), median.",
    ]
    if c:
        lines.append(
            f"Measured now: copy {c['copy_gbps']:.0f} GB/s (read + written), FP8 `_scaled_mm` "
            f"{c['fp8_tflops']:.0f} TFLOP/s, bf16 GEMM {c['bf16_tflops']:.0f} TFLOP/s."
        )
    lines += [
        "Speedup = baseline ms / ours ms (above 1: ours is faster). floor = GEMM FLOPs / FP8 rate + minimal "
        "bytes / copy bandwidth; of floor = floor / ours. Peak memory: MiB above what was allocated before "
        "one forward+backward (case g: one whole step). Case a: bf16 = eager torch of the same math, bf16 compiled "
        "= its torch.compile. Case f: ms per call, host-bound. Case g: whole training steps (zero_grad, forward, "
        "backward, AdamW foreach step). The vs columns hold ours eager against each baseline; ours compiled "
        "against bf16 compiled and torchao tensorwise is in the notes below the table.",
        "",
        "| case | shape | ours ms | ours compiled ms | bf16 ms | bf16 compiled ms | torchao tw ms | torchao rw ms "
        "| vs bf16 | vs compiled | vs torchao tw | vs torchao rw | floor ms | of floor | peak MiB ours | bf16 "
        "| torchao tw |",
        "| --- | --- |" + " ---: |" * 15,
    ]
    for r in records:
        lines.append(
            f"| {r['label']} | {_shape(r)} | {_fmt(r['ours_ms'], '.4f')} | {_fmt(r['ours_compiled_ms'], '.4f')} | "
            f"{_fmt(r['bf16_ms'], '.4f')} | "
            f"{_fmt(r['bf16_compiled_ms'], '.4f')} | {_fmt(r['torchao_ms'], '.4f')} | "
            f"{_fmt(r['torchao_rowwise_ms'], '.4f')} | {_fmt(r['speedup_vs_bf16'], '.2f', 'x')} | "
            f"{_fmt(r['speedup_vs_bf16_compiled'], '.2f', 'x')} | {_fmt(r['speedup_vs_torchao'], '.2f', 'x')} | "
            f"{_fmt(r['speedup_vs_torchao_rowwise'], '.2f', 'x')} | {_fmt(r['floor_ms'], '.4f')} | "
            f"{_fmt(None if r['fraction_of_floor'] is None else 100 * r['fraction_of_floor'], '.0f', '%')} | "
            f"{_mib(r['peak_mem_ours'])} | {_mib(r['peak_mem_bf16'])} | {_mib(r['peak_mem_torchao'])} |"
        )
    lines += _gemm_table(records) + _block_notes(records) + _problems(env, records)
    return "\n".join(lines) + "\n"


def _gemm_table(records) -> list:
    rows = [r for r in records if r["case"] == "gemm"]
    if not rows:
        return []
    lines = [
        "",
        "FP8 GEMM rates (operands pre-quantized):",
        "",
        "| M x K x N | ours TFLOP/s | _scaled_mm TFLOP/s | bf16 TFLOP/s | ours == _scaled_mm bits |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        rates = " | ".join(_fmt(r.get(f"tflops_{k}"), ".0f") for k in ["ours", "scaled_mm", "bf16"])
        lines.append(f"| {_shape(r)} | {rates} | {r.get('ours_matches_scaled_mm', '—')} |")
    return lines


def _block_notes(records) -> list:
    lines = []
    for r in records:
        if r["case"] == "host" and r.get("ours_graphed_ms") and r["bf16_ms"]:
            eager = f"; ours eager (above) {r['ours_ms'] / r['bf16_ms']:.2f}x the time of bf16" if r["ours_ms"] else ""
            lines.append(
                f"- {r['label']} {_shape(r)}: in CUDA graphs (make_graphed_callables) ours "
                f"{r['ours_graphed_ms']:.4f} ms, {r['ours_graphed_ms'] / r['bf16_ms']:.2f}x the time of bf16 "
                f"eager (speedup {r['bf16_ms'] / r['ours_graphed_ms']:.2f}x), bf16 graphed "
                f"{_fmt(r.get('bf16_graphed_ms'), '.4f')} ms{eager}"
            )
        if r.get("compiled_speedup_vs_bf16_compiled") is not None:
            lines.append(
                f"- {r['label']} {_shape(r)}: ours compiled {r['compiled_speedup_vs_bf16_compiled']:.2f}x bf16 "
                f"compiled, {_fmt(r['compiled_speedup_vs_torchao'], '.2f', 'x')} torchao tensorwise; peak "
                f"MiB ours compiled {_mib(r['peak_mem_ours_compiled'])}"
            )
        if r.get("output_sqnr_db_vs_bf16") is not None:
            lines.append(
                f"- {r['label']} {_shape(r)}: ours' output against bf16 on the same weights, "
                f"SQNR {r['output_sqnr_db_vs_bf16']:.1f} dB; peak MiB bf16 compiled "
                f"{_mib(r['peak_mem_bf16_compiled'])}, torchao rowwise {_mib(r['peak_mem_torchao_rowwise'])}"
            )
    return ["", *lines] if lines else []


def _problems(env: Env, records) -> list:
    lines = []
    for r in records:
        where = f"{r['label']} {_shape(r)}"
        if r["error"]:
            lines.append(f"- {where}: ERROR {r['error']}")
        for k, v in r["errors"].items():
            lines.append(f"- {where} {k}: ERROR {v}")
        for k, v in r["skipped"].items():
            if v != env.torchao_note:
                lines.append(f"- {where} {k}: {v}")
    return ["", "Skipped and failed:", "", *lines] if lines else []


def plot(records: list, path: str) -> Optional[str]:
    """Speedup over bf16 eager per case/shape (bars: ours eager and compiled, bf16 compiled, torchao tw, rw).
    None if skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG written")
        return None
    rows = [r for r in records if r["bf16_ms"]]
    series = [
        ("ours", "ours (float8)"),
        ("ours_compiled", "ours compiled"),
        ("bf16_compiled", "bf16 compiled"),
        ("torchao", "torchao tensorwise"),
        ("torchao_rowwise", "torchao rowwise"),
    ]
    width = 0.16
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(rows) + 2), 5))
    for i, (key, name) in enumerate(series):
        ys = [r["bf16_ms"] / r[f"{key}_ms"] if r[f"{key}_ms"] else math.nan for r in rows]
        ax.bar([j + (i - 2) * width for j in range(len(rows))], ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(
        [f"{textwrap.shorten(r['label'], 34)}\n{_shape(r)}" for r in rows], rotation=60, ha="right", fontsize=7
    )
    ax.set_yscale("log")
    ax.set_ylabel("speedup over bf16 eager (log)")
    ax.set_title(f"float8 benchmark suite, {rows[0]['device'] if rows else ''}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


FIGURE_VARIANTS = VARIANTS + ["scaled_mm", "ours_graphed", "bf16_graphed"]


def figures(records: list) -> list:
    """The records' figures for history.csv: per variant its ms, peak MiB and TFLOP/s; ours' speedups
    (ours_compiled's against the compiled baselines), fraction of the floor and SQNR; the floor itself."""
    out = []
    for r in records:
        case = f"{r['label']} {_shape(r)}"
        for key in FIGURE_VARIANTS:
            for metric, key_, scale in (
                ("ms", f"{key}_ms", 1),
                ("peak_MiB", f"peak_mem_{key}", 2**-20),
                ("TFLOP/s", f"tflops_{key}", 1),
            ):
                if r.get(key_) is not None:
                    out.append(figure(case, key, metric, r[key_] * scale))
        for variant, metric, key_ in [
            *[
                ("ours", f"speedup_vs_{k}", f"speedup_vs_{k}")
                for k in ("bf16", "bf16_compiled", "torchao", "torchao_rowwise")
            ],
            ("ours_compiled", "speedup_vs_bf16_compiled", "compiled_speedup_vs_bf16_compiled"),
            ("ours_compiled", "speedup_vs_torchao", "compiled_speedup_vs_torchao"),
            ("ours", "fraction_of_floor", "fraction_of_floor"),
            ("ours", "fraction_of_copy", "kernels_frac_of_copy"),
            ("ours", "sqnr_db_vs_bf16", "output_sqnr_db_vs_bf16"),
            ("floor", "ms", "floor_ms"),
        ]:
            if r.get(key_) is not None:
                out.append(figure(case, variant, metric, r[key_]))
    return out


def record_case(env: Env, name: str, records: list) -> None:
    """One case's records as the area bench_<name> of the results folder."""
    record(f"bench_{name}", env.out, env.meta, figures(records), markdown(env, records), {"records": records})


def _progress(items):
    try:
        from tqdm import tqdm

        return tqdm(items, desc="benchmarks", unit="case")
    except ImportError:
        return _printed_progress(items)


def _printed_progress(items):
    for i, item in enumerate(items, 1):
        print(f"[{i}/{len(items)}] case {item[0]} ({item[1][0]})", flush=True)
        yield item


# ----------------------------------------------------------------------------------------------------------
# Main


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument(
        "--out",
        default=None,
        help="results folder (default benchmarks/results/): latest.json/.md, history.csv, bench.png",
    )
    p.add_argument("--quick", action="store_true", help="small shapes (under ~2 minutes)")
    p.add_argument("--cases", default="a,b,c,d,e,f,g", help="comma-separated letters among a..g")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU, wall-clock timer, no compile")
    p.add_argument("--no-rowwise", action="store_true", help="skip the torchao rowwise variants")
    p.add_argument(
        "--rounds",
        type=int,
        default=ROUNDS,
        help=f"interleaved timing rounds per variant in cases c-e and g (default {ROUNDS}; more where the "
        "host's drift shows: host-bound steps)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip torchao rowwise once the run has taken this long (default 420 full, 90 quick)",
    )
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        p.error(f"unknown case(s) {bad}; choose among {','.join(CASES)}")
    return args


def run_case(env: Env, letter: str) -> list:
    name, fn = CASES[letter]
    t = time.perf_counter()
    try:
        records = fn(env)
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        records = [new_record(env, letter, name, f"{letter} {name}", [], error=_err(e))]
    finally:
        env.cleanup()
    for r in records:
        finish_record(r)
        r["case_wall_s"] = time.perf_counter() - t
    return records


def main(argv=None) -> list:
    args = parse_args(argv)
    env = make_env(args)
    env.meta["command"] = command_line(None if argv is None else ["", *argv], module="benchmarks")
    if env.torchao is None:
        print(env.torchao_note + ": torchao fields will be null")
    folder = results_dir(env.out)
    try:
        env.calib = calibrate(env)
    except Exception as e:  # floors stay null; the cases still run
        print(f"calibration failed ({_err(e)}): floors will be null", file=sys.stderr)
    records = []
    for letter, _ in _progress([(c, CASES[c]) for c in args.cases]):
        records += run_case(env, letter)
        record_case(env, CASES[letter][0], [r for r in records if r["letter"] == letter])
    kept = env.cuda or env.out is not None  # as record: a CPU run is kept only where --out points
    png = plot(records, str(folder / "bench.png")) if kept else None
    print(markdown(env, records))
    wrote = f"wrote {folder / 'latest.json'}, latest.md, history.csv" + (f", {png}" if png else "")
    print(f"{wrote if kept else 'recorded nothing'} in {env.elapsed():.0f} s")
    return records
