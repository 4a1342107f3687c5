"""Every op, forward and backward, against float64 references on the CPU."""

import pytest
import torch
import torch.nn.functional as F

import float8.ops as ops
from float8 import Float8Tensor, Recipe
from float8.ops.base import OpContext, RunState
from tests.tolerances import SQNR_DB, sqnr_db

pytestmark = pytest.mark.filterwarnings("ignore::float8.ops.Float8PrecisionWarning")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def q(t, fp8=E4M3):
    """The FP8 value the op computes with: quantize (per-tensor current) and dequantize, in float64."""
    return Float8Tensor.quantize(t.detach(), fp8).dequantize(torch.float32).double()


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run(op_or_seq, x, dy):
    x = x.clone().requires_grad_(True)
    y = op_or_seq(x)
    y.backward(dy)
    return y, x.grad


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(24, 64), (2, 5, 64)])
def test_linear_against_fp64(bias, shape):
    torch.manual_seed(0)
    lin = ops.Linear(64, 32, bias=bias)
    x, dy = torch.randn(*shape), torch.randn(*shape[:-1], 32)
    y, dx = run(lin, x, dy)
    assert y.shape == (*shape[:-1], 32) and dx.shape == x.shape
    x2, dy2 = x.reshape(-1, 64), dy.reshape(-1, 32)
    y_ref = q(x2) @ q(lin.weight).t() + (lin.bias.double() if bias else 0)
    assert rel_err(y.reshape(-1, 32), y_ref) < 1e-6
    # HYBRID: gradients in E5M2; dgrad and wgrad from the same FP8 bits the forward used.
    dx_ref = q(dy2, E5M2) @ q(lin.weight)
    dw_ref = q(dy2, E5M2).t() @ q(x2)
    assert rel_err(dx.reshape(-1, 64), dx_ref) < 1e-6
    assert rel_err(lin.weight.grad, dw_ref) < 1e-6
    if bias:
        assert rel_err(lin.bias.grad, dy2.double().sum(0)) < 1e-6
    # ... and close to the high-precision layer (the SQNR table)
    y_hp = x2.double() @ lin.weight.double().t()
    assert sqnr_db(y_hp, y.reshape(-1, 32) - (lin.bias if bias else 0)) >= SQNR_DB["linear"]
    assert sqnr_db(dy2.double() @ lin.weight.double(), dx.reshape(-1, 64)) >= SQNR_DB["grad"]
    assert sqnr_db(dy2.double().t() @ x2.double(), lin.weight.grad) >= SQNR_DB["grad"]


def test_linear_reference_check_can_fail():
    lin = ops.Linear(64, 32, bias=False)
    x = torch.randn(16, 64)
    y = lin(x)
    assert rel_err(y, q(x) @ q(lin.weight).t() * 1.001) > 1e-6


@pytest.mark.parametrize(
    "recipe", [Recipe.rowwise(), Recipe.delayed(), Recipe.blockwise()], ids=["rowwise", "delayed", "blockwise"]
)
def test_linear_recipes_reach_the_sqnr_floor(recipe):
    torch.manual_seed(1)
    lin = ops.Linear(128, 128, bias=False, recipe=recipe)
    x, dy = torch.randn(256, 128), torch.randn(256, 128)
    for _ in range(2):  # delayed scaling: the second step uses the first step's amax
        lin.weight.grad = None
        y, dx = run(lin, x, dy)
    assert sqnr_db(x.double() @ lin.weight.double().t(), y) >= SQNR_DB["linear"]
    assert sqnr_db(dy.double() @ lin.weight.double(), dx) >= SQNR_DB["grad"]
    assert sqnr_db(dy.double().t() @ x.double(), lin.weight.grad) >= SQNR_DB["grad"]


