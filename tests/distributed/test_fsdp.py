"""FSDP2 (fully_shard) of float8.ops models on 2 gloo ranks: high-precision and FP8 weight all-gather (even,
uneven and empty shards, reshard_after_forward True and False) with FP8 compute, single ops and Sequentials
sharded, training that tracks the one-process run; and DDP of an ops model."""

import copy

import pytest
import torch

from tests.distributed.harness import run_ranks

TIMEOUT_S = 120  # every run ends: the harness kills both ranks after this, and fails the test

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
STEPS = 3


def _model():
    import float8.ops as ops
    from float8 import Recipe

    torch.manual_seed(0)

    def block():
        return ops.Sequential(
            ops.RMSNorm(64), ops.Linear(64, 128), ops.GELU(), ops.Linear(128, 64), recipe=Recipe.rowwise()
        )

    return ops.Sequential(block(), block())  # blocks are Sequentials: FSDP2 shards them one by one


def _train(model, batches, rank=None, world=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x in batches:
        if rank is not None:
            x = x.chunk(world)[rank]
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _batches(rows=16):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(rows, 64, generator=g) for _ in range(STEPS)]


def _fsdp(rank, world):
    from torch.distributed.fsdp import fully_shard

    import float8.ops as ops

    model = _model()
    x = _batches()[0]
    single = _model()
    # Row-wise input scaling: a row's scale is its own, so sharding the batch changes no forward bit.
    with torch.no_grad():
        expected = single(x).chunk(world)[rank]
    for block in model:
        fully_shard(block)
    fully_shard(model)
    with torch.no_grad():
        assert torch.equal(model(x.chunk(world)[rank]), expected)
    _train(model, _batches(), rank, world)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    for one in (ops.Linear(64, 32), ops.RMSNorm(64)):  # single ops shard too
        fully_shard(one)
        one(torch.randn(4, 64)).float().sum().backward()
    # An op sharded inside a Sequential: it carries FSDP's hooks, so the Sequential runs it alone, through
    # its own call (ops/sequential.py: ops with hooks are a fusion boundary), and the hooks gather its weight.
    torch.manual_seed(0)
    inner = ops.Sequential(ops.Linear(64, 32))
    ref = copy.deepcopy(inner)
    fully_shard(inner[0])
    x = torch.linspace(-1, 1, 4 * 64).reshape(4, 64)  # the same on every rank
    assert torch.equal(inner(x), ref(x))
    return {n: t.detach() for n, t in full.items()}


def test_fsdp2_trains_like_one_process():
    from tests.tolerances import SQNR_DB, sqnr_db

    sharded = run_ranks(_fsdp, timeout=TIMEOUT_S)
    single = _model()
    _train(single, _batches())
    for name, p in single.named_parameters():
        assert torch.equal(sharded[0][name], sharded[1][name])  # every rank holds the same model
        # Each rank's loss is the mean over its half of the batch and FSDP averages the gradients: the same
        # update as one process on the whole batch, up to FP8 rounding of the transposed (column-wise) scales.
        assert sqnr_db(p.detach(), sharded[0][name]) >= SQNR_DB["grad"], name


def _fp8_model(hidden=128):
    import float8.ops as ops
    from float8 import Recipe, RowwiseScaling, TensorwiseScaling

    torch.manual_seed(0)
    # Row-wise inputs and gradients (local to their rows), a per-tensor weight: the forward is the same
    # arithmetic sharded or not, so its bits can be compared.
    recipe = Recipe(input=RowwiseScaling(), weight=TensorwiseScaling(), grad=RowwiseScaling())

    def block():
        return ops.Sequential(
            ops.RMSNorm(64), ops.Linear(64, hidden), ops.GELU(), ops.Linear(hidden, 64), recipe=recipe
        )

    return ops.Sequential(block(), block())


