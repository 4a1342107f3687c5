"""DTensor of Float8Tensors on 2 gloo ranks: distribute_tensor, redistribute (Shard <-> Replicate, even,
uneven and empty shards) and to_local keep the FP8 bytes and the values (float8/collectives.py)."""

import pytest
import torch

from tests.distributed.harness import run_ranks

TIMEOUT_S = 120  # every run ends: the harness kills both ranks after this, and fails the test

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _dtensor_cases(rank, world):

    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    except ImportError:  # torch < 2.5 kept it private
        from torch.distributed._tensor import DTensor, Replicate, Shard, distribute_tensor

    from float8 import Float8Tensor, RowwiseScaling

    mesh = init_device_mesh("cpu", (world,))
    q = Float8Tensor.quantize
    g = torch.Generator().manual_seed(7)
    checked = []

    def same_values(a, b):
        assert isinstance(a, Float8Tensor), type(a)
        assert torch.equal(a.dequantize(), b.dequantize())

    for rows, scaling in [(16, None), (17, None), (1, None), (16, RowwiseScaling())]:
        full = q(torch.randn(rows, 32, generator=g), scaling=scaling)  # the same on every rank
        d = distribute_tensor(full, mesh, [Shard(0)])
        local = d.to_local()
        start = min(rows, -(-rows // world) * rank)
        same_values(local, full[start : start + local.shape[0]])
        assert local.fp8_data.dtype == torch.float8_e4m3fn  # FP8 bytes, not a dequantized copy
        back = d.redistribute(mesh, [Replicate()]).to_local()
        same_values(back, full)
        if scaling is None:
            assert back.scale_inv.dim() == 0  # one scale again: FP8 GEMMs read it directly
        same_values(d.full_tensor(), full)
        checked.append(rows)
    # columns
    full = q(torch.randn(8, 64, generator=g))
    cols = distribute_tensor(full, mesh, [Shard(1)])
    same_values(cols.to_local(), full[:, 32 * rank : 32 * (rank + 1)])
    same_values(cols.redistribute(mesh, [Replicate()]).to_local(), full)
    # shards quantized on their own ranks, with their own scales: each rank's block keeps its scale
    mine = q(torch.randn(8, 32, generator=torch.Generator().manual_seed(rank)) * (rank + 1))
    gathered = DTensor.from_local(mine, mesh, [Shard(0)]).redistribute(mesh, [Replicate()]).to_local()
    expected = torch.cat(
        [q(torch.randn(8, 32, generator=torch.Generator().manual_seed(r)) * (r + 1)).dequantize() for r in range(world)]
    )
    assert torch.equal(gathered.dequantize(), expected)
    return checked


def test_dtensor_keeps_fp8_bytes_and_values():
    assert run_ranks(_dtensor_cases, timeout=TIMEOUT_S) == [[16, 17, 1, 16]] * 2
