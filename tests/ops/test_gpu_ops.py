"""GPU tier of the ops: fused blocks on CUDA against unfused and against float64, and a compiled step."""

import copy

import pytest
import torch

import float8.ops as ops
from float8 import Recipe
from tests.tolerances import SQNR_DB, sqnr_db

# These blocks are small: without this, the small-layer policy would (rightly) keep them in bf16.
ALWAYS_FP8 = Recipe(min_fp8_gemm_flops=0)

pytestmark = pytest.mark.gpu


def mlp(d=1024, f=2048):
    return ops.Sequential(
        ops.RMSNorm(d), ops.Linear(d, 2 * f, bias=False), ops.SwiGLU(), ops.Linear(f, d, bias=False), recipe=ALWAYS_FP8
    )


def layer_norm_mlp(d=1024, f=4096):
    return ops.Sequential(ops.LayerNorm(d), ops.Linear(d, f), ops.GELU(), ops.Linear(f, d), recipe=ALWAYS_FP8)


def run(model, x, dy):
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(dy)
    return [y, x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("make", [mlp, layer_norm_mlp], ids=["rms_swiglu", "ln_gelu_bias"])
def test_fused_block_on_cuda_against_unfused_and_fp64(make):
    torch.manual_seed(0)
    model = make().cuda().to(torch.bfloat16)
    unfused = copy.deepcopy(model)
    unfused.fuse = False
    x = torch.randn(4, 1000, model[0].weight.shape[0], device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x) * 0.1
    fused_out, unfused_out = run(model, x, dy), run(unfused, x, dy)
    for a, b in zip(fused_out, unfused_out):
        assert sqnr_db(b, a) >= 25, "fused and unfused FP8 paths agree to FP8 rounding"
    # Against float64 high precision of the same weights: the SQNR table.
    ref = copy.deepcopy(model).double()
    xd = x.double().requires_grad_(True)
    y = _hp_forward(ref, xd)
    y.backward(dy.double())
    assert sqnr_db(y, fused_out[0]) >= SQNR_DB["linear"]
    assert sqnr_db(xd.grad, fused_out[1]) >= SQNR_DB["grad"]


def _hp_forward(seq, x):
    import torch.nn.functional as F

    for op in seq:
        if isinstance(op, ops.RMSNorm):
            x = F.rms_norm(x, (x.shape[-1],), op.weight, op.eps)
        elif isinstance(op, ops.LayerNorm):
            x = F.layer_norm(x, (x.shape[-1],), op.weight, op.bias, op.eps)
        elif isinstance(op, ops.Linear):
            x = F.linear(x, op.weight, op.bias)
        elif isinstance(op, ops.SwiGLU):
            a, b = x.chunk(2, -1)
            x = F.silu(a) * b
        elif isinstance(op, ops.GELU):
            x = F.gelu(x)
    return x


def test_transformer_layer_on_cuda_trains():
    from tests.ops.test_training import transformer_layer

    torch.manual_seed(0)
    model = transformer_layer()
    for op in model:
        op.set_recipe(ALWAYS_FP8, overwrite=True)
    model = model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    x = torch.randn(8, 64, 64, device="cuda", dtype=torch.bfloat16)
    target = torch.randn_like(x, dtype=torch.float32) * 0.1
    losses = []
    for _ in range(50):
        loss = torch.nn.functional.mse_loss(model(x).float(), target + x.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_small_layer_policy_runs_plain_bf16_on_cuda():
    torch.manual_seed(0)
    lin = ops.Linear(256, 256).cuda().to(torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    assert not lin.runs_in_fp8(64, x.device)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    big = ops.Linear(4096, 4096, recipe=Recipe()).cuda().to(torch.bfloat16)
    assert big.runs_in_fp8(16384, x.device)


def test_small_layer_sequential_runs_torch_functions_on_cuda():
    # No Linear of the run big enough for FP8: the run is torch's own functions (ops/runner.py
    # _runs_as_torch), so the bits of F.linear / F.rms_norm / F.gelu, forward and backward.
    from float8.ops.runner import _runs_as_torch

    torch.manual_seed(0)
    seq = ops.Sequential(ops.Linear(256, 256), ops.RMSNorm(256), ops.GELU(), ops.Linear(256, 128, bias=False))
    seq = seq.cuda().to(torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flat = [o for op in seq for o in op.expand()]
    assert _runs_as_torch(flat, x)
    F = torch.nn.functional
    runs = []
    for fn in (
        seq,
        lambda x: F.linear(
            F.gelu(F.rms_norm(F.linear(x, seq[0].weight, seq[0].bias), (256,), seq[1].weight, seq[1].eps)),
            seq[3].weight,
        ),
    ):
        y = fn(x)
        y.float().square().sum().backward()
        runs.append([y.detach(), x.grad] + [p.grad for p in seq.parameters()])
        x.grad = None
        seq.zero_grad(set_to_none=True)
    for got, want in zip(*runs):
        assert torch.equal(got, want)
    # One Linear that runs FP8 (its own recipe) makes the whole run ours: FP8 where it pays, fused.
    seq[3].set_recipe(ALWAYS_FP8, overwrite=True)
    assert not _runs_as_torch(flat, x)
    assert not torch.equal(seq(x), runs[0][0])


def test_small_layer_run_conditions_on_cuda():
    # A small block with attention runs torch's functions too; lean activations keep the run ours (their
    # FP8 saved inputs); a small block with attention compiled gives what its eager run gives, within
    # inductor's own rounding of the torch functions.
    from benchmarks.distributed import ops_block
    from float8.ops.runner import _runs_as_torch
    from tests.tolerances import sqnr_db

    torch.manual_seed(0)
    block = ops_block(256, 4, 2, 64, 512).cuda().to(torch.bfloat16)
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    flat = [o for op in block for o in op.expand()]
    assert _runs_as_torch(flat, x.reshape(-1, 256))
    lean = ops_block(256, 4, 2, 64, 512, recipe=Recipe(lean_activations=True)).cuda().to(torch.bfloat16)
    assert not _runs_as_torch([o for op in lean for o in op.expand()], x.reshape(-1, 256))
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    assert sqnr_db(block(x), compiled(x)) >= 35


@pytest.mark.parametrize(
    "make", [lambda: mlp(256, 512), lambda: ops.Linear(256, 512, bias=True, recipe=ALWAYS_FP8)], ids=["mlp", "linear"]
)
def test_cuda_graphed_training_steps_equal_eager_ones(make):
    # torch.cuda.make_graphed_callables captures forward and backward once; each replay must quantize the
    # weight of *that* step (the eager FP8-weight cache is keyed by a version counter a replay cannot
    # check). Same kernels, same order: the graphed steps give the eager steps' bits.
    torch.manual_seed(0)
    eager = make().cuda().to(torch.bfloat16)
    graphed_model = copy.deepcopy(eager)
    x0 = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(graphed_model, (x0,))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, graphed_model)]
    outs = []
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)  # the same input every step
    for step in range(3):
        dy = torch.randn(64, 512 if isinstance(eager, ops.Linear) else 256, device="cuda", dtype=torch.bfloat16)
        got = []
        for model, fn, opt in ((eager, eager, opts[0]), (graphed_model, graphed, opts[1])):
            # set_to_none: a graphed backward hands out its static gradient buffers, which AccumulateGrad
            # adopts as .grad; zeroing them in place and accumulating again would count the step twice.
            opt.zero_grad(set_to_none=True)
            xi = x.detach().clone().requires_grad_(True)
            y = fn(xi)
            y.backward(dy)
            got.append([y.detach().clone(), xi.grad.clone()] + [p.grad.clone() for p in model.parameters()])
            opt.step()
        names = ["y", "x.grad"] + [f"{n}.grad" for n, _ in eager.named_parameters()]
        for a, b, name in zip(*got, names):
            assert torch.equal(a, b), f"step {step}: graphed replay differs from eager in {name}"
        outs.append(got[1][0])
        for pe, pg in zip(eager.parameters(), graphed_model.parameters()):
            assert torch.equal(pe, pg)
    # Same input, moved weights: a graph that kept the first step's FP8 weight would repeat its output.
    assert not torch.equal(outs[0], outs[2]), "the weights moved, so the outputs for the same input must too"
