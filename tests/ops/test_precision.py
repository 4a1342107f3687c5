"""ops.high_precision(model): a converted model's Linears run in the activation dtype for a while (issue 23
item 7), restored on exit, touching no other model."""

import pytest
import torch
import torch.nn.functional as F

import float8.ops as ops

BF16 = torch.bfloat16


def _plain():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64, bias=False)).to(BF16)


@pytest.mark.parametrize("grad", [False, True])
def test_a_converted_model_gives_the_plain_models_bits_inside_and_fp8_outside(grad):
    plain, conv = _plain(), ops.convert(_plain())
    x = torch.randn(2, 16, 64, dtype=BF16)
    with torch.set_grad_enabled(grad):
        fp8 = conv(x)
        with ops.high_precision(conv) as same:
            assert same is conv
            assert torch.equal(conv(x), plain(x))
        assert torch.equal(conv(x), fp8)  # restored
    assert not torch.equal(fp8, plain(x))


def test_fp8_only_weights_run_on_their_dequantized_values_and_stay_fp8():
    conv = ops.convert(_plain(), fp8_weights=True)
    x = torch.randn(200, 64, dtype=BF16)  # past the weight-only path too
    w0, w2 = (conv[i].weight.dequantize(BF16) for i in (0, 2))
    want = F.linear(F.gelu(F.linear(x, w0, conv[0].bias)), w2)
    with torch.no_grad(), ops.high_precision(conv):
        assert torch.equal(conv(x), want)
        assert conv[0].weight.fp8_data.dtype == torch.float8_e4m3fn  # nothing converted back


def test_a_sequential_runs_torchs_functions_and_trains():
    torch.manual_seed(0)
    seq = ops.Sequential(ops.RMSNorm(64), ops.Linear(64, 64), ops.GELU()).to(BF16)
    x = torch.randn(4, 64, dtype=BF16, requires_grad=True)
    with ops.high_precision(seq):
        y = seq(x)
        y.float().sum().backward()
    want = F.gelu(F.linear(F.rms_norm(x.detach(), (64,), seq[0].weight, seq[0].eps), seq[1].weight, seq[1].bias))
    assert torch.equal(y.detach(), want)
    assert seq[1].weight.grad is not None


def test_restored_after_an_error_and_other_models_untouched():
    conv, other = ops.convert(_plain()), ops.convert(_plain())
    with pytest.raises(RuntimeError, match="boom"):
        with ops.high_precision(conv):
            assert conv[0].high_precision and not other[0].high_precision
            raise RuntimeError("boom")
    assert not conv[0].high_precision and "high_precision" not in conv[0].__dict__