def _fsdp_fp8(rank, world, hidden=128, reshard=True):
    from torch.distributed.fsdp import fully_shard

    import float8.fsdp as f8fsdp

    model = _fp8_model(hidden)
    wrapped = f8fsdp.enable_fp8_all_gather(model)
    assert len(wrapped) == 4, wrapped
    for block in model:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    shard = model[0][1].weight.to_local()
    bits, meta = shard.fsdp_pre_all_gather(model[0][1].weight.device_mesh)
    assert bits[0].dtype == torch.uint8 and bits[0].numel() == shard.numel()  # 1 byte per element on the wire

    single = _fp8_model(hidden)
    x = _batches()[0]
    with torch.no_grad():
        expected = single(x).chunk(world)[rank]
        assert torch.equal(model(x.chunk(world)[rank]), expected)  # FP8-gathered weights: the same bits

    seen = []
    lin = model[0][1]
    run_linear = lin.op_forward  # a Sequential runs op_forward, not forward (no module hooks): watch it

    def watched(ctx, x, out_request=None, bias=None):
        seen.append(type(lin.weight).__name__)
        return run_linear(ctx, x, out_request, bias)

    lin.op_forward = watched
    losses = []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for step, batch in enumerate(_batches()):
        if step:
            assert f8fsdp.precompute_scales(model) == 4
        loss = model(batch.chunk(world)[rank]).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert seen and all(name == "Float8Tensor" for name in seen), seen  # the Linear computed with FP8 weights
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}


def _count_all_reduces():
    """A dispatch mode counting the all-reduces run under it (`.count`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountAllReduces(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += "allreduce" in str(func) or "all_reduce" in str(func)
            return func(*args, **(kwargs or {}))

    return CountAllReduces()


def _forward_with_and_without_precomputed_scales(model, x):
    """(all-reduces of a forward after precompute_scales, whether it equals the forward without them)."""
    import float8.fsdp as f8fsdp

    f8fsdp.precompute_scales(model)
    with torch.no_grad():
        counter = _count_all_reduces()
        with counter:
            got = model(x)
        for p in model.parameters():
            local = getattr(p, "_local_tensor", p)
            if isinstance(local, f8fsdp.Float8TrainingWeight):
                local.precomputed_scale = None
        return counter.count, torch.equal(got, model(x))


def _precomputed_scales_used(rank, world):
    from torch.distributed.fsdp import fully_shard

    import float8.fsdp as f8fsdp

    model = _fp8_model(128)  # row-wise inputs and gradients: no amax all-reduce but the weights'
    n_weights = len(f8fsdp.enable_fp8_all_gather(model))
    for block in model:
        fully_shard(block, reshard_after_forward=True)  # two gathers a step: forward, backward's re-gather
    fully_shard(model, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = _batches()[0].chunk(world)[rank]

    def step(scales):
        counter = _count_all_reduces()
        with counter:
            loss = model(x).float().pow(2).mean()
            loss.backward()
        opt.step()  # writes every master: the precomputed scales are dropped
        opt.zero_grad()
        if scales:
            assert f8fsdp.precompute_scales(model) == 4
        return counter.count, float(loss)

    step(scales=True)
    used, loss_precomputed = step(scales=False)  # gathers with the scales precomputed after the last step
    recomputed, _ = step(scales=False)  # none precomputed: each gather (forward, backward's re-gather) reduces
    assert used == 0 and recomputed == 2 * n_weights > 0, (used, recomputed)
    # A precomputed scale is the one the gather would compute: the same bits.
    step(scales=False)
    assert _forward_with_and_without_precomputed_scales(model, x) == (0, True)
    return loss_precomputed


def test_precomputed_scales_replace_the_all_reduce_of_every_gather():
    """precompute_scales set each scale on a wrapper that DTensor.to_local() had just made, so FSDP never saw
    it: every gather all-reduced its weight's amax again. Now the gathers after it all-reduce nothing."""
    losses = run_ranks(_precomputed_scales_used, timeout=TIMEOUT_S)
    assert all(torch.isfinite(torch.tensor(losses))), losses


def _alias_writes_drop_the_scale(rank, world):
    from torch.distributed.fsdp import fully_shard

    import float8.fsdp as f8fsdp

    model = _fp8_model(128)
    f8fsdp.enable_fp8_all_gather(model)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    x = _batches()[0].chunk(world)[rank]
    model(x).float().pow(2).mean().backward()  # FSDP's lazy init
    weights = [p for p in model.parameters() if isinstance(p._local_tensor, f8fsdp.Float8TrainingWeight)]
    writes = {
        "p.data.mul_": lambda: [p.data.mul_(3) for p in weights],
        "p.detach().mul_": lambda: [p.detach().mul_(3) for p in weights],
        "p.to_local().mul_": lambda: [p.to_local().mul_(3) for p in weights],
        "p[:].mul_": lambda: [p[:].mul_(3) for p in weights],
        "state_dict()[k].mul_": lambda: [v.mul_(3) for k, v in model.state_dict().items() if "1.weight" in k],
    }
    stale = []
    for name, write in writes.items():
        assert f8fsdp.precompute_scales(model) == 4
        with torch.no_grad():
            write()  # each a new wrapper of the master: the write did not reach the scale's own
            got = model(x)
            for p in weights:
                p._local_tensor.precomputed_scale = None
            if not torch.equal(got, model(x)):
                stale.append(name)
    return stale


