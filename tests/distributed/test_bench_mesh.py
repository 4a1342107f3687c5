"""The 2-D mesh models that benchmarks.distributed measures (4 gloo ranks, dp=2 x tp=2): each builds and
trains, and float8's with precompute_scales, or with FSDP2's forward prefetch, computes what it computes without
it, to the bit."""

import pytest
import torch

from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CFG = dict(d=64, heads=4, kv=2, hd=16, ffn=128, blocks=2, b=1, s=16, tp_tokens=16)


def _losses(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.distributed import _mesh_model

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.randn(CFG["tp_tokens"] // 2, 1, CFG["d"], generator=torch.Generator().manual_seed(rank))
    out = {}
    for kind, prefetch in (("bf16", False), ("float8", False), ("float8, no precompute", False), ("float8", True)):
        # --prefetch: FSDP2's explicit forward prefetch of the next block's all-gather
        model, opt, after_step = _mesh_model(kind, dict(CFG, prefetch=prefetch), torch.device("cpu"), mesh)
        kind = kind + (", prefetch" if prefetch else "")
        out[kind] = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = model(x.to(torch.bfloat16)).float().pow(2).mean()
            loss.backward()
            opt.step()
            after_step()
            out[kind].append(float(loss))
    return out


def test_mesh_models_train_and_precomputed_scales_change_no_bit():
    for r in run_ranks(_losses, world=4, timeout=240):
        assert all(torch.isfinite(torch.tensor(v)).all() for v in r.values()), r
        assert r["bf16"][-1] < r["bf16"][0] and r["float8"][-1] < r["float8"][0], r
        assert r["float8"] == r["float8, no precompute"] == r["float8, prefetch"], r


def _per_rank_and_collections(rank, world):
    import gc

    from benchmarks.distributed import _GcCounter, _per_rank

    counter = _GcCounter(["a", "b"])
    try:
        counter.variant = "a"
        gc.collect(2)
        counter.variant = None
        gc.collect(0)  # while no variant is named: not counted
    finally:
        counter.close()
    assert counter._on_gc not in gc.callbacks
    return counter.counts, _per_rank([rank * 10.0, 1.5], torch.device("cpu"))


def test_the_benchmark_gathers_each_ranks_figures_and_counts_collections_by_variant():
    for counts, per_rank in run_ranks(_per_rank_and_collections, timeout=120):
        assert counts == {"a": [0, 0, 1], "b": [0, 0, 0]}, counts
        assert per_rank == [[0.0, 1.5], [10.0, 1.5]], per_rank
