"""One scale across a group (2 gloo ranks): quantizers with an amax group reduce their amax (MAX), and a
Sequential's delayed-scaling amaxes of one step go out in one all-reduce."""

import pytest
import torch

from tests.distributed.harness import run_ranks

TIMEOUT_S = 120  # every run ends: the harness kills both ranks after this, and fails the test

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _delayed_sequential(rank, world):
    from unittest import mock

    import torch.distributed as dist

    import float8.ops as ops
    import float8.quantizer as quantizer
    from float8 import DelayedScalingState, Recipe

    torch.manual_seed(0)  # the same weights on every rank
    seq = ops.Sequential(
        ops.RMSNorm(32),
        ops.Linear(32, 64),
        ops.GELU(),
        ops.Linear(64, 32),
        recipe=Recipe.delayed(),
        amax_group=dist.group.WORLD,
    )
    opt = torch.optim.SGD(seq.parameters(), lr=0.01)
    calls = []
    real = quantizer.all_reduce_amax

    def counted(amax, group):
        calls.append(amax.numel())
        return real(amax, group)

    per_step = []
    with mock.patch.object(quantizer, "all_reduce_amax", counted):
        for step in range(4):
            before = len(calls)
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank)) * (rank + 1)
            seq(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            per_step.append(len(calls) - before)
    states = [m for m in seq.modules() if isinstance(m, DelayedScalingState)]
    assert len(states) == 6
    return per_step, [s.scale.clone() for s in states], [s.amax_history.clone() for s in states]


def test_delayed_amaxes_one_all_reduce_per_step_and_one_scale_everywhere():
    (steps0, scales0, hist0), (steps1, scales1, hist1) = run_ranks(_delayed_sequential, timeout=TIMEOUT_S)
    # Step 1 has no history: current scaling, each amax reduced before its cast. Then one all-reduce a step.
    assert steps0 == steps1 and steps0[1:] == [1, 1, 1], steps0
    for a, b in zip(scales0 + hist0, scales1 + hist1):
        assert torch.equal(a, b)  # every rank holds the same scales and histories
    assert all(h[0] > 0 for h in hist0)


def _current_with_group(rank, world):
    import torch.distributed as dist

    import float8.ops as ops

    torch.manual_seed(0)
    seq = ops.Sequential(ops.RMSNorm(32), ops.Linear(32, 32, bias=False), amax_group=dist.group.WORLD)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank)) * (1 + 9 * rank)
    with torch.no_grad():
        y = seq(x)
    # The norm wrote high precision and the grouped quantizer cast it with the global amax: both ranks'
    # inputs carry the same scale, so rank 0's output equals the one-process computation under that scale.
    return y


def test_current_scaling_with_a_group_uses_the_global_amax():
    import float8.ops as ops
    from float8 import Float8Tensor

    y0, y1 = run_ranks(_current_with_group, timeout=TIMEOUT_S)
    torch.manual_seed(0)
    seq = ops.Sequential(ops.RMSNorm(32), ops.Linear(32, 32, bias=False))
    xs = [torch.randn(4, 32, generator=torch.Generator().manual_seed(r)) * (1 + 9 * r) for r in range(2)]
    with torch.no_grad():
        h = torch.cat([seq[0](x) for x in xs])
        expected = Float8Tensor.quantize(h) @ Float8Tensor.quantize(seq[1].weight).t()
    assert torch.equal(torch.cat([y0, y1]), expected)