def test_linear_saves_fp8_and_keeps_no_weight_copy_between_training_steps():
    lin = ops.Linear(64, 32, bias=False)
    ctx = OpContext(RunState(grad=True, lead=(16,)))
    lin.op_forward(ctx, torch.randn(16, 64))
    x8 = ctx.saved.x
    # The input is kept as FP8, 1 byte per element, in the one layout the weight gradient reads
    # (column-major): no bf16 copy, and no second FP8 layout. Nothing FP8 of the trained weight: the
    # backward quantizes it again (ctx.saved.rebuild).
    assert x8.data.dtype == torch.float8_e4m3fn and x8.transpose is None
    assert x8.data.shape == (16, 64) and x8.data.mT.is_contiguous()
    assert ctx.saved.w is None and ctx.saved.rebuild[0] is lin.weight
    # The weight is trained: its FP8 copy is not kept for a later step (the optimizer changes it).
    assert lin.cached_fp8_tensors() == []
    # A frozen weight does not change: its copy is cached and reused by every step.
    lin.weight.requires_grad_(False)
    frozen = OpContext(RunState(grad=True, lead=(16,)))
    lin.op_forward(frozen, torch.randn(16, 64))
    cached = lin.cached_fp8_tensors()
    assert cached and all(isinstance(t, Float8Tensor) for t in cached)
    again = OpContext(RunState(grad=True, lead=(16,)))
    lin.op_forward(again, torch.randn(16, 64))
    assert lin.cached_fp8_tensors()[0] is cached[0]
    with torch.no_grad():
        lin.weight.mul_(0.5)  # a write bumps the version: the copy is re-made
    lin.op_forward(OpContext(RunState(grad=True, lead=(16,))), torch.randn(16, 64))
    assert lin.cached_fp8_tensors()[0] is not cached[0]


def test_replacing_the_weight_frees_its_fp8_copy():
    import gc
    import weakref

    lin = ops.Linear(64, 32, bias=False)
    with torch.no_grad():
        lin(torch.randn(4, 64))
    w8 = weakref.ref(lin.cached_fp8_tensors()[0])
    with torch.no_grad():
        lin.weight = torch.nn.Parameter(Float8Tensor.quantize(lin.weight), requires_grad=False)
    gc.collect()
    assert w8() is None and lin.cached_fp8_tensors() == []
    # Replacing .data of a high-precision weight: the stale copy is dropped at the next call.
    lin2 = ops.Linear(64, 32, bias=False)
    with torch.no_grad():
        lin2(torch.randn(4, 64))
    w8 = weakref.ref(lin2.cached_fp8_tensors()[0])
    lin2.weight.data = torch.randn(32, 64)
    lin2(torch.randn(4, 64)).sum().backward()  # a training step: no copy kept
    gc.collect()
    assert w8() is None and lin2.cached_fp8_tensors() == []


def test_no_transpose_under_no_grad_or_inference_mode():
    lin = ops.Linear(64, 32, bias=False)
    for mode in (torch.no_grad, torch.inference_mode):
        lin.refresh_fp8_weight()
        with mode():
            lin(torch.randn(8, 64))
        w8 = lin._weight_cache.w8
        assert w8.transpose_cache is None


def test_fp8_only_weight_inference():
    lin = ops.Linear(64, 32, bias=False)
    w = lin.weight.detach().clone()
    with torch.no_grad():
        lin.weight = torch.nn.Parameter(Float8Tensor.quantize(w), requires_grad=False)
    x = torch.randn(8, 64)
    with torch.inference_mode():
        y = lin(x)
    assert rel_err(y, q(x) @ q(w).t()) < 1e-6
    assert lin.weight.fp8_data.element_size() == 1


def test_linear_accepts_float8_input():
    lin = ops.Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    y = lin(Float8Tensor.quantize(x))
    assert rel_err(y, q(x) @ q(lin.weight).t()) < 1e-6


def test_linear_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"\(\.\.\., 64\).*\(8, 32\)"):
        ops.Linear(64, 16)(torch.randn(8, 32))


def _norm_ref(x, w, b, eps, rms):
    x = x.double()
    if rms:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    else:
        y = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    y = y * w.double()
    return y + b.double() if b is not None else y


@pytest.mark.parametrize("rms", [True, False], ids=["rmsnorm", "layernorm"])
def test_norms_against_fp64(rms):
    torch.manual_seed(2)
    op = ops.RMSNorm(48) if rms else ops.LayerNorm(48)
    with torch.no_grad():
        op.weight.uniform_(0.5, 1.5)
        if not rms:
            op.bias.uniform_(-0.5, 0.5)
    x, dy = torch.randn(3, 7, 48), torch.randn(3, 7, 48)
    y, dx = run(op, x, dy)
    xd = x.double().requires_grad_(True)
    wd = op.weight.detach().double().requires_grad_(True)
    bd = None if rms else op.bias.detach().double().requires_grad_(True)
    ref = _norm_ref(xd, wd, bd, op.eps, rms)
    ref.backward(dy.double())
    assert rel_err(y, ref) < 1e-5 and rel_err(dx, xd.grad) < 1e-5
    assert rel_err(op.weight.grad, wd.grad) < 1e-5
    if not rms:
        assert rel_err(op.bias.grad, bd.grad) < 1e-5


