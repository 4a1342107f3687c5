"""A scaling granularity written in this file alone trains a Linear and a Sequential: the quantizer contract.

`PerChannelQuantizer` gives one scale per index of the last dim, shared by every row (the channel scaling
of SmoothQuant), which the library does not ship. It takes a Quantizer subclass whose layout is
ScaleLayout.OTHER (a Linear's GEMMs then run on the dequantized operands) and its reference kernel, handed
to a Recipe as stateless instances; no library file names it. Checked: its numerics (finer than one scale
per tensor on channel-skewed data, non-finite values never finite), an ops.Linear and an ops.Sequential
trained with AdamW from such a recipe (the loss falls; first-step gradients within FP8 tolerance of a bf16
twin), and what a recipe refuses.
"""

import pytest
import torch

import float8.ops as ops
from float8 import Float8Tensor, Format, Recipe
from float8.quantizer import Quantizer, ScaleLayout, StaticScalingState, TensorwiseQuantizer
from tests.tolerances import sqnr_db

BF16 = torch.bfloat16


def per_channel_quantize_ref(x: torch.Tensor, fp8_dtype: torch.dtype) -> Float8Tensor:
    """The granularity's reference kernel: scale = fp8_max / amax of each last-dim index over all rows; a
    channel whose amax is not finite gets a NaN scale-inverse (its values never come out finite)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).float()
    amax = rows.abs().amax(dim=0, keepdim=True)
    fp8_max = torch.finfo(fp8_dtype).max
    scale = torch.where(amax > 0, fp8_max / amax, torch.ones_like(amax))
    scale = torch.where(torch.isfinite(amax), scale, torch.ones_like(amax))
    data = (rows * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype).reshape(x.shape)
    scale_inv = torch.where(torch.isfinite(amax), 1.0 / scale, torch.full_like(amax, float("nan")))
    return Float8Tensor(data, scale_inv.reshape(*([1] * (x.dim() - 1)), k), x.dtype)


class PerChannelQuantizer(Quantizer):
    """One scale per channel (last-dim index), from the current tensor's per-channel amax."""

    layout = ScaleLayout.OTHER

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> None:
        self.fp8_dtype = fp8_dtype

    def _quantize(self, x: torch.Tensor, with_transpose: bool) -> Float8Tensor:
        ref = per_channel_quantize_ref(x, self.fp8_dtype)
        # The tensor carries this quantizer's identity: an in-place write re-quantizes through it
        # (tests/float8/test_quantizer_identity.py).
        return Float8Tensor(ref.fp8_data, ref.scale_inv, x.dtype, quantizer_id=self.requantizer_id)


def per_channel_recipe() -> Recipe:
    return Recipe(
        format=Format.HYBRID,
        input=PerChannelQuantizer(torch.float8_e4m3fn),
        weight=PerChannelQuantizer(torch.float8_e4m3fn),
        grad=PerChannelQuantizer(torch.float8_e5m2),
    )


def test_per_channel_scales_are_finer_than_one_per_tensor_and_keep_non_finite_values():
    torch.manual_seed(0)
    x = torch.randn(64, 32) * torch.logspace(-6, 2, 32)  # channels eight decades apart: beyond E4M3's range
    ours = PerChannelQuantizer().quantize(x)
    assert ours.scale_inv.shape == (1, 32)
    tensorwise = TensorwiseQuantizer().quantize(x)
    small = slice(0, 8)  # the faintest channels: one scale per tensor rounds them to a few codes, or to 0
    assert (
        sqnr_db(ours.dequantize()[:, small], x[:, small]) > sqnr_db(tensorwise.dequantize()[:, small], x[:, small]) + 10
    )
    x[3, 5] = float("inf")
    bad = PerChannelQuantizer().quantize(x).dequantize()
    assert bad[:, 5].isnan().all() and bad[:, [4, 6]].isfinite().all()


def _train(model, twin, x, target, steps=25):
    """AdamW on both; (first-step gradient SQNRs in dB by parameter name, first loss, last loss) of `model`."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    losses, db = [], {}
    for step in range(steps):
        for m, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x).float(), target)
            loss.backward()
            if m is model:
                losses.append(loss.item())
        if step == 0:
            pairs = zip(model.named_parameters(), twin.parameters())  # the same parameters in the same order
            db = {n: sqnr_db(p.grad.float(), q.grad.float()) for (n, p), q in pairs}
        opt.step()
        twin_opt.step()
    return db, losses[0], losses[-1]


def test_a_linear_trains_with_a_granularity_defined_here():
    torch.manual_seed(0)
    lin = ops.Linear(64, 32, recipe=per_channel_recipe()).to(BF16)
    twin = torch.nn.Linear(64, 32).to(BF16)
    twin.load_state_dict(lin.state_dict())
    x = torch.randn(128, 64, dtype=BF16) * torch.logspace(-2, 1, 64, dtype=BF16)
    target = torch.randn(128, 32)
    assert isinstance(lin.input_quantizer, PerChannelQuantizer)  # the recipe's instance, as it is
    db, first, last = _train(lin, twin, x, target)
    assert last < 0.5 * first, (first, last)
    assert min(db.values()) > 20, db


def test_a_sequential_trains_with_a_granularity_defined_here():
    torch.manual_seed(0)
    recipe = per_channel_recipe()
    seq = ops.Sequential(
        ops.RMSNorm(64), ops.Linear(64, 128, recipe=recipe), ops.GELU(), ops.Linear(128, 64, recipe=recipe)
    ).to(BF16)
    twin = torch.nn.Sequential(
        torch.nn.RMSNorm(64, eps=seq[0].eps), torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)
    ).to(BF16)
    for (name, p), q in zip(seq.named_parameters(), twin.parameters()):
        assert p.shape == q.shape, name
        q.data.copy_(p.data)
    x = torch.randn(256, 64, dtype=BF16)
    target = torch.randn(256, 64)
    db, first, last = _train(seq, twin, x, target)
    assert last < 0.7 * first, (first, last)
    assert min(db.values()) > 15, db


def test_a_recipe_refuses_what_a_shared_quantizer_cannot_be():
    with pytest.raises(ValueError, match="Recipe.grad: the quantizer writes torch.float8_e4m3fn"):
        Recipe(grad=PerChannelQuantizer(torch.float8_e4m3fn))  # HYBRID gradients are E5M2
    with pytest.raises(TypeError, match="Recipe.input: StaticScalingState keeps state"):
        Recipe(input=StaticScalingState(1.0))
    with pytest.raises(TypeError, match="scaling dataclass or a stateless Quantizer"):
        Recipe(weight="per-channel")
    group = object()  # stands for a process group: the check happens before any collective
    with pytest.raises(ValueError, match="cannot reduce its amax over the op's amax_group"):
        per_channel_recipe().quantizers(amax_group=group)
