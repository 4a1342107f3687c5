"""Multi-GPU benchmarks (torchrun, NCCL; 2 GPUs or more): FSDP2 training of a Llama-style model and a
tensor/sequence-parallel transformer layer, FP8 (float8) against bf16 and torchao, measured in one run.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 -m benchmarks.distributed [--out DIR] [--tiny]

fsdp: 8 blocks (d=4096, 32 heads and 8 KV heads of 128, SwiGLU FFN 14336), 4x2048 tokens per GPU, fp32
    master parameters, MixedPrecisionPolicy(bf16, fp32), AdamW; FSDP2 per block and at the root. The model
    is written in plain torch.nn; the variants (FSDP_VARIANTS): bf16 eager and compiled per block; the user
    path of float8 (ops.convert, float8.fsdp.enable_fp8_all_gather, precompute_scales after each step),
    eager and compiled per block; torchao tensorwise + FP8 all-gather, compiled per block (if torchao
    imports). Whole steps (zero_grad, forward, backward, optimizer step, scale precompute), CUDA events, in
    interleaved rounds with every model alive; step peak above what is held, what each model holds;
    all-gather bytes per step. --profile: NCCL time per step, the part not hidden behind compute (and on
    every rank, with its longest exposed collective: a rank that waits long reached it first), and the
    time the GPU runs no kernel at all (host-bound steps: benchmarks/results/profile_mesh.txt).
tp: one transformer layer, TP over every rank with sequence parallelism, 8192 tokens: float8.ops
    (Linear(parallel=..., sequence_parallel=True)) against the same layer in bf16 PyTorch with Megatron-style
    collectives and the norms' gradients summed over the group (as float8's), each eager and compiled
    (fullgraph).
mesh (4 GPUs or more): the fsdp model's blocks TP+SP over pairs of GPUs and FSDP2 over the pairs (a 2-D
    mesh dp x tp=2, 8192 tokens per pair): bf16 Megatron-style blocks against float8.ops blocks with the FP8
    weight all-gather, each eager and compiled per block, whole AdamW steps.
async_tp: torch's symmetric-memory collective + FP8 GEMM ops against the collective then the GEMM, at the
    tp layer's shapes (needs NVLink multicast off on the lent machines: TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
Public APIs only. --tiny shrinks every size (a CPU-free smoke of the plumbing on any 2 GPUs).
Rank 0 records the areas distributed_fsdp and distributed_tp (on 2 GPUs; distributed_fsdp_4gpu and so
on for other counts, and distributed_mesh_4gpu...) in DIR (default benchmarks/results/; a DIR/x.json
given stands for DIR; benchmarks.harness.record), with --profile also DIR/profile_fsdp.txt,
profile_tp.txt and profile_mesh.txt. --prefetch (FSDP2's explicit forward prefetch, every variant alike):
the areas distributed_fsdp_prefetch and distributed_mesh_4gpu_prefetch instead.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.harness import figures_from_rows, record, results_dir

# ---- the bf16 model in plain PyTorch (also torchao's input) ------------------------------------------------


class Block(torch.nn.Module):
    """A Llama block: attention (grouped KV heads, causal SDPA) and a SwiGLU MLP, pre-norm residuals.
    separate_gate_up: the MLP as Hugging Face's Llama writes it, `down(silu(gate(x)) * up(x))`, instead of one
    gate-and-up projection whose output is chunked. separate_qkv: q, k and v projections of the normed input,
    as Hugging Face's Llama has them, instead of one qkv projection whose output is split."""

    def __init__(self, d, heads, kv_heads, head_dim, ffn, separate_gate_up=False, separate_qkv=False):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, head_dim
        self.norm1, self.norm2 = torch.nn.RMSNorm(d, eps=1e-6), torch.nn.RMSNorm(d, eps=1e-6)
        if separate_qkv:
            self.qkv = None
            self.q = torch.nn.Linear(d, heads * head_dim, bias=False)
            self.k = torch.nn.Linear(d, kv_heads * head_dim, bias=False)
            self.v = torch.nn.Linear(d, kv_heads * head_dim, bias=False)
        else:
            self.qkv = torch.nn.Linear(d, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o = torch.nn.Linear(heads * head_dim, d, bias=False)
        if separate_gate_up:
            self.gate = torch.nn.Linear(d, ffn, bias=False)
            self.up = torch.nn.Linear(d, ffn, bias=False)
        else:
            self.gate, self.up = None, torch.nn.Linear(d, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, d, bias=False)

    def forward(self, x):  # x: (B, S, d)
        b, s, _ = x.shape
        if self.qkv is None:
            h = self.norm1(x)
            q, k, v = (p(h).view(b, s, -1, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        else:
            q, k, v = (
                self.qkv(self.norm1(x))
                .view(b, s, self.h + 2 * self.kv, self.hd)
                .transpose(1, 2)
                .split([self.h, self.kv, self.kv], dim=1)
            )
        a = (
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
            .transpose(1, 2)
            .reshape(b, s, -1)
        )
        x = x + self.o(a)
        if self.gate is not None:
            h = self.norm2(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))
        g, u = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def ops_block(d, heads, kv_heads, head_dim, ffn, recipe=None, **tp):
    """The same block from float8.ops (tp: group=..., sp=...: the tensor-parallel layer)."""
    import float8.ops as ops

    group, sp = tp.get("group"), tp.get("sp", False)
    world = group.size() if group is not None else 1
    par = (
        {"column": {}, "row": {}}
        if group is None
        else {
            "column": {"parallel": "column", "tp_group": group, "sequence_parallel": sp},
            "row": {"parallel": "row", "tp_group": group, "sequence_parallel": sp},
        }
    )
    spg = group if sp else None
    return ops.Sequential(
        ops.Residual(),
        ops.RMSNorm(d, sequence_parallel_group=spg),
        ops.Linear(d, (heads + 2 * kv_heads) * head_dim, bias=False, **par["column"]),
        ops.Attention(heads // world, head_dim, num_kv_heads=kv_heads // world, sequence_first=group is not None),
        ops.Linear(heads * head_dim, d, bias=False, **par["row"]),
        ops.AddResidual(),
        ops.Residual(),
        ops.RMSNorm(d, sequence_parallel_group=spg),
        ops.Linear(d, 2 * ffn, bias=False, **par["column"]),
        ops.SwiGLU(),
        ops.Linear(ffn, d, bias=False, **par["row"]),
        ops.AddResidual(),
        recipe=recipe,
    )


# ---- FSDP2 ---------------------------------------------------------------------------------------------------


class Stack(torch.nn.Module):
    """The blocks in order. `use` (a plain list, not submodules) swaps in compiled wrappers of the same
    blocks: one model and one optimizer serve its eager and its compiled variant."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.__dict__["use"] = None

    def forward(self, x):
        for blk in self.use or self.blocks:
            x = blk(x)
        return x


# (model, how it runs): variants of one model share its parameters, optimizer and FSDP state.
FSDP_VARIANTS = {
    "bf16 eager": ("bf16", False),
    "bf16 compiled": ("bf16", True),
    # The user path: the plain torch.nn model, ops.convert, float8.fsdp.enable_fp8_all_gather, fully_shard.
    "float8 converted + FP8 all-gather, eager": ("converted", False),
    "float8 converted + FP8 all-gather, compiled": ("converted", True),
    # The same without precompute_scales: each gather all-reduces its weight's amax (precompute off).
    "float8 converted + FP8 all-gather, compiled, scale at each gather": ("converted, no precompute", True),
    "torchao tensorwise + FP8 all-gather, compiled": ("torchao", True),
}


def _fsdp_model(kind, cfg, dev):
    """An FSDP2-sharded Stack of blocks with AdamW, and what runs after each optimizer step."""
    d, heads, kv, hd, ffn, blocks = (cfg[k] for k in ("d", "heads", "kv", "hd", "ffn", "blocks"))
    torch.manual_seed(0)
    after_step = lambda: None  # noqa: E731
    with torch.device(dev):  # built whole on the GPU (7 GiB of fp32 for 8 blocks), then sharded
        model = Stack([Block(d, heads, kv, hd, ffn) for _ in range(blocks)])
    if kind.startswith("converted"):
        import float8.fsdp as f8fsdp
        import float8.ops as ops

        ops.convert(model)
        f8fsdp.enable_fp8_all_gather(model)
        if "no precompute" not in kind:
            after_step = lambda: f8fsdp.precompute_scales(model)  # noqa: E731
    elif kind == "torchao":
        from torchao.float8 import (
            Float8LinearConfig,
            convert_to_float8_training,
            precompute_float8_dynamic_scale_for_fsdp,
        )

        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        after_step = lambda: precompute_float8_dynamic_scale_for_fsdp(model)  # noqa: E731
    return model, _shard_with_adamw(model, prefetch=cfg.get("prefetch", False)), after_step


def _shard_with_adamw(model, mesh=None, prefetch=False):
    """FSDP2 per block and at the root (bf16 compute, fp32 gradient reduction) over `mesh` (default: all
    ranks); the model's fused AdamW. prefetch: each block's forward also starts the next block's all-gather
    (FSDP2's explicit forward prefetch), for every variant alike; without it FSDP2 starts a block's
    all-gather when the host reaches that block, which overlaps compute only where the host runs ahead."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if prefetch:
        for blk, following in zip(model.blocks, model.blocks[1:]):
            blk.set_modules_to_forward_prefetch([following])
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


# The same model on a 2-D mesh: FSDP2 over "dp" (weights sharded and gathered per block), tensor and
# sequence parallelism over "tp" inside each block (2 GPUs), the input (S/tp, B=1, d) sequence-first.
MESH_VARIANTS = {
    "bf16 TP+SP x FSDP2, eager": ("bf16", False),
    "bf16 TP+SP x FSDP2, compiled": ("bf16", True),
    "float8 TP+SP x FSDP2 + FP8 all-gather, eager": ("float8", False),
    "float8 TP+SP x FSDP2 + FP8 all-gather, compiled": ("float8", True),
    "float8 TP+SP x FSDP2 + FP8 all-gather, compiled, scale at each gather": ("float8, no precompute", True),
}


def _mesh_model(kind, cfg, dev, mesh):
    """A Stack of TP+SP blocks (bf16 Megatron-style, or float8.ops with the FP8 weight all-gather),
    FSDP2-sharded over mesh["dp"], fp32 masters, AdamW; and what runs after each optimizer step."""
    import float8.fsdp as f8fsdp

    d, heads, kv, hd, ffn, blocks = (cfg[k] for k in ("d", "heads", "kv", "hd", "ffn", "blocks"))
    tp = mesh["tp"].get_group()
    torch.manual_seed(0)
    after_step = lambda: None  # noqa: E731
    with torch.device(dev):
        if kind == "bf16":
            model = Stack([TPBlockBf16(d, heads, kv, hd, ffn, tp) for _ in range(blocks)])
        else:
            model = Stack([ops_block(d, heads, kv, hd, ffn, group=tp, sp=True) for _ in range(blocks)])
            f8fsdp.enable_fp8_all_gather(model)
            if "no precompute" not in kind:
                after_step = lambda: f8fsdp.precompute_scales(model)  # noqa: E731
    return model, _shard_with_adamw(model, mesh["dp"], cfg.get("prefetch", False)), after_step


def _fsdp(
    cfg,
    rank,
    world,
    dev,
    steps,
    rounds,
    only=None,
    profile_dir=None,
    variants=None,
    build=None,
    shape=None,
    part="fsdp",
    manual_gc=False,
):
    """Every variant in `variants` (FSDP_VARIANTS by default; or those in `only`), in interleaved rounds
    (the order reversed every other round), `steps` timed whole steps each per round after a first untimed
    round of 3 (compiles, warms). `build(kind)` makes a model (default: _fsdp_model), `shape` is the
    input's (default (b, s, d)), `world` the size of the group FSDP shards over. Reported: the median step
    of each variant and the medians over rounds of its same-round ratios to the first variant (bf16 eager);
    the step peak above what is allocated before the step (the models of the other variants are alive too)
    and what the variant's model holds between steps (parameters, optimizer state, caches); every rank's
    median step and its Python garbage collections in the timed steps (a rank that stops for a full
    collection makes the others wait at its next collective). manual_gc:
    Python's collector off during each round's timed steps, a generation-1 collection before each round
    (a full collection on one rank, long with compiled models alive, stalls every rank at the next
    collective)."""
    variants = variants or FSDP_VARIANTS
    build = build or (lambda kind: _fsdp_model(kind, cfg, dev))
    shape = shape or (cfg["b"], cfg["s"], cfg["d"])
    names = [n for n in variants if only is None or n in only]
    try:
        import torchao  # noqa: F401
    except ImportError:
        names = [n for n in names if not n.startswith("torchao")]
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    x = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g)
    target = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g)
    models, results = {}, {}
    gib = 2**30

    def step_fn(name):
        kind, compiled = variants[name]
        model, opt, after_step = models[kind]
        model.__dict__["use"] = [torch.compile(b) for b in model.blocks] if compiled else None
        res = results[name]

        def step():
            opt.zero_grad(set_to_none=True)
            held = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss = F.mse_loss(model(x).float(), target.float())
            loss.backward()
            opt.step()
            after_step()
            res["peak_above_held_gib"] = max(
                res.get("peak_above_held_gib", 0.0), (torch.cuda.max_memory_allocated() - held) / gib
            )
            res["losses"].append(round(float(loss), 5))

        return step

    # Each model is built and warmed (3 untimed steps of each of its variants: compiles, optimizer state)
    # before the next: what it holds between steps is the memory it added.
    for name in names:
        kind = variants[name][0]
        if kind in models:
            continue
        of_kind = [n for n in names if variants[n][0] == kind]
        gc.collect()
        before = torch.cuda.memory_allocated()
        try:
            models[kind] = build(kind)
        except Exception as e:  # noqa: BLE001 - reported in the results, the other variants still run
            results.update({v: {"error": f"{type(e).__name__}: {e}"[:500]} for v in of_kind})
        _agree_on_errors(results, of_kind, dev)
        if kind not in models or "error" in results.get(of_kind[0], {}):
            continue
        for variant in of_kind:
            results[variant] = {"losses": [], "rounds_ms": []}
            try:
                _step_times(step_fn(variant), 3, 0)
            except Exception as e:  # noqa: BLE001
                results[variant] = {"error": f"{type(e).__name__}: {e}"[:500]}
            _agree_on_errors(results, [variant], dev)
        gc.collect()
        for variant in of_kind:
            if "error" not in results[variant]:
                results[variant]["held_gib"] = (torch.cuda.memory_allocated() - before) / gib
    live = [n for n in names if "error" not in results[n]]
    gc_counter = _GcCounter(live)  # which rank collects when: a full collection stalls the others
    for rnd in range(rounds):
        order = live if rnd % 2 == 0 else live[::-1]
        for name in order:
            if "error" in results[name]:
                continue
            try:
                # Compiled wrappers are made afresh each round: dynamo's cache (keyed on the block's code)
                # keeps the compiled graphs, so only the warm-up compiles.
                if manual_gc:  # as large-scale trainers do: no collection inside a step, gen 1 between
                    gc.collect(1)
                    gc.disable()
                gc_counter.variant = name
                results[name]["rounds_ms"].append(_step_times(step_fn(name), 1, steps))
            except Exception as e:  # noqa: BLE001
                results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            finally:
                gc_counter.variant = None
                gc.enable()
            _agree_on_errors(results, [name], dev)
    gc_counter.close()
    base_name = next((n for n in names if n.startswith("bf16") and "eager" in n), None)
    base = results.get(base_name, {}).get("rounds_ms")
    for name in live:
        r = results[name]
        if "error" in r or not r["rounds_ms"]:
            continue
        r["ms_per_step"] = _median([t for rnd in r["rounds_ms"] for t in rnd])
        if base and len(base) == len(r["rounds_ms"]):
            r["vs_bf16_eager"] = _median([_median(b) / _median(t) for b, t in zip(base, r["rounds_ms"])])
        r["all_gather_bytes_per_step"] = _all_gather_bytes(models[variants[name][0]][0], world)
        r["peak_gib"] = r["held_gib"] + r["peak_above_held_gib"]
        # Every rank's median step and its Python collections (generations 0, 1, 2) in the timed steps.
        per_rank = _per_rank([r["ms_per_step"], *gc_counter.counts[name]], dev)
        r["ms_per_step_per_rank"] = [row[0] for row in per_rank]
        r["gc_collections_per_rank"] = [[int(v) for v in row[1:]] for row in per_rank]
        if profile_dir:  # on every rank (the collectives need both); rank 0 writes
            r.update(_exposed_comm(step_fn(name), profile_dir if rank == 0 else None, name, part))
            # Every rank's exposed communication: a rank whose collectives wait long reached them first.
            per_rank = _per_rank([r["exposed_nccl_ms_per_step"], r["longest_exposed_nccl_ms"]], dev)
            r["exposed_nccl_ms_per_step_per_rank"] = [row[0] for row in per_rank]
            r["longest_exposed_nccl_ms_per_rank"] = [row[1] for row in per_rank]
    return results


class _GcCounter:
    """Python's garbage collections by generation while `variant` names one of `names` (a gc callback,
    removed by close())."""

    def __init__(self, names):
        self.counts = {n: [0, 0, 0] for n in names}
        self.variant = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase, info):
        if phase == "start" and self.variant is not None:
            self.counts[self.variant][info["generation"]] += 1

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)


