"""Module hooks on ops: they fire as on torch.nn modules (issue 23 item 4).

Hooks registered on an op inside an ops.Sequential never fired (the Sequential runs its ops without calling
them), and ops.convert dropped the hooks of the layers it replaced. Now an op with hooks runs alone inside
its Sequential, through its own call (a fusion boundary), and convert hands the hooks to the new op.
"""

import pytest
import torch

import float8.ops as ops

BF16 = torch.bfloat16


def _seq():
    torch.manual_seed(0)
    return ops.Sequential(ops.RMSNorm(64), ops.Linear(64, 128), ops.GELU(), ops.Linear(128, 64)).to(BF16)


def test_forward_hooks_on_an_op_inside_a_sequential_fire_and_change_nothing_else():
    seq, plain = _seq(), _seq()
    seen = []
    seq[1].register_forward_pre_hook(lambda m, args: seen.append(("pre", args[0].shape)))
    seq[1].register_forward_hook(lambda m, args, out: seen.append(("post", out.shape)))
    x = torch.randn(2, 8, 64, dtype=BF16, requires_grad=True)
    y = seq(x)
    assert seen == [("pre", (2, 8, 64)), ("post", (2, 8, 128))]
    assert torch.equal(y, plain(x))  # the fused norm -> Linear boundary gives the same bits
    y.float().sum().backward()


def test_a_full_backward_hook_on_an_op_inside_a_sequential_fires():
    seq = _seq()
    grads = []
    seq[3].register_full_backward_hook(lambda m, gin, gout: grads.append(gout[0].shape))
    seq(torch.randn(2, 8, 64, dtype=BF16, requires_grad=True)).float().sum().backward()
    assert grads == [(2, 8, 64)]


def test_a_hook_inside_a_residual_pair_is_refused_by_name():
    seq = ops.Sequential(ops.Residual(), ops.RMSNorm(64), ops.Linear(64, 64), ops.AddResidual()).to(BF16)
    seq[2].register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="item 2 .Linear. has hooks"):
        seq(torch.randn(4, 64, dtype=BF16))


def test_convert_keeps_the_hooks_of_the_layers_it_replaces():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).to(BF16)
    calls = []
    handle = model[0].register_forward_hook(lambda m, a, out: calls.append("forward"))
    model[0].register_forward_pre_hook(lambda m, a: calls.append("pre"))
    model[0].register_full_backward_hook(lambda m, gin, gout: calls.append("backward"))
    ops.convert(model)
    assert isinstance(model[0], ops.Linear)
    model(torch.randn(4, 64, dtype=BF16, requires_grad=True)).float().sum().backward()
    assert calls == ["pre", "forward", "backward"]
    handle.remove()  # the handle the user held still removes the hook
    calls.clear()
    model(torch.randn(4, 64, dtype=BF16))
    assert calls == ["pre"]
