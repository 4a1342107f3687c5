"""Tensor and sequence parallelism in the ops API on 2 gloo ranks (4 for TP x FSDP2 on a 2-D mesh): column- and row-parallel Linears and a
Megatron-style MLP block as one Sequential, against the unsharded layer."""

import pytest
import torch

from tests.distributed.harness import run_ranks

TIMEOUT_S = 120  # every run ends: the harness kills both ranks after this, and fails the test

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
D, FFN, S, B = 64, 128, 16, 2  # hidden, FFN width, whole sequence, batch


def _recipe(kind):
    from float8 import Recipe

    return Recipe.delayed() if kind == "delayed" else Recipe()


def _unsharded(kind):
    import float8.ops as ops

    torch.manual_seed(0)
    return ops.Sequential(
        ops.Residual(),
        ops.RMSNorm(D),
        ops.Linear(D, 2 * FFN, bias=False),
        ops.SwiGLU(),
        ops.Linear(FFN, D),
        ops.AddResidual(),
        recipe=_recipe(kind),
    )


def _tp_block(group, sp: bool, kind):
    import float8.ops as ops

    return ops.Sequential(
        ops.Residual(),
        ops.RMSNorm(D, sequence_parallel_group=group if sp else None),
        ops.Linear(D, 2 * FFN, bias=False, parallel="column", tp_group=group, sequence_parallel=sp),
        ops.SwiGLU(),
        ops.Linear(FFN, D, parallel="row", tp_group=group, sequence_parallel=sp),
        ops.AddResidual(),
        recipe=_recipe(kind),
    )


def _gate_up_rows(rank, world):
    """The rows of the fused gate/up weight (2*FFN, D) rank `rank` holds: its block of the gate and its
    block of the up projection, so that SwiGLU's halves of the local output pair up."""
    n = FFN // world
    return torch.cat([torch.arange(rank * n, (rank + 1) * n), FFN + torch.arange(rank * n, (rank + 1) * n)])


def _shard_from(full, tp, rank, world):
    """Copy the unsharded block's parameters into the TP block's shards."""
    n = FFN // world
    with torch.no_grad():
        tp[1].weight.copy_(full[1].weight)
        tp[2].weight.copy_(full[2].weight[_gate_up_rows(rank, world)])
        tp[4].weight.copy_(full[4].weight[:, rank * n : (rank + 1) * n])
        tp[4].bias.copy_(full[4].bias)


def _inputs():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(S, B, D, generator=g).to(torch.bfloat16) for _ in range(3)]


def _run_tp(rank, world, sp, kind):
    from unittest import mock

    import torch.distributed as dist

    import float8.row_collectives as rc
    from float8 import Float8Tensor

    group = dist.new_group(list(range(world)))
    full, tp = _unsharded(kind), _tp_block(group, sp, kind)
    _shard_from(full, tp, rank, world)
    moved, gathered_fp8 = [], []
    real_gather, real_rows = rc._all_gather_single, rc.gather_rows

    def counted_gather(out, inp, group=None, async_op=False):
        moved.append(inp.numel() * inp.element_size())
        return real_gather(out, inp, group=group, async_op=async_op)

    def watched_rows(x, group, **kw):
        gathered_fp8.append(isinstance(x, Float8Tensor) or x.dtype == torch.uint8)  # FP8, or its bits
        return real_rows(x, group, **kw)

    import float8.ops.parallel as parallel

    with (
        mock.patch.object(rc, "_all_gather_single", counted_gather),
        mock.patch.object(parallel, "gather_rows", watched_rows),
    ):
        # Sequence-first: with sequence parallelism each rank holds a block of the sequence.
        outs, dxs = _train(tp, [x.chunk(world)[rank] if sp else x for x in _inputs()])
    params = {n: p.detach().clone() for n, p in tp.named_parameters()}
    return {"y": outs, "dx": dxs, "params": params, "moved": moved, "gathered_fp8": gathered_fp8}


