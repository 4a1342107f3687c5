"""ops.plan: the one place that decides how a run of basic ops goes (ops/runner.py), asked directly.

Each route: the fused autograd Function when a backward will run, the fused forward alone when none will,
the plain-torch twins for GEMMs the small-layer policy keeps in high precision (GPU), and under
torch.compile the split at ops that run outside the fused Functions and the hand-back to eager of delayed
scaling in training. (Tracing is emulated here by making torch.compiler.is_compiling answer True: what
the compiled runs do with each route is tested in tests/ops/test_compile_ops.py.)
"""

import pytest
import torch

import float8.ops as ops
from float8 import Recipe

BF16 = torch.bfloat16


def _mlp(recipe=None):
    return ops.Sequential(ops.Linear(64, 128), ops.GELU(), ops.Linear(128, 64, bias=False), recipe=recipe).to(BF16)


def _basic(seq):
    return [b for op in seq for b in op.expand()]


def test_autograd_when_a_backward_will_run_and_forward_when_none_will():
    seq = _mlp()
    x = torch.randn(8, 64, dtype=BF16)
    p = ops.plan(_basic(seq), x)
    assert p.route == "autograd" and p.grad
    assert [id(t) for t in p.params] == [id(t) for t in seq.parameters()]  # the order gradients come in
    with torch.no_grad():
        assert ops.plan(_basic(seq), x).route == "forward"
    seq.requires_grad_(False)
    assert ops.plan(_basic(seq), x).route == "forward"  # nothing requires grad
    assert ops.plan(_basic(seq), x.requires_grad_()).route == "autograd"


def test_cpu_never_takes_the_torch_twins():
    """The small-layer policy is a CUDA decision: the CPU path exists to be exact, in FP8."""
    seq = ops.Sequential(ops.Linear(16, 16), recipe=Recipe(min_fp8_gemm_flops=10**15)).to(BF16)
    assert ops.plan(_basic(seq), torch.randn(2, 16, dtype=BF16)).route == "autograd"


def _tracing(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)


def test_under_compile_attention_splits_the_run(monkeypatch):
    block = [
        ops.Residual(),
        ops.RMSNorm(64),
        ops.Linear(64, 192, bias=False),
        ops.Attention(4, 16),
        ops.Linear(64, 64, bias=False),
        ops.AddResidual(),
    ]
    x = torch.randn(2, 8, 64, dtype=BF16)
    assert ops.plan(block, x).route == "autograd"
    _tracing(monkeypatch)
    assert ops.plan(block, x).route == "split"


def test_under_compile_delayed_scaling_in_training_goes_back_to_eager(monkeypatch):
    seq = _mlp(Recipe.delayed())
    x = torch.randn(8, 64, dtype=BF16)
    _tracing(monkeypatch)
    assert ops.plan(_basic(seq), x).route == "eager"
    with torch.no_grad():
        assert ops.plan(_basic(seq), x).route == "forward"  # an inference forward compiles


def test_under_compile_an_op_that_cannot_be_traced_raises(monkeypatch):
    linear = ops.Linear(16, 16).to(BF16)
    linear.not_compilable = "a test's reason"
    _tracing(monkeypatch)
    with pytest.raises(NotImplementedError, match="a test's reason"):
        ops.plan(linear.expand(), torch.randn(2, 16, dtype=BF16))


@pytest.mark.gpu
def test_gpu_small_layers_take_the_torch_twins():
    seq = _mlp().cuda()
    x = torch.randn(8, 64, device="cuda", dtype=BF16)
    assert ops.plan(_basic(seq), x).route == "torch"
    assert ops.plan(_basic(seq), x, as_torch=False).route == "autograd"
    forced = _mlp(Recipe(min_fp8_gemm_flops=0)).cuda()
    assert ops.plan(_basic(forced), x).route == "autograd"
