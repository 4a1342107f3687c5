"""Float8Tensor through c10d collectives on 2 gloo ranks: the FP8 bytes and the scale-inverse move, mismatches
raise on every rank, and what the library does not handle raises (float8/collectives.py)."""

import pytest
import torch

from tests.distributed.harness import run_ranks

TIMEOUT_S = 120  # every run ends: the harness kills both ranks after this, and fails the test

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _x(rank, shape=(8, 32), scale=1.0):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=g) * scale * (rank + 1)


def _same(a, b):
    assert a.fp8_dtype == b.fp8_dtype and a.shape == b.shape
    assert torch.equal(a.fp8_data.view(torch.uint8), b.fp8_data.view(torch.uint8))
    assert torch.equal(a.scale_inv, b.scale_inv)


def _moving_collectives(rank, world):
    import torch.distributed as dist

    from float8 import Float8Tensor, RowwiseScaling, TensorwiseQuantizer

    q = Float8Tensor.quantize
    mine = q(_x(rank), with_transpose=True)
    theirs = [q(_x(r)) for r in range(world)]  # what every rank's tensor is, computed locally

    # broadcast: rank 0's bits and scale everywhere; the receiver's stale transpose cache is dropped
    t = q(_x(rank), with_transpose=True)
    dist.broadcast(t, src=0)
    _same(t, theirs[0])
    assert t.transpose_cache is None or torch.equal(t.transpose_cache, t.fp8_data.t().contiguous())

    # all_gather into a list: each output keeps its own rank's scale
    outs = [q(torch.zeros(8, 32)) for _ in range(world)]
    dist.all_gather(outs, mine)
    for r in range(world):
        _same(outs[r], theirs[r])

    # all_gather_into_tensor with one scale across the group
    group_q = TensorwiseQuantizer(amax_group=dist.group.WORLD)
    shared = group_q.quantize(_x(rank))
    out = q(torch.zeros(8 * world, 32))
    dist.all_gather_into_tensor(out, shared)
    full = torch.cat([_x(r) for r in range(world)])
    _same(out, q(full))  # the same bits as quantizing the whole tensor at once

    # row-wise scales travel with their rows
    rows = q(_x(rank), scaling=RowwiseScaling())
    out_rows = q(torch.ones(8 * world, 32), scaling=RowwiseScaling())
    dist.all_gather_into_tensor(out_rows, rows)
    _same(out_rows, q(full, scaling=RowwiseScaling()))

    # send / recv and isend / irecv
    if rank == 0:
        dist.send(mine, dst=1)
        dist.isend(mine, dst=1).wait()
    else:
        got = q(torch.zeros(8, 32))
        dist.recv(got, src=0)
        _same(got, theirs[0])
        got2 = q(torch.zeros(8, 32))
        dist.irecv(got2, src=0).wait()
        _same(got2, theirs[0])

    # scatter and gather
    recv = q(torch.zeros(8, 32))
    dist.scatter(recv, [q(_x(r)) for r in range(world)] if rank == 0 else None, src=0)
    _same(recv, theirs[rank])
    gathered = [q(torch.zeros(8, 32)) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, gathered, dst=0)
    if rank == 0:
        for r in range(world):
            _same(gathered[r], theirs[r])

    # all_reduce: the documented high-precision path, the same bits on every rank
    s = q(_x(rank))
    dist.all_reduce(s)
    total = sum(theirs[r].dequantize() for r in range(world))
    _same(s, q(total))
    m = q(_x(rank))
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    _same(m, q(torch.maximum(theirs[0].dequantize(), theirs[1].dequantize())))
    return True


def test_collectives_move_fp8_bytes_and_scales():
    assert run_ranks(_moving_collectives, timeout=TIMEOUT_S) == [True, True]