def test_a_write_through_an_alias_of_a_weight_drops_its_precomputed_scale():
    """Writes through .data, detach(), to_local(), a view or a state dict's entry each go through a new
    wrapper of the master; they used to leave the scale precomputed for the master in place, and the next
    gather quantized the grown weights with it (saturated, silently)."""
    for stale in run_ranks(_alias_writes_drop_the_scale, timeout=TIMEOUT_S):
        assert stale == [], stale


def _in_place_after_a_block(rank, world, in_place):
    from torch.distributed.fsdp import fully_shard

    class TwoBlocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = _model()

        def forward(self, x):
            h = self.blocks[0](x)
            if in_place:
                h += 1.0  # a residual-style write into the block's output
            else:
                h = h + 1.0
            return self.blocks[1](h)

    model = TwoBlocks()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    x = _batches()[0].chunk(world)[rank]
    model(x).float().pow(2).mean().backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}


def test_an_in_place_write_into_a_sharded_blocks_output_trains_like_an_out_of_place_one():
    """A Sequential returned a view of its Function's output (ViewBackward0); FSDP2 registers its
    pre-backward hook on the output, and an in-place write into that view dropped it: the backward ran
    on resharded weights and failed in the allocator ("Caffe2 uses a lazy allocation")."""
    in_place = run_ranks(_in_place_after_a_block, timeout=TIMEOUT_S, args=(True,))
    out_of_place = run_ranks(_in_place_after_a_block, timeout=TIMEOUT_S, args=(False,))
    for name, grad in out_of_place[0].items():
        assert torch.equal(in_place[0][name], grad), name


# hidden=127: the first Linear's 127 rows shard 64/63 and the second's 64 rows of 127 columns evenly;
# hidden=1: a (1, 64) weight leaves rank 1 an empty shard. reshard_after_forward=False keeps the gathered
# FP8 weights from forward to backward.
@pytest.mark.parametrize("hidden, reshard", [(128, True), (128, False), (127, True), (1, True)])
def test_fsdp2_fp8_all_gather_trains_like_one_process(hidden, reshard):
    from tests.tolerances import SQNR_DB, sqnr_db

    sharded = run_ranks(_fsdp_fp8, timeout=TIMEOUT_S, args=(hidden, reshard))
    single = _fp8_model(hidden)
    _train(single, _batches())
    for name, p in single.named_parameters():
        a, b = sharded[0][name], sharded[1][name]
        a, b = getattr(a, "master", a), getattr(b, "master", b)
        assert torch.equal(a, b)
        assert sqnr_db(p.detach(), a) >= SQNR_DB["grad"], name


def _ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_model())
    _train(model, _batches(), rank, world)
    return {n.removeprefix("module."): p.detach() for n, p in model.named_parameters()}


def test_ddp_trains_like_one_process():
    from tests.tolerances import SQNR_DB, sqnr_db

    ddp = run_ranks(_ddp, timeout=TIMEOUT_S)
    single = _model()
    _train(single, _batches())
    for name, p in single.named_parameters():
        assert torch.equal(ddp[0][name], ddp[1][name]), name  # DDP's all-reduce keeps the replicas equal
        assert sqnr_db(p.detach(), ddp[0][name]) >= SQNR_DB["grad"], name


