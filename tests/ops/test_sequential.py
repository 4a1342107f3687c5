"""Sequential as a container, its errors, the precision guard, and plain modules as fusion boundaries."""

import pytest
import torch

import float8.ops as ops
from float8 import DelayedScalingState, Float8Tensor, Recipe


def test_indexing_iteration_and_to():
    seq = ops.Sequential(ops.RMSNorm(32), ops.Linear(32, 16), ops.GELU())
    assert len(seq) == 3 and isinstance(seq[1], ops.Linear)
    assert [type(o) for o in seq] == [ops.RMSNorm, ops.Linear, ops.GELU]
    assert isinstance(seq[1:], ops.Sequential) and len(seq[1:]) == 2
    seq = seq.to(torch.bfloat16)
    assert seq[1].weight.dtype == torch.bfloat16
    y = seq(torch.randn(4, 32, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (4, 16)


def test_recipe_reaches_ops_without_one():
    own = Recipe.rowwise()
    seq = ops.Sequential(ops.Linear(32, 32, recipe=own), ops.Linear(32, 32), recipe=Recipe.delayed())
    assert seq[0].recipe is own and seq[1].recipe == Recipe.delayed()
    with pytest.warns(ops.Float8PrecisionWarning):
        seq(torch.randn(4, 32)).sum().backward()
    states = [m for m in seq[1].modules() if isinstance(m, DelayedScalingState)]
    assert len(states) == 3 and all(s.amax_history[0] > 0 for s in states)  # input, weight, grad
    with pytest.raises(TypeError, match="float8.Recipe"):
        ops.Sequential(ops.Linear(4, 4), recipe="tensorwise")


def test_plain_module_is_a_fusion_boundary():
    seq = ops.Sequential(ops.Linear(32, 32), torch.nn.LayerNorm(32), ops.Linear(32, 16))
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    seq.to(torch.bfloat16)
    seq(x).sum().backward()
    assert x.grad is not None and seq[1].weight.grad is not None and seq[0].weight.grad is not None


def test_construction_errors():
    with pytest.raises(TypeError, match="item 1 is a int"):
        ops.Sequential(ops.Identity(), 3)
    with pytest.raises(ValueError, match="AddResidual at item 0"):
        ops.Sequential(ops.AddResidual())
    with pytest.raises(ValueError, match="without a matching AddResidual"):
        ops.Sequential(ops.Residual(), ops.Identity())
    with pytest.raises(ValueError, match="fusion boundary"):
        ops.Sequential(ops.Residual(), torch.nn.ReLU(), ops.AddResidual())


def test_shape_errors_name_the_shapes():
    seq = ops.Sequential(ops.RMSNorm(32), ops.Linear(32, 16)).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"RMSNorm\(32\).*\(4, 24\)"):
        seq(torch.randn(4, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="swiglu|SwiGLU|even|odd"):
        ops.SwiGLU()(torch.randn(4, 7, dtype=torch.bfloat16))


def test_precision_guard_warns_about_float32_activations():
    seq = ops.Sequential(ops.Linear(32, 16))
    with pytest.warns(ops.Float8PrecisionWarning, match="bfloat16"):
        seq(torch.randn(4, 32))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ops.Float8PrecisionWarning)
        seq.to(torch.bfloat16)(torch.randn(4, 32, dtype=torch.bfloat16))


def test_no_grad_forward_keeps_nothing_and_makes_no_transpose():
    seq = ops.Sequential(ops.RMSNorm(32), ops.Linear(32, 16, bias=False)).to(torch.bfloat16)
    with torch.no_grad():
        y = seq(torch.randn(4, 32, dtype=torch.bfloat16))
    assert y.grad_fn is None
    assert seq[1]._weight_cache.w8.transpose_cache is None


def test_gradient_accumulation_over_micro_batches():
    torch.manual_seed(0)
    seq = ops.Sequential(ops.Linear(32, 32, bias=False)).to(torch.bfloat16)
    xs = [torch.randn(8, 32, dtype=torch.bfloat16) for _ in range(2)]
    for x in xs:
        seq(x).float().sum().backward()
    acc = seq[0].weight.grad.clone()
    seq.zero_grad()
    for x in xs[::-1]:
        seq(x).float().sum().backward()
    assert torch.allclose(acc.float(), seq[0].weight.grad.float(), rtol=1e-2)


def test_float8_output_from_a_final_quantize():
    seq = ops.Sequential(ops.Linear(32, 32), ops.Quantize()).to(torch.bfloat16)
    with torch.no_grad():
        out = seq(torch.randn(4, 32, dtype=torch.bfloat16))
    assert isinstance(out, Float8Tensor)


def _torch_twin(seq):
    """torch.nn modules computing what `seq` (Linear+bias, RMSNorm, GELU, Residual pair, SwiGLU, LayerNorm,
    ReLU, SiLU, Linear) computes, sharing its parameters."""
    lin1, norm, lin2, ln, lin3 = seq[0], seq[1], seq[4], seq[7], seq[10]

    def run(x):
        h = torch.nn.functional.gelu(
            torch.nn.functional.rms_norm(
                torch.nn.functional.linear(x, lin1.weight, lin1.bias), (64,), norm.weight, norm.eps
            )
        )
        g = torch.nn.functional.linear(h, lin2.weight)
        h = torch.nn.functional.silu(g[:, :64]) * g[:, 64:] + h
        h = torch.nn.functional.layer_norm(h, (64,), ln.weight, ln.bias, ln.eps)
        return torch.nn.functional.linear(torch.nn.functional.silu(torch.relu(h)), lin3.weight)

    return run


def test_plain_torch_twin_of_a_run_gives_torch_bits():
    # Where none of a run's Linears is big enough for FP8 on CUDA (the small-layer policy), a Sequential
    # runs its ops' torch twins under ordinary autograd (ops/runner.py _run_as_torch): the same bits
    # as torch's functions, forward and backward. Checked here on the CPU, where the run itself is FP8.
    from float8.ops.runner import _run_as_torch, _runs_as_torch

    torch.manual_seed(0)
    seq = ops.Sequential(
        ops.Linear(32, 64, bias=True),
        ops.RMSNorm(64),
        ops.GELU(),
        ops.Residual(),
        ops.Linear(64, 128, bias=False),
        ops.SwiGLU(),
        ops.AddResidual(),
        ops.LayerNorm(64),
        ops.ReLU(),
        ops.SiLU(),
        ops.Linear(64, 16, bias=False),
    ).to(torch.bfloat16)
    for p in seq.parameters():
        p.data.normal_()
    twin = _torch_twin(seq)
    flat = [o for op in seq for o in op.expand()]
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    assert not _runs_as_torch(flat, x)  # on the CPU a Sequential always runs FP8
    results = []
    for fn in (lambda x: _run_as_torch(flat, x, (8,), True), twin):
        y = fn(x)
        y.float().square().sum().backward()
        results.append([y.detach(), x.grad] + [p.grad for p in seq.parameters()])
        x.grad = None
        seq.zero_grad(set_to_none=True)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_plain_torch_twin_checks_shapes_and_draws_dropout_like_the_op():
    from float8.ops.runner import _run_as_torch

    lin = ops.Linear(16, 8)
    with pytest.raises(ValueError, match=r"Linear expects input \(\.\.\., 16\)"):
        _run_as_torch(lin.expand(), torch.randn(4, 12), (4,), True)
    with pytest.raises(ValueError, match="even last dim"):
        _run_as_torch([ops.SwiGLU()], torch.randn(4, 7), (4,), True)
    drop = ops.Dropout(p=0.5)
    x = torch.randn(64, 32)
    torch.manual_seed(3)
    plain = _run_as_torch([drop], x, (64,), True)
    torch.manual_seed(3)
    assert torch.equal(plain, ops.Sequential(drop)(x))


def test_plain_torch_twin_gives_float32_master_biases_float32_gradients():
    # A bias kept in float32 beside bf16 activations: Bias.op_backward sums the rows' gradients in
    # float32; the torch twin must too, not hand back a sum rounded to bf16.
    from float8.ops.runner import _run_as_torch

    torch.manual_seed(0)
    x = torch.randn(512, 64, dtype=torch.bfloat16)
    dy = torch.randn(512, 64, dtype=torch.bfloat16) * 10
    want = dy.double().sum(0)
    for ops_list in ([ops.Bias(64)], ops.Linear(64, 64, bias=True).to(torch.bfloat16).expand()):
        bias = ops_list[-1].bias
        bias.data = bias.data.float()
        y = _run_as_torch(ops_list, x, (512,), True)
        assert y.dtype == torch.bfloat16
        y.backward(dy)
        assert bias.grad.dtype == torch.float32
        assert (bias.grad.double() - want).abs().max() < 1e-3, (bias.grad.double() - want).abs().max()
        bias.grad = None


def test_plain_torch_twin_folds_a_separate_bias_as_the_fused_run_does():
    from float8.ops.runner import _run_as_torch

    torch.manual_seed(0)
    lin, bias = ops.Linear(32, 16, bias=False).to(torch.bfloat16), ops.Bias(16).to(torch.bfloat16)
    bias.bias.data.normal_()
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    F = torch.nn.functional
    assert torch.equal(_run_as_torch([lin, bias], x, (8,), True), F.linear(x, lin.weight, bias.bias))
    assert torch.equal(_run_as_torch([lin, bias], x, (8,), False), F.linear(x, lin.weight) + bias.bias)
    # A Linear with a bias of its own and another Bias after it: two additions, neither folded away.
    lin_b = ops.Linear(32, 16, bias=True).to(torch.bfloat16)
    want = F.linear(x, lin_b.weight, lin_b.bias) + bias.bias
    assert torch.equal(_run_as_torch(lin_b.expand() + [bias], x, (8,), True), want)
    # Straight after such a Linear, another Bias is not its own: added after the GEMM (the Linear's own
    # bias belongs to the Bias op of its expansion, as in the fused run).
    assert torch.equal(_run_as_torch([lin_b, bias], x, (8,), True), F.linear(x, lin_b.weight) + bias.bias)


def test_plain_torch_twin_of_attention_gives_the_ops_bits():
    from float8.ops.runner import _run_as_torch

    torch.manual_seed(0)
    attn = ops.Attention(4, 16, num_kv_heads=2)
    x = torch.randn(2, 8, 128, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    runs = []
    for fn in (lambda x: _run_as_torch([attn], x.reshape(16, 128), (2, 8), True).reshape(2, 8, 64), attn):
        fn(x).backward(dy)
        runs.append((fn(x).detach(), x.grad))
        x.grad = None
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
