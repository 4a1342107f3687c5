"""An in-place write into a Float8Tensor means dequantize, modify, re-quantize with a fresh scale of the
tensor's layout, and means it the same way everywhere: eagerly and compiled, through any alias, before and
after a save and load, whatever scaling made the tensor.

These pin what a tensor carrying its quantizer (issue 24) must keep: tried in 504f260, where writes went
through the carried quantizer, a static scale clipped written values silently, compiled code (which cannot
carry it) wrote other bits than eager, and aliases and round trips disagreed; it was reverted.
"""

import io

import pytest
import torch

from float8 import DelayedScaling, DelayedScalingState, Float8Tensor, TensorwiseScaling

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::float8.Float8FallbackWarning"),
]
X = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))


def _made(kind: str) -> Float8Tensor:
    if kind == "static":
        return Float8Tensor.quantize(X, scale=1.0)
    if kind == "delayed":
        state = DelayedScalingState(DelayedScaling(history_len=4))
        Float8Tensor.quantize(X / 1000, scaling=state)  # a history whose scale would clip X * 1000
        return Float8Tensor.quantize(X, scaling=state)
    return Float8Tensor.quantize(X, scaling=TensorwiseScaling(margin=1, power_of_2=True))


def _same(a: Float8Tensor, b: Float8Tensor) -> bool:
    return torch.equal(a.fp8_data.view(torch.uint8), b.fp8_data.view(torch.uint8)) and torch.equal(
        a.scale_inv, b.scale_inv
    )


@pytest.mark.parametrize("kind", ["static", "delayed", "margin and power of 2"])
def test_a_write_takes_a_fresh_scale_so_no_written_value_is_clipped(kind):
    t = _made(kind)
    big = X * 1000  # far beyond what a static scale of 1 represents (E4M3's max is 448)
    t.copy_(big)
    assert t.dequantize().abs().max() > 448
    rel = (t.dequantize() - big).norm() / big.norm()
    assert rel < 0.05, rel  # E4M3 rounding (3 mantissa bits), not clipping


@pytest.mark.parametrize("kind", ["static", "delayed", "margin and power of 2"])
def test_eager_and_compiled_writes_give_the_same_bits(kind):
    def write(p):
        p.mul_(3.0)  # the in-place fallback (its warning is filtered for the module)

    eager, compiled = _made(kind), _made(kind)
    with torch.no_grad():
        write(eager)
        torch.compile(write, backend="aot_eager", fullgraph=True)(compiled)
    assert _same(eager, compiled)


@pytest.mark.parametrize(
    "alias",
    [lambda t: t, lambda t: t.detach(), lambda t: t.view(64, 128), lambda t: t.as_strided((64, 128), (128, 1))],
    ids=["itself", "detach", "view", "as_strided"],
)
def test_a_write_through_any_alias_gives_the_same_bits(alias):
    direct, t = _made("static"), _made("static")
    with torch.no_grad():
        direct.copy_(X * 1000)
        alias(t).copy_(X * 1000)
    assert _same(t, direct)


def test_a_write_after_a_save_and_load_gives_the_same_bits():
    t = _made("static")
    buf = io.BytesIO()
    torch.save(t, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    t.copy_(X * 1000)
    loaded.copy_(X * 1000)
    assert _same(t, loaded)