def _train(model, inputs):
    """SGD steps on the mean of y**2 over the whole batch (on every layout); the outputs and input grads."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    outs, dxs = [], []
    for x in inputs:
        x = x.detach().requires_grad_()
        y = model(x)
        (y.float().pow(2).sum() / (S * B * D)).backward()
        outs.append(y.detach())
        dxs.append(x.grad)
        opt.step()
        opt.zero_grad()
    return outs, dxs


def _reference(kind):
    full = _unsharded(kind)
    return (full, *_train(full, _inputs()))


def _sp_run(rank, world, kind):
    return _run_tp(rank, world, True, kind)


def _tp_run(rank, world, kind):
    return _run_tp(rank, world, False, kind)


def _close(ref, got, name, db=30.0):
    from tests.tolerances import sqnr_db

    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert sqnr_db(ref.float(), got.float()) >= db, (name, sqnr_db(ref.float(), got.float()))


def _check_against_unsharded(results, sp, kind):
    world = len(results)
    full, outs, dxs = _reference(kind)
    n = FFN // world
    for step in range(len(outs)):
        y = torch.cat([r["y"][step] for r in results]) if sp else results[0]["y"][step]
        dx = torch.cat([r["dx"][step] for r in results]) if sp else results[0]["dx"][step]
        _close(outs[step], y, f"y step {step}")
        _close(dxs[step], dx, f"dx step {step}")
        if not sp:  # every rank holds the whole activation, and the same one
            assert torch.equal(results[0]["y"][step], results[1]["y"][step])
    # After 3 SGD steps, each rank's shard tracks the unsharded layer's.
    for rank, r in enumerate(results):
        p = r["params"]
        _close(full[1].weight, p["ops.1.weight"], "norm weight")
        _close(full[2].weight[_gate_up_rows(rank, world)], p["ops.2.weight"], "column weight")
        _close(full[4].weight[:, rank * n : (rank + 1) * n], p["ops.4.weight"], "row weight")
        _close(full[4].bias, p["ops.4.bias"], "row bias")
    # Replicated parameters stay equal on every rank (their gradients are summed over the group).
    for name in ("ops.1.weight", "ops.4.bias"):
        assert torch.equal(results[0]["params"][name], results[1]["params"][name]), name


@pytest.mark.parametrize("kind", ["current", "delayed"])
def test_sequence_parallel_block_matches_unsharded(kind):
    results = run_ranks(_sp_run, timeout=TIMEOUT_S, args=(kind,))
    _check_against_unsharded(results, sp=True, kind=kind)
    for r in results:
        # The sequence-parallel all-gather moves FP8: 1 byte per element of the local (S/2, B, D) block;
        # the gradient's all-gather (backward of the reduce-scatter) is bf16. Delayed scaling also sends
        # the 4-byte scale (compared on the device: histories are kept per rank); current scaling sends
        # none (every rank derives it from the all-reduced amax).
        local = (S // 2) * B * D
        fwd = [m for m in r["moved"] if m in (local, 4)]
        scales = 3 if kind == "delayed" else 0
        assert fwd.count(local) == 3 and fwd.count(4) == scales, r["moved"]
        assert r["gathered_fp8"][0::2] == [True] * 3, r["gathered_fp8"]  # FP8 gathered


def test_tensor_parallel_block_matches_unsharded():
    results = run_ranks(_tp_run, timeout=TIMEOUT_S, args=("current",))
    _check_against_unsharded(results, sp=False, kind="current")


# ---- bad input: a clear error on every rank, never a hang or a wrong result --------------------------------


def _error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _bad_inputs(rank, world):
    import torch.distributed as dist

    import float8.ops as ops
    from float8 import Float8Tensor
    from float8.row_collectives import gather_rows

    group = dist.new_group(list(range(world)))
    out = {}
    # Ranks holding different numbers of tokens (an uneven split of the sequence).
    gather = ops.Sequential(ops.AllGather(group))
    out["shapes"] = _error_of(lambda: gather(torch.randn(4 + rank, D)))
    # As many tokens on each rank, split into sequences differently: (8, 2) and (4, 4) tokens.
    out["token dims"] = _error_of(lambda: gather(torch.randn(*((8, 2) if rank == 0 else (4, 4)), D)))
    # One rank's activation FP8, the other's high precision, of one shape: they would take different
    # collectives (a hang), so the shape check compares formats too.
    mixed = torch.randn(4, D)
    out["formats"] = _error_of(lambda: gather(mixed if rank == 0 else Float8Tensor.quantize(mixed)))
    # One rank records a backward, the other does not: the backward's collectives would wait for a rank
    # that never runs them.
    trained = ops.Sequential(ops.AllGather(group), ops.Linear(D, 8))
    with torch.set_grad_enabled(rank == 1):
        out["grad modes"] = _error_of(lambda: trained(torch.randn(4, D)))
    # Tokens that do not split over the group, the same on every rank: reduce-scatter cannot keep a block.
    out["uneven"] = _error_of(lambda: ops.Sequential(ops.ReduceScatter(group))(torch.randn(3, D)))
    # FP8 input from outside the Sequential, quantized per rank: different scales, one tensor.
    x8 = Float8Tensor.quantize(torch.randn(4, D) * (rank + 1))
    out["scales"] = _error_of(lambda: gather(x8))
    # Passed through an op into a sequence-parallel Linear (current scaling: the all-gather gathers no scale
    # for FP8 it quantized itself; FP8 it did not make has its scales compared).
    passed = ops.Sequential(
        ops.Identity(), ops.Linear(D, 2 * world, parallel="column", tp_group=group, sequence_parallel=True)
    )
    out["passed through"] = _error_of(lambda: passed(x8))
    # The same through the no-sync path (a quantizer said the scale is one): NaN, never finite wrong values.
    out["nan"] = bool(gather_rows(x8, group, one_scale=True).dequantize().isnan().all())
    same = Float8Tensor.quantize(torch.randn(4, D, generator=torch.Generator().manual_seed(0)))
    out["ok"] = torch.equal(
        gather_rows(same, group, one_scale=True).dequantize(), torch.cat([same.dequantize()] * world)
    )
    # Row-wise scales travel with their rows.
    rows8 = Float8Tensor.quantize(torch.randn(4, D) * (rank + 1), scaling=__import__("float8").RowwiseScaling())
    got = gather_rows(rows8, group)
    out["rowwise"] = got.dequantize()[4 * rank : 4 * rank + 4].equal(rows8.dequantize()) and got._scale_inv.shape == (
        8,
        1,
    )
    return out


def test_bad_input_raises_on_every_rank():
    for r in run_ranks(_bad_inputs, timeout=TIMEOUT_S):
        assert "different shapes, formats or grad modes [((4, 64), 'float32'," in r["shapes"], r["shapes"]
        assert "((5, 64), 'float32'," in r["shapes"], r["shapes"]
        assert "[((8, 2, 64), 'float32'," in r["token dims"] and "((4, 4, 64), 'float32'," in r["token dims"], r
        assert "((4, 64), 'float32'," in r["formats"] and "((4, 64), 'FP8 float8_e4m3fn'," in r["formats"], r
        assert "'no backward'), ((4, 64), 'float32', 'backward')]" in r["grad modes"], r["grad modes"]
        assert "do not split evenly over 2 ranks" in r["uneven"], r["uneven"]
        assert "scales differ" in r["scales"], r["scales"]
        assert "scales differ" in r["passed through"], r["passed through"]
        assert r["nan"] and r["ok"] and r["rowwise"], r


def test_parallel_linear_arguments_are_checked():
    import float8.ops as ops

    with pytest.raises(ValueError, match="parallel must be None, 'column' or 'row'"):
        ops.Linear(8, 8, parallel="diagonal", tp_group=object())
    with pytest.raises(ValueError, match="need parallel="):
        ops.Linear(8, 8, sequence_parallel=True)
    with pytest.raises(ValueError, match="torch.distributed initialized"):
        ops.Linear(8, 8, parallel="column")  # no process group (and none initialized here)
    with pytest.raises(ValueError, match="torch.distributed initialized"):
        ops.AllGather(None)


def _wrong_groups(rank, world):
    import torch.distributed as dist

    import float8.ops as ops

    group = dist.new_group(list(range(world)))
    out = {
        "not a group": _error_of(lambda: ops.AllReduce("tp")),
        "none": _error_of(lambda: ops.Linear(8, 8, parallel="row", tp_group=None)),
        "uneven weight": _error_of(lambda: ops.Linear(8, 7, parallel="column", tp_group=group)),
    }
    return out


def test_wrong_or_missing_group_and_uneven_weight_shards_raise():
    for r in run_ranks(_wrong_groups, timeout=TIMEOUT_S):
        assert "takes a torch.distributed ProcessGroup, got str" in r["not a group"], r
        assert "takes a torch.distributed ProcessGroup, got NoneType" in r["none"], r
        assert "out_features=7 does not split evenly over 2 ranks" in r["uneven weight"], r


SP_DIMS = dict(d=256, h=4, kv=2, hd=64, f=512, s=256)  # the sequence-parallel attention layer's sizes


def sp_attention_layer(group, world, dev, recipe):
    """An attention + MLP layer (pre-norm residuals) as one Sequential; tensor- and sequence-parallel over
    `group` when given (ops.Linear(parallel=..., sequence_parallel=True), ops.Attention(sequence_first=True)),
    else the unsharded layer."""
    import float8.ops as ops

    d, h, kv, hd, f = (SP_DIMS[k] for k in ("d", "h", "kv", "hd", "f"))
    tp = group is not None
    w = world if tp else 1
    col = {"parallel": "column", "tp_group": group, "sequence_parallel": True} if tp else {}
    row = {"parallel": "row", "tp_group": group, "sequence_parallel": True} if tp else {}
    return ops.Sequential(
        ops.Residual(),
        ops.RMSNorm(d, sequence_parallel_group=group),
        ops.Linear(d, (h + 2 * kv) * hd, bias=False, **col),
        ops.Attention(h // w, hd, num_kv_heads=kv // w, sequence_first=True),
        ops.Linear(h * hd, d, **row),
        ops.AddResidual(),
        ops.Residual(),
        ops.RMSNorm(d, sequence_parallel_group=group),
        ops.Linear(d, 2 * f, bias=False, **col),
        ops.SwiGLU(),
        ops.Linear(f, d, **row),
        ops.AddResidual(),
        recipe=recipe,
    ).to(dev)


def sp_layer_sqnr(rank, world, dev) -> dict:
    """SQNR (dB) of a sequence-parallel attention + MLP layer (ops.Linear(parallel=..., sequence_parallel=True),
    ops.Attention(sequence_first=True)) against the unsharded layer, on `dev`: output, input grad, weight grads."""
    import torch.distributed as dist

    from float8 import Recipe
    from tests.tolerances import sqnr_db

    d, h, kv, hd, f, s = (SP_DIMS[k] for k in ("d", "h", "kv", "hd", "f", "s"))
    group = dist.new_group(list(range(world)))
    recipe = Recipe(min_fp8_gemm_flops=0)

    def layer(tp):
        return sp_attention_layer(group if tp else None, world, dev, recipe)

    torch.manual_seed(0)
    full, tp = layer(False), layer(True)
    n_q, n_kv, n_f = h // world * hd, kv // world * hd, f // world
    qkv_rows = torch.cat(
        [
            torch.arange(rank * n_q, (rank + 1) * n_q),
            h * hd + torch.arange(rank * n_kv, (rank + 1) * n_kv),
            (h + kv) * hd + torch.arange(rank * n_kv, (rank + 1) * n_kv),
        ]
    )
    up_rows = torch.cat([torch.arange(rank * n_f, (rank + 1) * n_f), f + torch.arange(rank * n_f, (rank + 1) * n_f)])
    with torch.no_grad():
        for i in (1, 7):
            tp[i].weight.copy_(full[i].weight)
        tp[2].weight.copy_(full[2].weight[qkv_rows.to(dev)])
        tp[4].weight.copy_(full[4].weight[:, rank * n_q : (rank + 1) * n_q])
        tp[8].weight.copy_(full[8].weight[up_rows.to(dev)])
        tp[10].weight.copy_(full[10].weight[:, rank * n_f : (rank + 1) * n_f])
        for i in (4, 10):
            tp[i].bias.copy_(full[i].bias)
    x = torch.randn(s, 2, d, generator=torch.Generator().manual_seed(5)).to(dev, torch.bfloat16).requires_grad_()
    mine = x.detach().chunk(world)[rank].requires_grad_()
    y_full, y_tp = full(x), tp(mine)
    y_full.float().pow(2).sum().backward()
    y_tp.float().pow(2).sum().backward()
    up = up_rows.to(dev)
    return {
        "output": sqnr_db(y_full.chunk(world)[rank], y_tp),
        "input grad": sqnr_db(x.grad.chunk(world)[rank], mine.grad),
        "norm weight grad": sqnr_db(full[1].weight.grad, tp[1].weight.grad),
        "column weight grad": sqnr_db(full[8].weight.grad[up], tp[8].weight.grad),
        "row weight grad": sqnr_db(full[10].weight.grad[:, rank * n_f : (rank + 1) * n_f], tp[10].weight.grad),
        "row bias grad": sqnr_db(full[10].bias.grad, tp[10].bias.grad),
    }


# Both sides are FP8; gradients are E5M2 under scales of different extent (a shard's amax or the whole one):
# the suite's gradient tolerance (tests/tolerances.py). Measured on 2 gloo ranks: output 45.7 dB, input grad
# 37.3, weight grads 23.7-26.1.
SP_LAYER_MIN_DB = {
    "output": 30.0,
    "input grad": 25.0,
    "norm weight grad": 17.0,
    "column weight grad": 17.0,
    "row weight grad": 17.0,
    "row bias grad": 17.0,
}


def _sp_layer(rank, world):
    return sp_layer_sqnr(rank, world, torch.device("cpu"))


def test_sequence_parallel_attention_layer_matches_unsharded():
    for r in run_ranks(_sp_layer, timeout=TIMEOUT_S):
        for name, db in r.items():
            assert db >= SP_LAYER_MIN_DB[name], (name, db, r)


def tp_compiled_against_eager(rank, world, dev, backend) -> dict:
    """The sequence-parallel attention layer and a plain TP pair (column- then row-parallel, all-reduces)
    compiled with fullgraph=True against the same modules run eagerly, on `dev`: for the output, the input
    grad and each parameter's grad, (max |difference|, SQNR dB)."""
    import torch.distributed as dist

    import float8.ops as ops
    from float8 import Recipe
    from tests.tolerances import sqnr_db

    group = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    recipe = Recipe(min_fp8_gemm_flops=0)
    d, s = SP_DIMS["d"], SP_DIMS["s"]
    pair = ops.Sequential(
        ops.Linear(d, 2 * d, parallel="column", tp_group=group),
        ops.Linear(2 * d, d, parallel="row", tp_group=group),
        recipe=recipe,
    ).to(dev)
    models = {"sp layer": sp_attention_layer(group, world, dev, recipe), "tp pair": pair}
    g = torch.Generator().manual_seed(5 + rank)
    inputs = {
        "sp layer": torch.randn(s // world, 2, d, generator=g).to(dev, torch.bfloat16),  # this rank's sequence block
        "tp pair": torch.randn(2, 16, d, generator=g).to(dev, torch.bfloat16),  # replicated in real use; any will do
    }
    out = {}
    for name, model in models.items():
        model.to(torch.bfloat16)
        runs = []
        for run in (model, torch.compile(model, backend=backend, fullgraph=True)):
            model.zero_grad(set_to_none=True)
            x = inputs[name].clone().requires_grad_()
            y = run(x)
            y.float().pow(2).sum().backward()
            runs.append([y.detach(), x.grad] + [p.grad for p in model.parameters()])
        labels = ["output", "input grad"] + [f"grad {n}" for n, _ in model.named_parameters()]
        for label, a, b in zip(labels, *runs):
            out[f"{name} {label}"] = (float((a.float() - b.float()).abs().max()), sqnr_db(a, b))
    return out


def test_tensor_parallel_compiles_and_matches_eager():
    # aot_eager runs eager's kernels in the traced order: equal to the bit (collectives, residual sums and the
    # sequence-parallel gradient all-reduce included).
    for r in run_ranks(tp_compiled_against_eager, timeout=TIMEOUT_S, args=(torch.device("cpu"), "aot_eager")):
        assert len(r) == 2 * 2 + 8 + 4, sorted(r)  # output and input grad of each; 8 + 4 parameters
        for name, (diff, _) in r.items():
            assert diff == 0.0, (name, diff)


def _compiled_bad_inputs(rank, world):
    """Compiled (aot_eager, fullgraph): the sequence-parallel layer fed token dims that differ between the
    ranks with as many tokens; and an AllGather + Linear fed an FP8 input quantized on each rank alone."""
    import torch.distributed as dist

    import float8.ops as ops
    from float8 import Float8Tensor, Recipe

    group = dist.new_group(list(range(world)))
    recipe = Recipe(min_fp8_gemm_flops=0)
    d, s = SP_DIMS["d"], SP_DIMS["s"]
    layer = sp_attention_layer(group, world, torch.device("cpu"), recipe).to(torch.bfloat16)
    lead = (s // world, 2) if rank == 0 else (s // world // 2, 4)  # the same 256 tokens, split differently
    x = torch.randn(*lead, d, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    y = torch.compile(layer, backend="aot_eager", fullgraph=True)(x)
    torch.manual_seed(0)
    pair = ops.Sequential(ops.AllGather(group), ops.Linear(d, 2 * d), recipe=recipe).to(torch.bfloat16)
    x8 = Float8Tensor.quantize(torch.randn(16, d).to(torch.bfloat16) * (rank + 1))  # its own scale per rank
    with torch.no_grad():
        compiled = torch.compile(pair, backend="aot_eager", fullgraph=True)(x8)
        eager = pair(x8.dequantize())  # what the FP8 input stands for, gathered in high precision
    return {"token dims: all NaN": bool(y.isnan().all()), "fp8 input as its values": torch.equal(compiled, eager)}


def test_compiled_bad_inputs_give_nan_or_the_values():
    # Traced code cannot raise on the host: token dims that differ make the layer's output NaN (never finite
    # wrong values), and an FP8 input whose scales differ between the ranks is gathered as its values (eager
    # raises for it, naming the scales).
    for r in run_ranks(_compiled_bad_inputs, timeout=TIMEOUT_S):
        assert r == {"token dims: all NaN": True, "fp8 input as its values": True}, r


def _traced_gathers(rank, world):
    """The all-gathers (dtype, shape) dynamo records for the compiled sequence-parallel attention layer,
    forward and the backward of its autograd Functions."""
    import torch.distributed as dist

    from float8 import Recipe

    group = dist.new_group(list(range(world)))
    layer = sp_attention_layer(group, world, torch.device("cpu"), Recipe(min_fp8_gemm_flops=0)).to(torch.bfloat16)
    gathers = []

    def backend(gm, example_inputs):
        for module in gm.modules():
            for node in module.graph.nodes if hasattr(module, "graph") else ():
                if "all_gather" in str(node.target):
                    value = node.meta["example_value"]
                    gathers.append((str(value.dtype), tuple(value.shape)))
        return gm.forward

    x = torch.randn(SP_DIMS["s"] // world, 2, SP_DIMS["d"]).to(torch.bfloat16)
    torch.compile(layer, backend=backend, fullgraph=True)(x)
    return gathers


def test_compiled_layer_compares_shapes_once():
    # Compiled, the layer runs as parts split at the attention; only the first part holding a collective
    # compares the ranks' shapes (one small int64 all-gather; each part did before: three, each an NCCL call
    # of ~130 us host time on the 2-H200 machine, docs/distributed.md).
    gathers = run_ranks(_traced_gathers, timeout=TIMEOUT_S)[0]
    assert [g for g in gathers if g[0] == "torch.int64"] == [("torch.int64", (2, 11))], gathers
    rows = SP_DIMS["s"] * 2  # the whole sequence, batch 2: the FP8 rows of the QKV and MLP inputs, gathered
    assert [g for g in gathers if g[0] == "torch.uint8"] == [("torch.uint8", (rows, SP_DIMS["d"]))] * 2, gathers


def _shapes_traced(rank, world):
    import torch.distributed as dist

    import float8.row_collectives as rc
    from float8 import Float8Tensor

    group = dist.new_group(list(range(world)))

    def agree(x):
        ok = rc.shapes_agree(x, group)
        q = Float8Tensor.quantize(x.reshape(-1, x.shape[-1]))
        return rc.nan_unless(ok, x), rc.nan_unless(ok, q).dequantize()

    run = torch.compile(agree, backend="aot_eager", fullgraph=True)
    same = run(torch.ones(4, 8))
    differ = run(torch.ones(4 + rank, 8))  # rank 1 holds one more row
    return {"same": [bool(t.isfinite().all()) for t in same], "differ": [bool(t.isnan().all()) for t in differ]}


def test_traced_shape_check_turns_a_mismatch_nan():
    # Traced code cannot sync the host to raise: the ranks' shapes are compared on the device, and a mismatch
    # makes the collective's result NaN (a Float8Tensor through its scale), never a finite wrong value.
    for r in run_ranks(_shapes_traced, timeout=TIMEOUT_S):
        assert r == {"same": [True, True], "differ": [True, True]}, r


def _tp_fsdp_run(rank, world, fp8_all_gather):
    """TP x FSDP2 on a 2-D mesh (dp=2, tp=2): the sequence-parallel block's TP shards, each sharded again
    by fully_shard over the data-parallel dim; each dp rank trains on its half of the batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import float8.fsdp as f8fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank, dp_rank = mesh["tp"].get_local_rank(), mesh["dp"].get_local_rank()
    full, block = _unsharded("current"), _tp_block(mesh["tp"].get_group(), True, "current")
    _shard_from(full, block, tp_rank, 2)
    if fp8_all_gather:
        assert len(f8fsdp.enable_fp8_all_gather(block)) == 2
    fully_shard(block, mesh=mesh["dp"])
    opt = torch.optim.SGD(block.parameters(), lr=0.5)
    for x in _inputs():  # (S, B, D): this dp rank's batch column, this tp rank's block of the sequence
        x = x[:, dp_rank : dp_rank + 1].chunk(2)[tp_rank]
        # FSDP averages gradients over dp: x2 makes the step the whole batch's, as the unsharded run takes.
        (block(x).float().pow(2).sum() * 2 / (S * B * D)).backward()
        opt.step()
        opt.zero_grad()
    params = {}
    for name, p in block.named_parameters():
        whole = p.full_tensor()
        params[name] = getattr(whole, "master", whole).detach().clone()
    return {"tp_rank": tp_rank, "params": params}


@pytest.mark.parametrize("fp8_all_gather", [False, True])
def test_tensor_parallel_with_fsdp2_on_a_2d_mesh_matches_unsharded(fp8_all_gather):
    results = run_ranks(_tp_fsdp_run, world=4, timeout=TIMEOUT_S, args=(fp8_all_gather,))
    full, _, _ = _reference("current")
    n = FFN // 2
    for r in results:
        p, rank = r["params"], r["tp_rank"]
        _close(full[1].weight, p["ops.1.weight"], "norm weight")
        _close(full[2].weight[_gate_up_rows(rank, 2)], p["ops.2.weight"], "column weight")
        _close(full[4].weight[:, rank * n : (rank + 1) * n], p["ops.4.weight"], "row weight")
        _close(full[4].bias, p["ops.4.bias"], "row bias")
    # Ranks of one TP position (the two dp replicas) end with the same parameters.
    for a in results:
        for b in results:
            if a["tp_rank"] == b["tp_rank"]:
                for name in a["params"]:
                    assert torch.equal(a["params"][name], b["params"][name]), name


def _quantize_before_gather(rank, world):
    import torch.distributed as dist

    import float8.ops as ops

    group = dist.new_group(list(range(world)))

    def layer(with_quantize):
        torch.manual_seed(0)
        quantize = [ops.Quantize()] if with_quantize else []
        return ops.Sequential(
            ops.RMSNorm(D, sequence_parallel_group=group),
            *quantize,
            ops.Linear(D, 2 * world * 8, parallel="column", tp_group=group, sequence_parallel=True),
        )

    x = torch.randn(S // world, B, D, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    out = {}
    for backend in (None, "aot_eager"):
        ys = []
        for with_quantize in (False, True):
            model = layer(with_quantize)
            run = torch.compile(model, backend=backend, fullgraph=True) if backend else model
            ys.append(run(x.clone()))
        out[backend or "eager"] = torch.equal(*ys)
    return out


def test_quantize_before_a_sequence_parallel_linear_casts_once_over_the_group():
    """ops.Quantize before a sequence-parallel Linear (current scaling, different data on each rank): the
    all-gather asks it for high precision and casts over the group itself, so the layer gives the bits of
    the same layer without the Quantize, eager and compiled (not a per-rank scale the gather refuses, nor a
    second rounding)."""
    for r in run_ranks(_quantize_before_gather, timeout=TIMEOUT_S):
        assert r == {"eager": True, "aot_eager": True}, r