def _per_rank(values, dev) -> list:
    """`values` (numbers, as many on every rank) of every rank of the default group, rank by rank."""
    mine = torch.tensor(values, dtype=torch.float64, device=dev)
    world = dist.get_world_size()
    out = torch.empty(world * mine.numel(), dtype=torch.float64, device=dev)
    dist.all_gather_into_tensor(out, mine)
    return out.view(world, -1).tolist()


def _agree_on_errors(results, names, dev) -> None:
    """A variant that failed on any rank is dropped on every rank: a rank that carried on alone would pair
    its collectives with the other ranks' next ones (mixed-up data, or a wait until the group's timeout)."""
    failed = torch.tensor([float("error" in results.get(n, {})) for n in names], device=dev)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    for n, bad in zip(names, failed.tolist()):
        if bad and "error" not in results.get(n, {}):
            results[n] = {"error": "failed on another rank"}


def _median(v):
    v = sorted(v)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def _step_times(step, n_warm, n_timed):
    for _ in range(n_warm):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(n_timed):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def _all_gather_bytes(model, world):
    """Bytes each rank receives by FSDP's weight all-gathers a step (forward, and backward's re-gather of
    the resharded blocks): 1 byte per element of FP8-gathered weights (+ a 4-byte scale), else 2 (bf16)."""
    from float8.fsdp import Float8TrainingWeight

    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        fp8 = isinstance(local, Float8TrainingWeight) or "Float8" in type(local).__name__
        total += p.numel() * (1 if fp8 else 2) + (4 * world if fp8 else 0)
    return 2 * total * (world - 1) // world


