"""FP8 across processes: Float8Tensors through collectives, one scale across ranks, and FSDP2 training with
the weights all-gathered as FP8.

    torchrun --nproc_per_node 2 examples/distributed_fsdp2.py      # gloo on the CPU (tiny), or NCCL on 2 GPUs
    python examples/distributed_fsdp2.py                            # starts the torchrun above itself

The FSDP2 part all-gathers the weights as FP8 on both backends (measured on two H200s: README,
"Distributed").
"""

import datetime
import os
import subprocess
import sys

import torch


def relaunch() -> int:
    """Without torchrun's environment: run this file under torchrun with 2 processes (what a test does)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
    return subprocess.run(cmd, timeout=600).returncode


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import float8.fsdp
    import float8.ops as ops
    from float8 import Float8Tensor, Recipe, RowwiseScaling, TensorwiseQuantizer, TensorwiseScaling

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    rank = int(os.environ["RANK"])
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=2))  # never hangs
    world = dist.get_world_size()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    say = print if rank == 0 else (lambda *a, **k: None)

    # 1. Collectives move FP8 bytes and the scale-inverse: 1 byte per element instead of 2 (bf16).
    x = torch.randn(256, 512, device=device, dtype=torch.bfloat16) * (rank + 1)
    shared = TensorwiseQuantizer(amax_group=dist.group.WORLD).quantize(x)  # one scale across the ranks
    gathered = Float8Tensor.quantize(torch.zeros(256 * world, 512, device=device, dtype=torch.bfloat16))
    dist.all_gather_into_tensor(gathered, shared)
    say(
        f"all_gather_into_tensor: {gathered.fp8_data.numel()} FP8 bytes + one scale, "
        f"against {2 * gathered.numel()} bytes of bf16; values equal: "
        f"{torch.equal(gathered.dequantize()[:256], shared.dequantize())}"
    )

    # 2. FSDP2: blocks sharded, weights all-gathered as FP8 (CPU), FP8 GEMMs, AdamW, one scale all-reduce a step.
    recipe = Recipe(input=RowwiseScaling(), weight=TensorwiseScaling(), grad=RowwiseScaling(), min_fp8_gemm_flops=0)
    torch.manual_seed(0)
    model = ops.Sequential(
        *[
            ops.Sequential(ops.RMSNorm(128), ops.Linear(128, 256), ops.GELU(), ops.Linear(256, 128), recipe=recipe)
            for _ in range(2)
        ]
    )
    say(f"FP8 all-gather for {float8.fsdp.enable_fp8_all_gather(model)}")
    model.to(device)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(5):
        batch = torch.randn(32, 128, generator=g).to(device)
        loss = model(batch).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        float8.fsdp.precompute_scales(model)
        say(f"step {step}: loss {loss.item():.5f}")
    dist.barrier()  # no rank tears the group down while another still talks to it
    dist.destroy_process_group()
    say("done")


if __name__ == "__main__":
    if "RANK" not in os.environ:
        sys.exit(relaunch())
    main()
    # Leave without running C++ static destructors: after destroy_process_group, 2 of 16 runs of this
    # script aborted at interpreter exit with torch 2.13's gloo ("terminate called without an active
    # exception", a background thread still joinable), after all the work above had finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
