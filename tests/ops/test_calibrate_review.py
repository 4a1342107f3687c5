"""Regression tests from the adversarial review (2026-11-25) of ops.Linear's weight-only routing, ops.calibrate
and the static-scale state-dict hook. CPU only."""

import os
import tempfile

import pytest
import torch

import float8.ops as ops
from float8 import Recipe
from float8.recipe import TensorwiseScaling

pytestmark = pytest.mark.filterwarnings("ignore::float8.ops.Float8PrecisionWarning")

BF16 = torch.bfloat16


def _mlp(recipe=None, fp8_weights=False):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Linear(64, 32)).to(BF16)
    return ops.convert(m, recipe=recipe, fp8_weights=fp8_weights)


# ---- 1. weight-only routing skips the amax-group collective: ranks with different token counts desync ------


def test_collectives_of_a_linear_with_an_amax_group_do_not_depend_on_the_local_token_count(monkeypatch):
    """An FP8-only Linear with an amax_group all-reduces its input amax in the general path (one collective
    per forward), but the weight-only path (<= 128 tokens) issues none. Ranks of a data-parallel group whose
    local batches straddle 128 tokens (a ragged last eval batch; calibrate() on ragged batches) then issue
    different collectives: a hang, or NCCL/gloo pairing one rank's all-reduce with another layer's/call's
    all-reduce on the other rank (a silently wrong shared scale)."""
    import torch.distributed as dist

    f = tempfile.NamedTemporaryFile(delete=False)
    f.close()
    dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
    try:
        calls = []
        real = dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (calls.append(1), real(t, *a, **k))[1])
        lin = ops.convert(torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).to(BF16), fp8_weights=True)[0]
        lin.set_amax_group(dist.group.WORLD)
        counts = {}
        for tokens in (64, 200):
            calls.clear()
            with torch.no_grad():
                lin(torch.randn(tokens, 64, dtype=BF16))
            counts[tokens] = len(calls)
        assert counts[64] == counts[200], counts  # was {64: 0, 200: 1}: ranks straddling 128 tokens desync
    finally:
        dist.destroy_process_group()
        os.unlink(f.name)


# ---- 2. calibrate ignores the recipe's input margin (but honours its power_of_2) ---------------------------


def test_calibrated_scale_is_the_scale_current_scaling_derives_for_the_recipe():
    """Docstring: 'the bits current scaling derives from that amax'. With Recipe(input=TensorwiseScaling(
    margin=2)) current scaling divides the scale by 4; calibrate (margin=0 by default) does not, so the
    static scale is 4x the recipe's, and activations up to the calibration amax lose the 2 bits of
    headroom the recipe asked for (silently). power_of_2 of the same recipe field IS taken from the recipe."""
    model = _mlp(Recipe(input=TensorwiseScaling(margin=2)))
    x = torch.randn(256, 32, dtype=BF16) * 3
    current = model[0].input_quantizer.quantize(x)
    ops.calibrate(model, [x])
    static = model[0].input_quantizer.quantize(x)
    assert torch.equal(static.scale_inv, current.scale_inv)  # was 0.029 vs 0.116: the margin ignored


# ---- 3. calibrate on a torch.compile'd model: hooks never fire, misleading error ----------------------------


def test_calibrate_of_a_compiled_model_calibrates_the_module_it_wraps():
    model = _mlp()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(256, 32, dtype=BF16)
    with torch.no_grad():
        compiled(x)
    report = ops.calibrate(compiled, [x])  # was: "2 Linear(s) saw no input" (dynamo skipped the hooks)
    assert set(report.amax) == {"0", "2"}
    assert report.amax["0"] == x.float().abs().max().item()
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))


# ---- 4. a calibrated checkpoint loaded into a per-row model: error names neither the layer nor the load --------


def test_loading_a_static_scale_into_a_rowwise_linear_names_the_key():
    src = _mlp()
    ops.calibrate(src, [torch.randn(256, 32, dtype=BF16)])
    dst = _mlp(Recipe.rowwise())
    why = r"0\.input_quantizer\.static_scale: a calibrated static input scale, which this Linear cannot take.*per row"
    with (
        pytest.warns(UserWarning, match=why),
        pytest.raises(RuntimeError, match="Unexpected key.*0.input_quantizer.static_scale"),
    ):
        dst.load_state_dict(src.state_dict())
    with pytest.warns(UserWarning, match=why):
        dst.load_state_dict(src.state_dict(), strict=False)  # strict=False drops what a module cannot take
    assert type(dst[0].input_quantizer).__name__ == "RowwiseQuantizer"