# ---- tensor + sequence parallel layer --------------------------------------------------------------------------


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, dy):
        out = dy.new_empty((dy.shape[0] // ctx.group.size(), *dy.shape[1:]))
        dist.reduce_scatter_tensor(out, dy.contiguous(), group=ctx.group)
        return out, None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((x.shape[0] // group.size(), *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, dy):
        out = dy.new_empty((ctx.group.size() * dy.shape[0], *dy.shape[1:]))
        dist.all_gather_into_tensor(out, dy.contiguous(), group=ctx.group)
        return out, None


class _SumGradsOverGroup(torch.autograd.Function):
    """Identity on parameters forward; their gradients summed over the group backward, in one all-reduce."""

    @staticmethod
    def forward(ctx, group, *params):
        ctx.group = group
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        import torch.distributed._functional_collectives as funcol

        flat = torch.cat([g.reshape(-1).float() for g in grads])
        if torch.compiler.is_compiling():
            flat = funcol.all_reduce(flat, "sum", ctx.group)
        else:
            dist.all_reduce(flat, group=ctx.group)
        parts = flat.split([g.numel() for g in grads])
        return (None, *(p.view_as(g).to(g.dtype) for p, g in zip(parts, grads)))


class TPBlockBf16(torch.nn.Module):
    """The Llama block, TP with sequence parallelism in bf16 (Megatron-style): x (S/world, B, d); the norms'
    weight gradients summed over the group (sum_norm_grads=False: each rank's own, for a test)."""

    def __init__(self, d, heads, kv, hd, ffn, group, sum_norm_grads=True):
        super().__init__()
        w = group.size()
        self.sum_norm_grads = sum_norm_grads
        self.group, self.h, self.kv, self.hd = group, heads // w, kv // w, hd
        self.norm1, self.norm2 = torch.nn.RMSNorm(d, eps=1e-6), torch.nn.RMSNorm(d, eps=1e-6)
        self.qkv = torch.nn.Linear(d, (self.h + 2 * self.kv) * hd, bias=False)
        self.o = torch.nn.Linear(self.h * hd, d, bias=False)
        self.up = torch.nn.Linear(d, 2 * ffn // w, bias=False)
        self.down = torch.nn.Linear(ffn // w, d, bias=False)

    def forward(self, x):
        s, b, _ = x.shape
        # The norms see this rank's tokens only: their weight gradients are summed over the group, one
        # all-reduce a backward, as float8's sequence-parallel norms do (the same collectives on both sides).
        w1, w2 = self.norm1.weight, self.norm2.weight
        if self.sum_norm_grads:
            w1, w2 = _SumGradsOverGroup.apply(self.group, w1, w2)
        eps = self.norm1.eps
        h = _GatherSeq.apply(F.rms_norm(x, (x.shape[-1],), w1, eps), self.group)  # (S, B, d)
        S = h.shape[0]
        q, k, v = (
            self.qkv(h)
            .view(S, b, self.h + 2 * self.kv, self.hd)
            .permute(1, 2, 0, 3)
            .split([self.h, self.kv, self.kv], dim=1)
        )
        a = (
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
            .permute(2, 0, 1, 3)
            .reshape(S, b, -1)
        )
        x = x + _ScatterSeq.apply(self.o(a), self.group)
        g, u = self.up(_GatherSeq.apply(F.rms_norm(x, (x.shape[-1],), w2, eps), self.group)).chunk(2, dim=-1)
        return x + _ScatterSeq.apply(self.down(F.silu(g) * u), self.group)


def _tp(cfg, rank, world, dev, steps, rounds, profile_dir=None, warm=5):
    from float8 import Recipe

    group = dist.new_group(list(range(world)))
    d, heads, kv, hd, ffn, s = (cfg[k] for k in ("d", "heads", "kv", "hd", "ffn", "tp_tokens"))
    torch.manual_seed(0)
    results = {}
    # Sequence-first (S/world, B=1, d) on both: each rank holds its block of one sequence.
    x = torch.randn(s // world, 1, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    eager = {
        "bf16 TP+SP": TPBlockBf16(d, heads, kv, hd, ffn, group).to(dev, torch.bfloat16),
        "float8 TP+SP": ops_block(d, heads, kv, hd, ffn, group=group, sp=True).to(dev, torch.bfloat16),
        # The default small-layer policy (Recipe.min_fp8_gemm_flops, 3e11) keeps a TP=2 shard's QKV (2.1e11
        # FLOPs) and output projection (1.4e11) in bf16; this variant runs all four GEMMs in FP8.
        "float8 TP+SP, every GEMM FP8": ops_block(
            d, heads, kv, hd, ffn, recipe=Recipe(min_fp8_gemm_flops=0), group=group, sp=True
        ).to(dev, torch.bfloat16),
        # Delayed scaling takes no amax all-reduce before each gathered cast (the step's amaxes go out in one
        # all-reduce at the end of the backward): two small collectives fewer on the forward's critical
        # path. Eager only: compile traces no training step under delayed scaling.
        "float8 TP+SP, delayed scaling": ops_block(
            d, heads, kv, hd, ffn, recipe=Recipe.delayed(), group=group, sp=True
        ).to(dev, torch.bfloat16),
    }
    # Each layer also compiled (fullgraph, the same module and parameters): the functional collectives and
    # the device-side shape check of traced code, no host work between kernels.
    layers = dict(eager)
    for name, layer in eager.items():
        if "delayed" not in name:
            layers[name + ", compiled"] = torch.compile(layer, fullgraph=True)
    # The host-bound layer (each rank's GEMMs are half the layer's) under CUDA graphs too, both sides: compile
    # mode="reduce-overhead" replays the forward's and the backward's kernels and NCCL calls as graphs.
    for name in ("bf16 TP+SP", "float8 TP+SP"):
        layers[name + ", CUDA graphs"] = torch.compile(eager[name], fullgraph=True, mode="reduce-overhead")
    steps_of = {}
    for name, layer in layers.items():

        def fwd_bwd(layer=layer, graphed="CUDA graphs" in name):
            if graphed:
                torch.compiler.cudagraph_mark_step_begin()
            layer(x).sum().backward()

        steps_of[name] = fwd_bwd
        results[name] = {"rounds_ms": []}
    for rnd in range(rounds + 1):  # interleaved; the first round warms up, untimed
        for name in list(layers) if rnd % 2 == 0 else list(layers)[::-1]:
            if "error" in results[name]:
                continue
            torch.cuda.reset_peak_memory_stats()
            try:
                times = _step_times(steps_of[name], warm if rnd == 0 else 1, steps if rnd else 0)
            except Exception as e:  # noqa: BLE001 - reported in the results, the other variants still run
                results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            _agree_on_errors(results, [name], dev)
            if rnd and "error" not in results[name]:
                results[name]["rounds_ms"].append(times)
                results[name]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30

    def ratio(base, r):
        return _median([_median(b) / _median(t) for b, t in zip(base["rounds_ms"], r["rounds_ms"])])

    for name, r in results.items():
        if "error" in r:
            continue
        r["ms_fwd_bwd"] = _median([t for rnd in r["rounds_ms"] for t in rnd])
        r["vs_bf16_tp"] = ratio(results["bf16 TP+SP"], r)
        # Against the bf16 layer run the same way (eager, compiled, CUDA graphs).
        mode = name.split(", ")[-1] if name.endswith((", compiled", ", CUDA graphs")) else ""
        same = results.get("bf16 TP+SP" + (f", {mode}" if mode else ""), {})
        if "rounds_ms" in same:
            r["vs_bf16_same_mode"] = ratio(same, r)
    for name, layer in layers.items():
        fwd_bwd = steps_of[name]
        # On every rank (the layer's collectives need all of them); rank 0 writes.
        if profile_dir and "error" not in results[name]:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fwd_bwd()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
            if rank == 0:
                with open(os.path.join(profile_dir, "profile_tp.txt"), "a") as f:
                    f.write(f"## {name}: 3 forward+backward\n{table}\n")
    return results


def _async_tp(cfg, rank, world, dev, n=20):
    """Asynchronous TP, measured before it is built: torch's symmetric-memory ops that pipeline a collective
    with an FP8 GEMM by blocks of rows (fused_all_gather_scaled_matmul, fused_scaled_matmul_reduce_scatter)
    against the collective then the GEMM, at the TP layer's shapes (tp_tokens rows; the column-parallel QKV
    and gate/up, the row-parallel output and down projections of this rank's shard). Per shape: ms of
    each (CUDA events, mean of n after 3 warm calls) and whether the results are equal."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    group = dist.group.WORLD
    enable_symm_mem_for_group(group.group_name)
    e4m3 = torch.float8_e4m3fn
    m, d, ffn, hd = cfg["tp_tokens"], cfg["d"], cfg["ffn"], cfg["hd"]
    qkv = (cfg["heads"] + 2 * cfg["kv"]) * hd // world
    sa, sb = torch.tensor(0.02, device=dev), torch.tensor(0.01, device=dev)

    def fp8(shape, seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        return (torch.randn(shape, device=dev, generator=g) * 0.5).to(e4m3)

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / n

    def mm(a, w):
        return torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)

    results = {}
    for name, n_local in (("qkv", qkv), ("gate/up", 2 * ffn // world)):
        shard, w = fp8((m // world, d), 100 + rank), fp8((n_local, d), 7 + rank)

        def sequential(shard=shard, w=w):
            return mm(funcol.all_gather_tensor(shard.view(torch.uint8), 0, group).wait().view(e4m3), w)

        def fused(shard=shard, w=w):
            return torch.ops.symm_mem.fused_all_gather_scaled_matmul(
                shard, [w.t()], sa, [sb], 0, group.group_name, [None], [None], [torch.bfloat16], [True]
            )[1][0]

        results[f"all-gather + GEMM, {name}"] = (sequential, fused)
    for name, k_local in (("output", cfg["heads"] * hd // world), ("down", ffn // world)):
        a, w = fp8((m, k_local), 200 + rank), fp8((d, k_local), 9 + rank)

        def sequential(a=a, w=w):
            return funcol.reduce_scatter_tensor(mm(a, w), "sum", 0, group).wait()

        def fused(a=a, w=w):
            return torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
                a, w.t(), sa, sb, "sum", 0, 0, group.group_name, [m, d], None, None, torch.bfloat16, True
            )

        results[f"GEMM + reduce-scatter, {name}"] = (sequential, fused)
    out = {}
    for name, (sequential, fused) in results.items():
        try:
            equal = torch.equal(sequential(), fused())
            out[name] = {"sequential_ms": timed(sequential), "fused_ms": timed(fused), "equal": equal}
            out[name]["fused_speedup"] = out[name]["sequential_ms"] / out[name]["fused_ms"]
        except Exception as e:  # noqa: BLE001 - reported; the other shapes still run
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        _agree_on_errors(out, [name], dev)
    return out


PARTS = ("fsdp", "tp", "mesh", "async_tp")  # what --only picks; each recorded as an area of its own


def _write(out, path) -> None:
    """Record each part measured so far as its area, distributed_<part>: a figure per number of each variant."""
    env = {"device": f"{out['world']}x {out['device']}", "date": out["date"], **out["versions"]}
    env["command"] = out["command"]
    for part in PARTS:
        if out.get(part):
            rows = [{"variant": name, **r} for name, r in out[part].items()]
            figures = figures_from_rows(rows, f"{part}, {out['world']} GPUs")
            detail = {k: v for k, v in out.items() if k not in PARTS} | {part: out[part]}
            area = f"distributed_{part}" + ("" if out["world"] == 2 else f"_{out['world']}gpu")
            area += "_prefetch" if out["config"].get("prefetch") and part in ("fsdp", "mesh") else ""
            record(area, path, env, figures, None, detail)


def _exposed_comm(model_step, trace_dir, name, part, steps=2):
    """Profile `steps` steps; the kernel timeline's figures per step (`timeline_figures`): NCCL kernel time and
    the part of it during which no other kernel runs (what the step waits on communication for: FSDP2's
    prefetch hides the rest behind compute), and the time no kernel runs at all (what it waits on the host
    for). The kernels' table (not the whole trace, tens of MB) goes to trace_dir/profile_<part>.txt when
    given."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model_step()
        torch.cuda.synchronize()
    kernels = [
        (e.time_range.start, e.time_range.end, "nccl" in e.name.lower())
        for e in prof.events()
        if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0
    ]
    if trace_dir:  # the kernels by CUDA time, one table per variant (a whole trace is tens of MB)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
        with open(os.path.join(trace_dir, f"profile_{part}.txt"), "a") as f:
            f.write(f"## {name}: {steps} steps\n{table}\n")
    return timeline_figures(kernels, steps)


def _union(intervals):
    merged = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def timeline_figures(kernels: "list[tuple[float, float, bool]]", steps: int) -> dict:
    """Per step, from kernels (start_us, end_us, is_nccl): NCCL kernel time; the part of it with no other
    kernel running (exposed communication); the time from the first kernel's start to the last one's end
    with no kernel running at all (the GPU waiting on the host: launches, Python, syncs); kernel count. And
    the largest exposed part of one NCCL kernel (ms): an NCCL kernel runs until every rank has joined, so
    one long exposed collective is this rank waiting for a later one."""
    import bisect

    comm = [(a, b) for a, b, nccl in kernels if nccl]
    compute = _union((a, b) for a, b, nccl in kernels if not nccl)
    starts = [a for a, _ in compute]
    exposed = longest = 0.0
    for a, b in comm:
        covered, i = 0.0, max(bisect.bisect_right(starts, a) - 1, 0)
        while i < len(compute) and compute[i][0] < b:
            covered += max(0, min(b, compute[i][1]) - max(a, compute[i][0]))
            i += 1
        exposed += (b - a) - covered
        longest = max(longest, (b - a) - covered)
    busy = _union((a, b) for a, b, _ in kernels)
    span = busy[-1][1] - busy[0][0] if busy else 0.0
    idle = span - sum(b - a for a, b in busy)
    return {
        "nccl_kernel_ms_per_step": sum(b - a for a, b in comm) / 1e3 / steps,
        "exposed_nccl_ms_per_step": exposed / 1e3 / steps,
        "gpu_idle_ms_per_step": idle / 1e3 / steps,
        "kernels_per_step": len(kernels) / steps,
        "longest_exposed_nccl_ms": longest / 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=8, help="timed whole steps per variant and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (after one untimed)")
    p.add_argument("--only", choices=PARTS, default=None)
    p.add_argument("--variants", nargs="*", default=None, help="FSDP variants to run (default: all)")
    p.add_argument(
        "--manual-gc", action="store_true", help="fsdp, mesh: no Python garbage collection inside timed steps"
    )
    p.add_argument(
        "--prefetch", action="store_true", help="fsdp, mesh: FSDP2's explicit forward prefetch of the next block"
    )
    p.add_argument(
        "--profile", action="store_true", help="NCCL time exposed per step (FSDP float8 compiled) and TP profiles"
    )
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    folder = str(results_dir(args.out))
    os.makedirs(folder, exist_ok=True)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=3))  # a stuck collective raises
    dev = torch.device("cuda", rank)
    cfg = dict(d=4096, heads=32, kv=8, hd=128, ffn=14336, blocks=8, b=4, s=2048, tp_tokens=8192)
    if args.tiny:
        cfg = dict(d=256, heads=4, kv=2, hd=64, ffn=512, blocks=2, b=2, s=128, tp_tokens=512)
    cfg["prefetch"] = args.prefetch
    versions = {"torch": torch.__version__}
    for mod in ("triton", "torchao"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    out = {
        "config": cfg,
        "world": world,
        "device": torch.cuda.get_device_name(),
        "versions": versions,
        "date": time.strftime("%Y-%m-%d"),
        "command": f"torchrun --nproc_per_node {world} -m benchmarks.distributed " + " ".join(sys.argv[1:]),
        "fsdp": {},
        "tp": {},
    }
    if args.only in (None, "fsdp"):
        out["fsdp"] = _fsdp(
            cfg,
            rank,
            world,
            dev,
            args.steps,
            args.rounds,
            args.variants,
            folder if args.profile else None,
            manual_gc=args.manual_gc,
        )
        if rank == 0:
            for name, r in out["fsdp"].items():
                print(name, {k: v for k, v in r.items() if k not in ("losses", "rounds_ms")}, flush=True)
            _write(out, args.out)
    if args.only in (None, "tp"):
        out["tp"] = _tp(cfg, rank, world, dev, 10, args.rounds, folder if args.profile else None)
        if rank == 0:
            print(out["tp"], flush=True)
    if args.only in (None, "async_tp"):
        out["async_tp"] = _async_tp(cfg, rank, world, dev)
        if rank == 0:
            print(out["async_tp"], flush=True)
    if args.only in (None, "mesh") and world >= 4 and world % 2 == 0:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        out["mesh"] = _fsdp(
            cfg,
            rank,
            world // 2,
            dev,
            args.steps,
            args.rounds,
            variants=MESH_VARIANTS,
            build=lambda kind: _mesh_model(kind, cfg, dev, mesh),
            shape=(cfg["tp_tokens"] // 2, 1, cfg["d"]),
            only=args.variants,
            profile_dir=folder if args.profile else None,
            part="mesh",
            manual_gc=args.manual_gc,
        )
        if rank == 0:
            for name, r in out["mesh"].items():
                print(name, {k: v for k, v in r.items() if k not in ("losses", "rounds_ms")}, flush=True)
    if rank == 0:
        _write(out, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