def _fsdp_fp8_resume(rank, world, directory):
    """Train an FSDP2 model with the FP8 all-gather, save it with torch.save and with DCP, load both into a
    freshly built model: `torch.load(weights_only=True)` and `dcp.load` accept the state (they refused
    "Unsupported global: float8.fsdp.Float8TrainingWeight"), and the resumed model gives the same outputs."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    import float8.fsdp as f8fsdp

    def build():
        model = _fp8_model()
        f8fsdp.enable_fp8_all_gather(model)
        for block in model:
            fully_shard(block)
        fully_shard(model)
        return model

    model = build()
    _train(model, _batches(), rank, world)
    x = torch.linspace(-1, 1, 8 * 64).reshape(8, 64)
    with torch.no_grad():
        want = model(x)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    resumed = build()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    dcp.save(model.state_dict(), checkpoint_id=directory)
    from_dcp = build()
    state = from_dcp.state_dict()
    dcp.load(state, checkpoint_id=directory)
    from_dcp.load_state_dict(state)
    wrapped = [p.to_local() for p in from_dcp.parameters() if isinstance(p.to_local(), f8fsdp.Float8TrainingWeight)]
    with torch.no_grad():
        assert not torch.equal(build()(x), want)  # a fresh model differs: the loads below carry the training
        assert torch.equal(resumed(x), want)
        assert torch.equal(from_dcp(x), want)
    assert len(wrapped) == 4  # still gathered as FP8 after the load
    return True


def test_fsdp2_fp8_all_gather_resumes_from_torch_save_and_dcp(tmp_path):
    assert run_ranks(_fsdp_fp8_resume, timeout=TIMEOUT_S, args=(str(tmp_path / "dcp"),)) == [True, True]


# ---- the user path: a plain torch.nn model, converted, FP8-gathered, compiled per block -----------------------


ROWS = 32  # 16 tokens a rank: the lone Linear's eager path takes multiples of 16 (ops/linear_train.py)


class _PlainBlock(torch.nn.Module):
    """A pre-norm SwiGLU block written in plain torch.nn, as users write them (ops.convert swaps its Linears)."""

    def __init__(self, d=64, ffn=96):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d, eps=1e-6)
        self.up = torch.nn.Linear(d, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        g, u = self.up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(g) * u)


def _converted_model(fuse_swiglu=True):
    import float8.ops as ops

    torch.manual_seed(0)
    model = torch.nn.Sequential(_PlainBlock(), _PlainBlock())
    ops.convert(model, fuse_swiglu=fuse_swiglu)
    if fuse_swiglu:  # these outputs are far below the fusion's size threshold
        from float8.ops.swiglu_fusion import swiglu_fusion_of

        swiglu_fusion_of(model).min_numel = 1
    return model


def _fsdp_converted(rank, world, compiled, fuse_swiglu=False, mixed=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import float8.fsdp as f8fsdp

    model = _converted_model(fuse_swiglu)
    assert len(f8fsdp.enable_fp8_all_gather(model)) == 4
    # mixed: bf16 compute on fp32 masters, as users train (benchmarks/distributed.py)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    kw = {"mp_policy": mp} if mixed else {}
    for block in model:
        fully_shard(block, **kw)  # reshard after forward: backward all-gathers the FP8 weights again
    fully_shard(model, **kw)
    nodes = []
    if compiled:
        for i, block in enumerate(model):
            model[i] = torch.compile(block, backend="aot_eager", fullgraph=True)
    else:  # which path each eager Linear ran (ops/linear_train.py's node, or the op runner's)
        for block in model:
            for lin in (block.up, block.down):
                lin.register_forward_hook(lambda m, i, out: nodes.append(type(out.grad_fn).__name__))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in _batches(ROWS):
        opt.zero_grad()
        loss = model(batch.chunk(world)[rank]).float().pow(2).mean()
        loss.backward()
        opt.step()
        f8fsdp.precompute_scales(model)
        losses.append(float(loss))
    if fuse_swiglu:  # each block's SwiGLU ran fused under FSDP2
        from float8.ops.swiglu_fusion import swiglu_fusion_of

        assert swiglu_fusion_of(model).last_forward == {"fused": 2}
    if mixed and not compiled:
        # Eager bf16 Linears take the gathered FP8 weights on the lone Linear's path (ops/linear_train.py);
        # they took the op runner before. float32 activations take the op runner (which warns).
        assert nodes == ["_TrainLinearBackward"] * 4 * STEPS, nodes
    return losses, {n.replace("_orig_mod.", ""): p.full_tensor().detach() for n, p in model.named_parameters()}


def test_converted_model_fp8_all_gather_compiled_per_block_trains_like_eager():
    """The README's FSDP2 recipe on a converted plain-torch.nn model, each block compiled: its backward
    re-gathers the FP8 weights into the same parameter. The scale used to be written in place there, which
    failed the compiled backward's version check ("modified by an inplace operation"). Bit for bit against
    eager without ops.convert's SwiGLU fusion (compiled code computes torch's own SwiGLU backward); the
    default eager model, fused, within the gradient tolerance of the single-process one."""
    from tests.tolerances import SQNR_DB, sqnr_db

    eager = run_ranks(_fsdp_converted, timeout=TIMEOUT_S, args=(False,))
    compiled = run_ranks(_fsdp_converted, timeout=TIMEOUT_S, args=(True,))
    fused = run_ranks(_fsdp_converted, timeout=TIMEOUT_S, args=(False, True))
    for rank in range(2):
        assert compiled[rank][0] == eager[rank][0], (compiled[rank][0], eager[rank][0])
    single = _converted_model()
    opt = torch.optim.AdamW(single.parameters(), lr=1e-2)
    for batch in _batches(ROWS):
        opt.zero_grad()
        single(batch).float().pow(2).mean().backward()
        opt.step()
    for name, p in single.named_parameters():
        got = compiled[0][1][name]
        got = getattr(got, "master", got)
        assert torch.equal(got, getattr(eager[0][1][name], "master", eager[0][1][name])), name
        assert sqnr_db(p.detach(), got) >= SQNR_DB["grad"], name
        got_fused = fused[0][1][name]
        assert sqnr_db(p.detach(), getattr(got_fused, "master", got_fused)) >= SQNR_DB["grad"], name


def test_eager_fp8_all_gather_steps_take_the_lone_linear_path_with_the_general_paths_bits():
    """bf16 compute on fp32 masters: eager Linears run ops/linear_train.py's path on the gathered FP8 weights
    (re-gathered into the same storage for the backward), and give the bits of the op runner's path, which
    the compiled blocks run (losses and every master after three AdamW steps)."""
    eager = run_ranks(_fsdp_converted, timeout=TIMEOUT_S, args=(False, False, True))
    compiled = run_ranks(_fsdp_converted, timeout=TIMEOUT_S, args=(True, False, True))
    for rank in range(2):
        assert compiled[rank][0] == eager[rank][0], (compiled[rank][0], eager[rank][0])
        for name, got in compiled[rank][1].items():
            want = eager[rank][1][name]
            assert torch.equal(getattr(got, "master", got), getattr(want, "master", want)), name


def _hsdp_fp8(rank, world):
    """HSDP: a (replicate=2, shard=2) mesh over 4 ranks, weights gathered as FP8 inside each shard group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import float8.fsdp as f8fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _fp8_model(128)
    f8fsdp.enable_fp8_all_gather(model)
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = _batches()[0]
    with torch.no_grad():  # row-wise inputs: sharding the batch changes no forward bit
        assert torch.equal(model(x.chunk(world)[rank]), _fp8_model(128)(x).chunk(world)[rank])
    _train(model, _batches(), rank, world)
    assert f8fsdp.precompute_scales(model) == 4  # one scale per weight, agreed over both mesh dims
    # The gathers use them (no all-reduce), and they are the scales each gather would take itself.
    assert _forward_with_and_without_precomputed_scales(model, x.chunk(world)[rank]) == (0, True)
    return {n: getattr(p.full_tensor(), "master", p.full_tensor()).detach() for n, p in model.named_parameters()}