ACTS = [
    (ops.GELU(), lambda v: F.gelu(v)),
    (ops.GELU(approximate="tanh"), lambda v: F.gelu(v, approximate="tanh")),
    (ops.ReLU(), F.relu),
    (ops.SiLU(), F.silu),
    (ops.SwiGLU(), lambda v: F.silu(v[..., : v.shape[-1] // 2]) * v[..., v.shape[-1] // 2 :]),
]


@pytest.mark.parametrize("op,fn", ACTS, ids=["gelu", "gelu_tanh", "relu", "silu", "swiglu"])
def test_activations_against_fp64(op, fn):
    x = torch.randn(6, 64)
    out_features = 32 if isinstance(op, ops.SwiGLU) else 64
    dy = torch.randn(6, out_features)
    y, dx = run(op, x, dy)
    xd = x.double().requires_grad_(True)
    ref = fn(xd)
    ref.backward(dy.double())
    assert rel_err(y, ref) < 1e-5 and rel_err(dx, xd.grad) < 1e-5


def test_bias_op():
    op = ops.Bias(16)
    with torch.no_grad():
        op.bias.normal_()
    x, dy = torch.randn(5, 16), torch.randn(5, 16)
    y, dx = run(op, x, dy)
    assert torch.equal(y, x + op.bias) and torch.equal(dx, dy)
    assert rel_err(op.bias.grad, dy.double().sum(0)) < 1e-6
    with pytest.raises(ValueError, match=r"\(16,\).*\(5, 8\)"):
        op(torch.randn(5, 8))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
def test_attention_against_fp64(causal):
    torch.manual_seed(3)
    heads, kv, d, b, s = 4, 2, 8, 2, 6
    op = ops.Attention(heads, d, num_kv_heads=kv, causal=causal)
    x = torch.randn(b, s, (heads + 2 * kv) * d)
    dy = torch.randn(b, s, heads * d)
    y, dx = run(op, x, dy)
    xd = x.double().requires_grad_(True)
    qkv = xd.reshape(b, s, heads + 2 * kv, d).transpose(1, 2)
    qq, kk, vv = qkv.split([heads, kv, kv], dim=1)
    kk, vv = kk.repeat_interleave(heads // kv, 1), vv.repeat_interleave(heads // kv, 1)
    att = (qq @ kk.transpose(-1, -2)) / d**0.5
    if causal:
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    att = att.softmax(-1)
    ref = (att @ vv).transpose(1, 2).reshape(b, s, heads * d)
    ref.backward(dy.double())
    assert rel_err(y, ref) < 1e-5 and rel_err(dx, xd.grad) < 1e-5
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.Attention(6, 8, num_kv_heads=4)
    with pytest.raises(ValueError, match="needs 64 features"):
        op(torch.randn(2, 6, 32))


def test_residual_dropout_reshape_identity():
    torch.manual_seed(4)
    seq = ops.Sequential(ops.Residual(), ops.Linear(16, 16), ops.AddResidual(), ops.Identity())
    x, dy = torch.randn(4, 16), torch.randn(4, 16)
    y, dx = run(seq, x, dy)
    lin = seq[1]
    y_ref = x.double() + q(x) @ q(lin.weight).t() + lin.bias.double()
    assert rel_err(y, y_ref) < 1e-6
    assert rel_err(dx, dy.double() + q(dy, E5M2) @ q(lin.weight)) < 1e-6
    drop = ops.Dropout(p=0.5)
    yd, dxd = run(drop, torch.ones(64, 32), torch.ones(64, 32))
    assert set(yd.unique().tolist()) <= {0.0, 2.0} and torch.equal(yd, dxd)
    drop.eval()
    assert torch.equal(drop(torch.ones(4, 4)), torch.ones(4, 4))
    r = ops.Sequential(ops.Reshape((4, 8)), ops.Identity())
    y, dx = run(r, torch.randn(2, 16), torch.ones(4, 8))
    assert y.shape == (4, 8) and dx.shape == (2, 16)


def test_quantize_op():
    x = torch.randn(8, 32)
    y = ops.Quantize()(x)
    assert isinstance(y, Float8Tensor)
    seq = ops.Sequential(ops.Quantize(), ops.Linear(32, 16, bias=False))
    out = seq(x)
    assert rel_err(out, q(x) @ q(seq[1].weight).t()) < 1e-6


def test_functional_forms_match_the_ops():
    torch.manual_seed(5)
    lin = ops.Linear(32, 16)
    x = torch.randn(4, 32)
    assert torch.equal(ops.functional.linear(x, lin.weight, lin.bias), lin(x))
    w = torch.rand(32) + 0.5
    assert torch.allclose(ops.functional.rms_norm(x, w), _norm_ref(x, w, None, 1e-6, True).float(), atol=1e-5)
    assert torch.allclose(ops.functional.swiglu(x), F.silu(x[:, :16]) * x[:, 16:], atol=1e-6)
    with pytest.raises(ValueError, match="amax history"):
        ops.functional.linear(x, lin.weight, recipe=Recipe.delayed())


def test_small_layer_policy_decision():
    lin = ops.Linear(4096, 4096, bias=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not lin.runs_in_fp8(1024, cuda)  # 2*1024*4096*4096 = 3.4e10 FLOPs: host-bound, bf16 wins
    assert lin.runs_in_fp8(16384, cuda)  # 5.5e11
    assert lin.runs_in_fp8(1, cpu)  # the CPU path is always the exact FP8 one
    lin.set_recipe(Recipe(min_fp8_gemm_flops=0), overwrite=True)
    assert lin.runs_in_fp8(1, cuda)
    with pytest.raises(ValueError, match="min_fp8_gemm_flops"):
        Recipe(min_fp8_gemm_flops=-1)


def test_mixed_recipe_layouts_still_give_every_gradient():
    # Per-row gradients against a per-tensor input cannot meet in one FP8 weight-gradient GEMM.
    from float8 import RowwiseScaling

    torch.manual_seed(6)
    lin = ops.Linear(128, 128, bias=False, recipe=Recipe(grad=RowwiseScaling()))
    x, dy = torch.randn(64, 128), torch.randn(64, 128)
    y, dx = run(lin, x, dy)
    assert lin.weight.grad is not None
    assert sqnr_db(dy.double().t() @ x.double(), lin.weight.grad) >= SQNR_DB["grad"]


def test_a_high_precision_linear_asks_for_a_high_precision_gradient():
    # The small-layer policy's decision is per run: a Linear that ran in high precision must not be
    # handed an E5M2 gradient by the activation's fused backward.
    seq = ops.Sequential(ops.Linear(64, 64, bias=False), ops.GELU(), ops.Linear(64, 64, bias=False))
    from float8.ops.base import OpContext, RunState

    ctx = OpContext(RunState(grad=True, lead=(8,)))
    seq[0].op_forward(ctx, torch.randn(8, 64))
    assert seq[0].grad_request(ctx) is not None  # ran in FP8 (CPU): wants FP8
    from float8.ops.functional import LinearSaved

    ctx.saved = LinearSaved(None, None, None, torch.float32, True, True)  # a run of the high-precision path
    assert seq[0].grad_request(ctx) is None


def test_weight_data_writes_need_a_refresh_and_loads_refresh_by_themselves():
    lin = ops.Linear(32, 16, bias=False)
    x = torch.randn(4, 32)
    lin(x)
    lin.weight.data.mul_(0)  # no version bump: the cached FP8 copy is stale until refreshed
    lin.refresh_fp8_weight()
    assert lin(x).abs().max() == 0
    lin(x)
    lin.load_state_dict({"weight": torch.ones(16, 32)})
    assert torch.allclose(lin(torch.ones(1, 32)), torch.full((1, 16), 32.0))


def test_model_to_bfloat16_keeps_delayed_scaling_state_float32():
    lin = ops.Linear(32, 16, recipe=Recipe.delayed())
    lin(torch.randn(4, 32))
    lin.to(torch.bfloat16)
    states = [m for m in lin.modules() if type(m).__name__ == "DelayedScalingState"]
    assert states and all(s.scale.dtype == torch.float32 and s.amax_history.dtype == torch.float32 for s in states)
    lin(torch.randn(4, 32, dtype=torch.bfloat16))


def test_e5m2_everywhere_is_refused_up_front():
    from float8 import Format

    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        Recipe(format=Format.E5M2)


def test_functional_layer_norm_without_bias():
    x, w = torch.randn(4, 16), torch.rand(16) + 0.5
    assert torch.allclose(ops.functional.layer_norm(x, w), F.layer_norm(x, (16,), w), atol=1e-5)