def _mismatches(rank, world):
    import torch.distributed as dist

    from float8 import Float8Tensor

    q = Float8Tensor.quantize
    errors = []

    def expect(exc, match, fn):
        try:
            fn()
        except exc as e:
            assert match in str(e), str(e)
            errors.append(match)
        else:
            raise AssertionError(f"no {exc.__name__} ({match})")

    # different per-tensor scales cannot share one output tensor; nothing is written before that is known
    out = q(torch.randn(8 * world, 32), with_transpose=True)
    before = out.fp8_data.clone()
    expect(ValueError, "different scales", lambda: dist.all_gather_into_tensor(out, q(_x(rank))))
    assert torch.equal(out.fp8_data.view(torch.uint8), before.view(torch.uint8))
    assert torch.equal(out.transpose_cache.view(torch.uint8), out.fp8_data.t().contiguous().view(torch.uint8))
    # a problem with one rank's own arguments raises on every rank
    wrong = q(torch.zeros(8 * world + 16 * rank, 32))
    expect(ValueError, "on rank 1, an output does not match", lambda: dist.all_gather_into_tensor(wrong, q(_x(rank))))
    base = q(_x(rank, (16, 32)))
    expect(ValueError, "part of a larger one", lambda: dist.broadcast(base[0:8], src=0))
    big = q(torch.zeros(8 * world, 32))
    expect(ValueError, "part of a larger one", lambda: dist.all_gather(list(big.chunk(world)), q(_x(rank))))
    same = q(torch.zeros(8, 32))
    expect(ValueError, "share their bits or scale", lambda: dist.all_gather([same, same.detach()], q(_x(rank))))
    tall = q(_x(rank, (32, 8)))
    expect(ValueError, "not contiguous", lambda: dist.broadcast(tall.t() if rank == 0 else q(_x(rank)), src=0))
    # shapes that do not match across ranks: every rank raises, nobody hangs
    expect(ValueError, "rank 1 holds", lambda: dist.broadcast(q(_x(rank, (8, 32 + 16 * rank))), src=0))
    # formats that do not match
    fmt = torch.float8_e4m3fn if rank == 0 else torch.float8_e5m2
    expect(
        ValueError,
        "rank 1 holds",
        lambda: dist.all_gather([q(torch.zeros(8, 32), fmt) for _ in range(world)], q(_x(rank), fmt)),
    )
    # a receiver of another shape, or a non-contiguous one, drains the payload (the sender returns) and raises
    if rank == 0:
        dist.send(q(_x(0)), dst=1)
        dist.send(q(_x(0)), dst=1)
    else:
        expect(ValueError, "recv: rank 0 sent", lambda: dist.recv(q(torch.zeros(4, 32)), src=0))
        expect(ValueError, "not contiguous", lambda: dist.recv(q(torch.zeros(32, 8)).t(), src=0))
    # mixing FP8 and plain tensors, and what is not handled
    expect(
        TypeError,
        "mixes Float8Tensors and plain",
        lambda: dist.all_gather_into_tensor(torch.zeros(8 * world, 32), q(_x(rank))),
    )
    expect(
        NotImplementedError,
        "reduce-scatter",
        lambda: dist.reduce_scatter_tensor(q(torch.zeros(8, 32)), q(_x(rank, (8 * world, 32)))),
    )
    expect(NotImplementedError, "reduce of FP8", lambda: dist.reduce(q(_x(rank)), dst=0))
    dist.barrier()  # still in step after every refusal
    return len(errors)


def test_mismatches_raise_on_every_rank_and_nothing_hangs():
    counts = run_ranks(_mismatches, timeout=TIMEOUT_S)
    assert counts[0] == counts[1] - 2 == 11  # rank 1 also saw the two refused receives


def _functional(rank, world):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc

    from float8 import Float8Tensor, RowwiseScaling

    q = Float8Tensor.quantize
    g = dist.group.WORLD
    gather_single = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor  # torch 2.11 has only the latter
    full = torch.cat([_x(r) for r in range(world)])
    # per-tensor scales differ across ranks: each rank's block of rows keeps its scale, bits untouched
    out = fc.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(q(_x(rank)), world, g.group_name))
    assert isinstance(out, Float8Tensor) and tuple(out.scale_inv.shape) == (world, 1)
    for r in range(world):
        block = out[8 * r : 8 * (r + 1)]
        _same(Float8Tensor(block.fp8_data, block.scale_inv.reshape(()), block.dtype), q(_x(r)))
    assert torch.equal(out.dequantize(), torch.cat([q(_x(r)).dequantize() for r in range(world)]))
    # the public wrapper (an AsyncCollectiveTensor around ours) and row-wise scales
    rows = gather_single(q(_x(rank), scaling=RowwiseScaling()), 0, g)
    assert torch.equal(rows.dequantize(), q(full, scaling=RowwiseScaling()).dequantize())
    b = fc.wait_tensor(torch.ops._c10d_functional.broadcast(q(_x(rank)), 0, g.group_name))
    _same(b, q(_x(0)))
    s = fc.wait_tensor(torch.ops._c10d_functional.all_reduce(q(_x(rank)), "sum", g.group_name))
    _same(s, q(sum(q(_x(r)).dequantize() for r in range(world))))

    # traced: torch.compile(fullgraph=True) of a functional all-gather of a Float8Tensor, no graph break
    def gather(x):
        return gather_single(x, 0, g).dequantize()

    compiled = torch.compile(gather, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q(_x(rank))), gather(q(_x(rank))))
    try:
        torch.ops._c10d_functional.reduce_scatter_tensor(q(_x(rank, (16, 32))), "sum", world, g.group_name)
    except NotImplementedError:
        return True
    return False


def test_functional_collectives_move_fp8_bytes_and_scales():
    assert run_ranks(_functional, timeout=TIMEOUT_S) == [True, True]
