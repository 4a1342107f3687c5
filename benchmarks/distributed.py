"""2-GPU benchmarks (torchrun, NCCL): FSDP2 training of a Llama-style model and a tensor/sequence-parallel
transformer layer, FP8 (float8) against bf16 and torchao, measured in one run.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 -m benchmarks.distributed --out results.json [--tiny]

fsdp: 8 blocks (d=4096, 32 heads and 8 KV heads of 128, SwiGLU FFN 14336), 4x2048 tokens per GPU, fp32
    master parameters, MixedPrecisionPolicy(bf16, fp32), AdamW; FSDP2 per block and at the root. Variants:
    bf16 eager; float8.ops with FP8 all-gather (eager); torchao tensorwise + FP8 all-gather + compiled
    blocks (if torchao imports). Whole steps (zero_grad, forward, backward, optimizer step, scale
    precompute) timed with CUDA events; peak memory; all-gather bytes per step of the weights.
tp: one transformer layer, TP=2 with sequence parallelism, 8192 tokens: float8.ops (Linear(parallel=...,
    sequence_parallel=True)) against the same layer in bf16 PyTorch with Megatron-style collectives.
Public APIs only. --tiny shrinks every size (a CPU-free smoke of the plumbing on any 2 GPUs).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


# ---- the bf16 model in plain PyTorch (also torchao's input) ------------------------------------------------


class Block(torch.nn.Module):
    """A Llama block: attention (grouped KV heads, causal SDPA) and a SwiGLU MLP, pre-norm residuals."""

    def __init__(self, d, heads, kv_heads, head_dim, ffn):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, head_dim
        self.norm1, self.norm2 = torch.nn.RMSNorm(d, eps=1e-6), torch.nn.RMSNorm(d, eps=1e-6)
        self.qkv = torch.nn.Linear(d, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o = torch.nn.Linear(heads * head_dim, d, bias=False)
        self.up = torch.nn.Linear(d, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, d, bias=False)

    def forward(self, x):  # x: (B, S, d)
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, self.h + 2 * self.kv, self.hd).transpose(1, 2).split([self.h, self.kv, self.kv], dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o(a)
        g, u = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def ops_block(d, heads, kv_heads, head_dim, ffn, recipe=None, **tp):
    """The same block from float8.ops (tp: group=..., sp=...: the tensor-parallel layer)."""
    import float8.ops as ops

    group, sp = tp.get("group"), tp.get("sp", False)
    world = group.size() if group is not None else 1
    par = {"column": {}, "row": {}} if group is None else {
        "column": {"parallel": "column", "tp_group": group, "sequence_parallel": sp},
        "row": {"parallel": "row", "tp_group": group, "sequence_parallel": sp},
    }  # fmt: skip
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


def _timed_steps(step, n_warm, n_timed):
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
    times.sort()
    return times[len(times) // 2]


# ---- FSDP2 ---------------------------------------------------------------------------------------------------


def _fsdp_variant(name, cfg, rank, world, dev, steps, warm):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    d, heads, kv, hd, ffn, blocks, b, s = (cfg[k] for k in ("d", "heads", "kv", "hd", "ffn", "blocks", "b", "s"))
    torch.manual_seed(0)
    after_step = lambda: None  # noqa: E731
    with torch.device(dev):  # built whole on the GPU (7 GiB of fp32 for 8 blocks), then sharded
        if name.startswith("float8"):
            model = torch.nn.Sequential(*[ops_block(d, heads, kv, hd, ffn) for _ in range(blocks)])
        else:
            model = torch.nn.Sequential(*[Block(d, heads, kv, hd, ffn) for _ in range(blocks)])
    if name.startswith("float8, FP8 all-gather"):
        import float8.fsdp as f8fsdp

        f8fsdp.enable_fp8_all_gather(model)
        after_step = lambda: f8fsdp.precompute_scales(model)  # noqa: E731
    if name.startswith("torchao"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        after_step = lambda: precompute_float8_dynamic_scale_for_fsdp(model)  # noqa: E731
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if "compile" in name:
        for i, blk in enumerate(model):
            model[i] = torch.compile(blk)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    x = torch.randn(b, s, d, device=dev, dtype=torch.bfloat16, generator=g)
    target = torch.randn(b, s, d, device=dev, dtype=torch.bfloat16, generator=g)
    losses, allocated, fwd_peak = [], [], []

    checkpoints = {1, 10, 25, 49}  # steps after which garbage is collected and memory read (not timed: the median ignores them)

    def step():
        opt.zero_grad(set_to_none=True)
        if len(losses) == warm + steps - 1:
            gc.collect()  # the last step's peak, from a collected heap
        torch.cuda.reset_peak_memory_stats()
        out = model(x)
        fwd_peak.append(torch.cuda.max_memory_allocated())
        loss = F.mse_loss(out.float(), target.float())
        del out
        loss.backward()
        opt.step()
        after_step()
        losses.append(loss.detach())
        if len(losses) in checkpoints:
            gc.collect()
            allocated.append((len(losses), torch.cuda.memory_allocated()))

    gib = 2**30
    gc.collect()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = _timed_steps(step, warm, steps)
    peak = torch.cuda.max_memory_allocated()  # of the last step (each step resets it)
    result = {
        "ms_per_step": ms, "peak_gib": peak / gib, "losses": [float(v) for v in losses],
        "params_gib": before / gib, "end_of_forward_peak_gib": max(fwd_peak) / gib,
        # (step, allocated after it): flat from the first step on when nothing outlives its use.
        "allocated_after_step_gib": [(n, a / gib) for n, a in allocated],
        "all_gather_bytes_per_step": _all_gather_bytes(model, world),
    }  # fmt: skip
    del opt, model
    return result


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


class TPBlockBf16(torch.nn.Module):
    """The Llama block, TP with sequence parallelism in bf16 (Megatron-style): x (S/world, B, d)."""

    def __init__(self, d, heads, kv, hd, ffn, group):
        super().__init__()
        w = group.size()
        self.group, self.h, self.kv, self.hd = group, heads // w, kv // w, hd
        self.norm1, self.norm2 = torch.nn.RMSNorm(d, eps=1e-6), torch.nn.RMSNorm(d, eps=1e-6)
        self.qkv = torch.nn.Linear(d, (self.h + 2 * self.kv) * hd, bias=False)
        self.o = torch.nn.Linear(self.h * hd, d, bias=False)
        self.up = torch.nn.Linear(d, 2 * ffn // w, bias=False)
        self.down = torch.nn.Linear(ffn // w, d, bias=False)

    def forward(self, x):
        s, b, _ = x.shape
        h = _GatherSeq.apply(self.norm1(x), self.group)  # (S, B, d)
        S = h.shape[0]
        q, k, v = self.qkv(h).view(S, b, self.h + 2 * self.kv, self.hd).permute(1, 2, 0, 3).split([self.h, self.kv, self.kv], dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h).permute(2, 0, 1, 3).reshape(S, b, -1)
        x = x + _ScatterSeq.apply(self.o(a), self.group)
        g, u = self.up(_GatherSeq.apply(self.norm2(x), self.group)).chunk(2, dim=-1)
        return x + _ScatterSeq.apply(self.down(F.silu(g) * u), self.group)


def _tp(cfg, rank, world, dev, steps, warm, profile_dir=None):
    from float8 import Recipe

    group = dist.new_group(list(range(world)))
    d, heads, kv, hd, ffn, s = (cfg[k] for k in ("d", "heads", "kv", "hd", "ffn", "tp_tokens"))
    torch.manual_seed(0)
    results = {}
    # Sequence-first (S/world, B=1, d) on both: each rank holds its block of one sequence.
    x = torch.randn(s // world, 1, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    layers = {
        "bf16 TP+SP": TPBlockBf16(d, heads, kv, hd, ffn, group).to(dev, torch.bfloat16),
        "float8 TP+SP": ops_block(d, heads, kv, hd, ffn, group=group, sp=True).to(dev, torch.bfloat16),
        # The default small-layer policy (Recipe.min_fp8_gemm_flops, 3e11) keeps a TP=2 shard's QKV (2.1e11
        # FLOPs) and output projection (1.4e11) in bf16; this variant runs all four GEMMs in FP8.
        "float8 TP+SP, every GEMM FP8": ops_block(
            d, heads, kv, hd, ffn, recipe=Recipe(min_fp8_gemm_flops=0), group=group, sp=True
        ).to(dev, torch.bfloat16),
    }
    for name, layer in layers.items():
        def fwd_bwd():
            layer(x).sum().backward()

        torch.cuda.reset_peak_memory_stats()
        results[name] = {"ms_fwd_bwd": _timed_steps(fwd_bwd, warm, steps), "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        if profile_dir:  # on every rank (the layer's collectives need all of them); rank 0 writes
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fwd_bwd()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
            if rank == 0:
              with open(os.path.join(profile_dir, f"profile_tp_{name.split()[0]}{'_all_fp8' if 'every' in name else ''}.txt"), "w") as f:
                  f.write(table)
    return results


def _write(out, path) -> None:
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=47, help="timed steps after 3 warm-up ones (50 in all)")
    p.add_argument("--only", choices=["fsdp", "tp"], default=None)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=3))  # a stuck collective raises
    dev = torch.device("cuda", rank)
    cfg = dict(d=4096, heads=32, kv=8, hd=128, ffn=14336, blocks=8, b=4, s=2048, tp_tokens=8192)
    if args.tiny:
        cfg = dict(d=256, heads=4, kv=2, hd=64, ffn=512, blocks=2, b=2, s=128, tp_tokens=512)
    out = {"config": cfg, "world": world, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "fsdp": {}, "tp": {}}  # fmt: skip
    if args.only in (None, "fsdp"):
        variants = ["bf16 eager", "float8, FP8 all-gather"]
        try:
            import torchao  # noqa: F401

            variants.append("torchao tensorwise + FP8 all-gather + compile")
        except ImportError:
            pass
        for name in variants:
            try:
                out["fsdp"][name] = _fsdp_variant(name, cfg, rank, world, dev, args.steps, 3)
            except Exception as e:  # noqa: BLE001 - reported in the results, the other variants still run
                out["fsdp"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            gc.collect()  # FSDP modules hold reference cycles: free the variant's memory before the next one
            torch.cuda.empty_cache()
            if rank == 0:
                brief = {k: v for k, v in out["fsdp"][name].items() if k not in ("losses", "allocated_after_step_gib")}
                print(name, brief, flush=True)
                _write(out, args.out)
    if args.only in (None, "tp"):
        out["tp"] = _tp(cfg, rank, world, dev, 20, 5, os.path.dirname(os.path.abspath(args.out)))
        if rank == 0:
            print(out["tp"], flush=True)
    if rank == 0:
        _write(out, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
