"""The collectives, DTensor and FSDP2 FP8 all-gather on CUDA with NCCL, on 2 GPUs (the gloo tests' checks).

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 tests/distributed/nccl_smoke.py

Not collected by pytest (it needs 2 GPUs); prints one line per check and exits non-zero on a failure.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    # Every collective ends: one that waits longer than this raises instead of hanging.
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=2))
    dev = torch.device("cuda", rank)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import float8.fsdp as f8fsdp
    import float8.ops as ops
    from float8 import Float8Tensor, Recipe, RowwiseScaling, TensorwiseQuantizer, TensorwiseScaling

    q = Float8Tensor.quantize
    failures = []

    def check(name, ok):
        if rank == 0:
            print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
        if not ok:
            failures.append(name)

    def x_of(r, rows=64):
        return torch.randn(rows, 256, generator=torch.Generator().manual_seed(r)).to(dev, torch.bfloat16) * (r + 1)

    def same(a, b):
        return torch.equal(a.fp8_data.view(torch.uint8), b.fp8_data.view(torch.uint8)) and torch.equal(
            a.scale_inv, b.scale_inv
        )

    t = q(x_of(rank), with_transpose=True)
    dist.broadcast(t, src=0)
    check("broadcast", same(t, q(x_of(0))))
    outs = [q(torch.zeros(64, 256, device=dev, dtype=torch.bfloat16)) for _ in range(world)]
    dist.all_gather(outs, q(x_of(rank)))
    check("all_gather list", all(same(outs[r], q(x_of(r))) for r in range(world)))
    shared = TensorwiseQuantizer(amax_group=dist.group.WORLD).quantize(x_of(rank))
    out = q(torch.zeros(64 * world, 256, device=dev, dtype=torch.bfloat16))
    dist.all_gather_into_tensor(out, shared)
    full = torch.cat([x_of(r) for r in range(world)])
    check("all_gather_into_tensor, one scale", same(out, q(full)))
    rows = q(torch.ones(64 * world, 256, device=dev, dtype=torch.bfloat16), scaling=RowwiseScaling())
    dist.all_gather_into_tensor(rows, q(x_of(rank), scaling=RowwiseScaling()))
    check("all_gather_into_tensor, row-wise", same(rows, q(full, scaling=RowwiseScaling())))
    got = q(torch.zeros(64, 256, device=dev, dtype=torch.bfloat16))
    if rank == 0:
        dist.send(q(x_of(0)), dst=1)
    elif rank == 1:
        dist.recv(got, src=0)
    check("send/recv", rank != 1 or same(got, q(x_of(0))))
    s = q(x_of(rank))
    dist.all_reduce(s)
    # The high-precision path sums in float32, then rounds to the nominal dtype and quantizes.
    total = sum(q(x_of(r)).dequantize(torch.float32) for r in range(world)).to(torch.bfloat16)
    check("all_reduce (high precision)", same(s, q(total)))
    try:
        out = q(torch.zeros(64 * world, 256, device=dev, dtype=torch.bfloat16))
        dist.all_gather_into_tensor(out, q(x_of(rank)))
        check("different scales refused", False)
    except ValueError:
        check("different scales refused", True)

    mesh = init_device_mesh("cuda", (world,))
    whole = q(torch.randn(67, 256, generator=torch.Generator().manual_seed(9)).to(dev))
    d = distribute_tensor(whole, mesh, [Shard(0)])
    back = d.redistribute(mesh, [Replicate()]).to_local()
    check("DTensor uneven Shard -> Replicate", torch.equal(back.dequantize(), whole.dequantize()))

    recipe = Recipe(input=RowwiseScaling(), weight=TensorwiseScaling(), grad=RowwiseScaling(), min_fp8_gemm_flops=0)

    def model():
        torch.manual_seed(0)
        blocks = [
            ops.Sequential(ops.RMSNorm(256), ops.Linear(256, 512), ops.GELU(), ops.Linear(512, 256), recipe=recipe)
            for _ in range(2)
        ]
        return ops.Sequential(*blocks).to(dev)

    batch = torch.randn(64 * world, 256, generator=torch.Generator().manual_seed(3)).to(dev)
    for precompute in (False, True):
        sharded, single = model(), model()
        f8fsdp.enable_fp8_all_gather(sharded)
        for block in sharded:
            fully_shard(block)
        fully_shard(sharded)
        if not precompute:
            with torch.no_grad():
                check(
                    "FSDP2 FP8 all-gather forward == one GPU",
                    torch.equal(sharded(batch.chunk(world)[rank]), single(batch).chunk(world)[rank]),
                )
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
        single_opt = torch.optim.AdamW(single.parameters(), lr=1e-3)
        torch.cuda.reset_peak_memory_stats()
        losses = []
        for step in range(5):
            loss = sharded(batch.chunk(world)[rank]).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if precompute:
                f8fsdp.precompute_scales(sharded)
            ref = single(batch).float().pow(2).mean()
            ref.backward()
            single_opt.step()
            single_opt.zero_grad()
            losses.append((float(loss), float(ref)))
        if rank == 0:
            print(
                f"precompute={precompute} losses (rank 0 shard, one GPU whole batch):",
                [(round(a, 5), round(b, 5)) for a, b in losses],
                flush=True,
            )
        names = [n for n, _ in sharded.named_parameters()]
        params = [getattr(p.full_tensor(), "master", p.full_tensor()) for p in sharded.parameters()]
        bad = [n for n, p in zip(names, params) if not bool(torch.isfinite(p).all())]
        check(f"FSDP2 FP8 all-gather trains, AdamW (finite; precompute_scales={precompute})", not bad)

    tp_checks(rank, world, dev, check)

    if rank == 0:
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB", flush=True)
    dist.destroy_process_group()
    return 1 if failures else 0


def tp_checks(rank, world, dev, check):
    """A sequence-parallel attention + MLP layer on 2 GPUs against the unsharded layer on one GPU; the same
    layer and a TP pair compiled by inductor against eager."""
    from tests.distributed.test_tensor_parallel import SP_LAYER_MIN_DB, sp_layer_sqnr, tp_compiled_against_eager

    for name, db in sp_layer_sqnr(rank, world, dev).items():
        check(f"TP+SP layer {name} vs unsharded ({db:.1f} dB)", db >= SP_LAYER_MIN_DB[name])
    # Inductor fuses and reorders the elementwise work around our kernels (bf16 roundings move): the
    # compiled layer is held to the suite's FP8 gradient tolerance against eager, and must be finite.
    for name, (diff, db) in tp_compiled_against_eager(rank, world, dev, "inductor").items():
        check(f"TP compiled (inductor) {name} vs eager ({db:.1f} dB, max diff {diff:.3g})", db >= 17.0)


if __name__ == "__main__":
    sys.exit(main())