def test_hsdp_2d_mesh_fp8_all_gather_trains_like_one_process():
    """HSDP with the FP8 all-gather failed in its first forward: a 2-D mesh has no single group for the
    amax all-reduce ('Found the DeviceMesh have 2 dimensions'); the amax is now reduced over every mesh dim."""
    from tests.tolerances import SQNR_DB, sqnr_db

    results = run_ranks(_hsdp_fp8, world=4, timeout=TIMEOUT_S)
    single = _fp8_model(128)
    _train(single, _batches())
    for name, p in single.named_parameters():
        for r in results[1:]:
            assert torch.equal(results[0][name], r[name]), name
        assert sqnr_db(p.detach(), results[0][name]) >= SQNR_DB["grad"], name


def test_the_pre_all_gather_hook_keeps_its_own_signature_for_fsdp():
    # FSDP2 calls inspect.signature on the bound hook before every all-gather and passes five arguments when
    # it counts five parameters. The hook keeps its signature on the function (float8/fsdp.py), so inspect
    # does not rebuild it each time; it must be the function's own.
    import inspect

    from float8.fsdp import Float8TrainingWeight

    fn = Float8TrainingWeight.fsdp_pre_all_gather
    assert "__signature__" in fn.__dict__
    code = fn.__code__
    assert list(fn.__signature__.parameters) == list(code.co_varnames[: code.co_argcount])
    w = Float8TrainingWeight(torch.randn(4, 4), torch.float8_e4m3fn)
    assert list(inspect.signature(w.fsdp_pre_all_gather).parameters) == [
        "mesh",
        "outer_size",
        "outer_stride",
        "module",
        "mp_policy",
    ]
