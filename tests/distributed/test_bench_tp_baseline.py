"""The bf16 tensor-parallel layer that benchmarks.distributed measures float8 against (2 gloo ranks): its
sequence-parallel norms' weight gradients are summed over the group, as float8's are, so both sides run
the same collectives and the baseline trains what the unsharded layer trains."""

import pytest
import torch

from tests.distributed.harness import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
D, HEADS, KV, HD, FFN, S = 32, 4, 2, 8, 64, 8


def _norm_grads(rank, world, summed, backend=None):
    import torch.distributed as dist

    from benchmarks.distributed import TPBlockBf16

    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    block = TPBlockBf16(D, HEADS, KV, HD, FFN, group, sum_norm_grads=summed)
    run = torch.compile(block, backend=backend, fullgraph=True) if backend else block
    x = torch.randn(S, 1, D).chunk(world)[rank]  # this rank's block of the sequence
    run(x).square().sum().backward()
    return [block.norm1.weight.grad, block.norm2.weight.grad]


def test_norm_gradients_are_summed_over_the_group():
    summed = run_ranks(_norm_grads, timeout=120, args=(True,))
    local = run_ranks(_norm_grads, timeout=120, args=(False,))  # each rank's own tokens only
    for i in range(2):
        assert torch.equal(summed[0][i], summed[1][i])  # replicated weights stay equal on every rank
        torch.testing.assert_close(summed[0][i], local[0][i] + local[1][i], rtol=1e-5, atol=1e-5)
        assert not torch.equal(local[0][i], local[1][i])  # each rank's tokens give a different part


def test_compiled_baseline_sums_them_too():
    eager = run_ranks(_norm_grads, timeout=120, args=(True,))
    compiled = run_ranks(_norm_grads, timeout=120, args=(True, "aot_eager"))
    for rank in range(2):
        for a, b in zip(eager[rank], compiled[rank]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
