"""Static input scales for inference: ops.calibrate, ops.set_input_scale, ops.load_input_scales, and the
StaticScalingState they install (scales, forward bits, checkpoints, errors, training, torch.compile)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import float8.ops as ops
from float8 import Float8Tensor, Recipe, StaticQuantizer, TensorwiseQuantizer
from float8.kernels.reference import fp8_max, scale_from_amax
from float8.quantizer import StaticScalingState
from tests.tolerances import SQNR_DB, assert_same_bits, sqnr_db

pytestmark = pytest.mark.filterwarnings("ignore::float8.ops.Float8PrecisionWarning")

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
# Tokens of the inputs whose FP8 path is checked: an FP8-only weight's Linear at few tokens may multiply its
# input as it is, unquantized (the weight-only forward of ops/linear.py, up to 128 tokens), where no input
# scale is used at all; above that the input is cast with its quantizer, the path under test here.
TOKENS = 256


def _mlp():
    """A plain model (nn.Linear, nn.SiLU) in bfloat16, before conversion."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.SiLU(),
        torch.nn.Linear(64, 64),
        torch.nn.SiLU(),
        torch.nn.Linear(64, 32, bias=False),
    ).to(BF16)


def _converted(fp8_weights=False):
    return ops.convert(_mlp(), fp8_weights=fp8_weights)


def _batches(n=3, seed=1, spread=True, rows=8):
    g = torch.Generator().manual_seed(seed)
    # spread: batches of different spreads, so that the amax of each layer comes from different batches.
    return [(torch.randn(rows, 32, generator=g) * (1 + k if spread else 1)).to(BF16) for k in range(n)]


def _linears(model):
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, ops.Linear)]


def _inputs_by_hand(model, x):
    """Each Linear's input for x, layer by layer (the model is a plain chain), without hooks."""
    seen = {}
    h = x
    with torch.no_grad():
        for fqn, m in model.named_children():
            if isinstance(m, ops.Linear):
                seen[fqn] = h
            h = m(h)
    return seen


def _expected_amax(model, batches):
    amax = {}
    for x in batches:
        for fqn, h in _inputs_by_hand(model, x).items():
            amax[fqn] = max(amax.get(fqn, 0.0), h.float().abs().max().item())
    return amax


@pytest.mark.parametrize("fp8_weights", [False, True], ids=["hp_weights", "fp8_weights"])
def test_each_scale_is_fp8_max_over_the_max_input_of_all_batches(fp8_weights):
    model, batches = _converted(fp8_weights), _batches()
    expected = _expected_amax(model, batches)  # current scaling, before calibration
    report = ops.calibrate(model, batches)
    assert report.amax == expected and report.batches == 3 and report.skipped == {}
    for fqn, lin in _linears(model):
        q = lin.input_quantizer
        assert isinstance(q, StaticScalingState) and q.fp8_dtype == E4M3
        amax = torch.tensor(expected[fqn], dtype=torch.float32)
        assert_same_bits(q.scale, fp8_max(E4M3) / amax)  # fp8_max / amax, as torch evaluates it
        assert report.scales[fqn] == q.scale.item()
        # The bits current scaling gives the batch that holds the amax: the same scale-inverse.
        holder = max(batches, key=lambda x: _inputs_by_hand(model, x)[fqn].float().abs().max().item())
        current = TensorwiseQuantizer().quantize(_inputs_by_hand(model, holder)[fqn])
        assert_same_bits(q.quantize(_inputs_by_hand(model, holder)[fqn]).scale_inv, current.scale_inv)


@pytest.mark.parametrize("fp8_weights", [False, True], ids=["hp_weights", "fp8_weights"])
def test_calibrated_forward_is_quantize_with_that_scale_then_the_fp8_gemm(fp8_weights):
    model = _converted(fp8_weights)
    ops.calibrate(model, _batches())
    x = torch.randn(TOKENS, 32, dtype=BF16) * 3  # larger than the calibration inputs: saturation included
    with torch.no_grad():
        h = x
        for m in model:
            if isinstance(m, ops.Linear):
                x8 = Float8Tensor.quantize(h, scale=m.input_quantizer.scale)
                w8 = m.weight if fp8_weights else Float8Tensor.quantize(m.weight)
                h = F.linear(x8, w8, m.bias)
            else:
                h = m(h)
        assert_same_bits(model(x), h)


@pytest.mark.parametrize("fp8_weights", [False, True], ids=["hp_weights", "fp8_weights"])
def test_on_the_calibration_batches_static_tracks_current_scaling(fp8_weights):
    reference = _mlp().double()
    current = _converted(fp8_weights)
    static = copy.deepcopy(current)
    # Batches of one distribution, as a calibration set is, with enough rows that the SQNR is not noise (at 8
    # rows per batch the static-minus-current gap moved between -1.7 and +0.7 dB from batch to batch).
    batches = _batches(spread=False, rows=TOKENS)
    ops.calibrate(static, batches)
    with torch.no_grad():
        for x in batches:
            want = reference(x.double())
            got_current, got_static = sqnr_db(want, current(x)), sqnr_db(want, static(x))
            assert got_current >= SQNR_DB["linear"] - 3  # three FP8 GEMMs in a row
            assert got_static >= got_current - 0.5, (got_static, got_current)


@pytest.mark.parametrize("fp8_weights", [False, True], ids=["hp_weights", "fp8_weights"])
def test_state_dict_carries_the_scales_into_a_fresh_model(fp8_weights):
    calibrated = _converted(fp8_weights)
    ops.calibrate(calibrated, _batches())
    state = calibrated.state_dict()
    assert {f"{i}.input_quantizer.static_scale" for i in (0, 2, 4)} <= set(state)

    # An uncalibrated target: a strict load installs the static quantizers (Linear._load_from_state_dict) ...
    fresh = _converted(fp8_weights)
    fresh.load_state_dict(state, strict=True)
    for i in (0, 2, 4):
        assert torch.equal(fresh[i].input_quantizer.static_scale, state[f"{i}.input_quantizer.static_scale"])
    # ... as load_input_scales does, which stays for callers that want the names first.
    again = _converted(fp8_weights)
    assert ops.load_input_scales(again, state) == ["0", "2", "4"]
    again.load_state_dict(state, strict=True)
    # A target calibrated on other data: a strict load replaces its scales.
    other = _converted(fp8_weights)
    ops.calibrate(other, _batches(seed=7))
    other.load_state_dict(state, strict=True)
    x = torch.randn(5, 32, dtype=BF16)
    with torch.no_grad():
        for model in (fresh, other):
            assert_same_bits(model(x), calibrated(x))
            for (_, a), (_, b) in zip(_linears(model), _linears(calibrated)):
                assert_same_bits(a.input_quantizer.scale, b.input_quantizer.scale)

    # An uncalibrated checkpoint does not load strictly into a calibrated model: its scales would be kept.
    with pytest.raises(RuntimeError, match="Missing key.*input_quantizer.static_scale"):
        calibrated.load_state_dict(_converted(fp8_weights).state_dict(), strict=True)


def test_a_loaded_scale_is_validated_and_the_scale_stays_float32():
    model = _converted()
    ops.calibrate(model, _batches())
    state = model.state_dict()
    state["2.input_quantizer.static_scale"] = torch.tensor(0.0)
    with pytest.raises(ValueError, match="scale must be"):
        model.load_state_dict(state)
    model.to(torch.float16)  # the scales move, never round
    assert all(lin.input_quantizer.scale.dtype == torch.float32 for _, lin in _linears(model))
    with pytest.raises(ValueError, match="'1'.*SiLU"):
        ops.load_input_scales(_converted(), {"1.input_quantizer.static_scale": torch.tensor(1.0)})


def test_batches_from_a_generator_tuples_dicts_and_a_forward_function():
    batches = _batches()
    expected = ops.calibrate(_converted(), batches).amax

    report = ops.calibrate(_converted(), (x for x in batches))  # read once
    assert report.amax == expected and report.batches == 3

    class Keyword(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _converted()

        def forward(self, x, *, scale=1.0):
            return self.body(x * scale)

    prefixed = {f"body.{k}": v for k, v in expected.items()}
    assert ops.calibrate(Keyword(), [(x,) for x in batches]).amax == prefixed
    assert ops.calibrate(Keyword(), [{"x": x} for x in batches]).amax == prefixed
    halved = ops.calibrate(Keyword(), batches, forward=lambda m, b: m(b * 2, scale=0.5))
    assert halved.amax == prefixed
    with pytest.raises(TypeError, match=r"pass \[x\]"):
        ops.calibrate(_converted(), batches[0])


def test_filter_fn_and_margin():
    batches = _batches()
    plain = ops.calibrate(_converted(), batches)
    model = _converted()
    report = ops.calibrate(model, batches, margin=2, filter_fn=lambda m, fqn: fqn != "2")
    assert list(report.amax) == ["0", "4"] and report.margin == 2
    assert isinstance(model[2].input_quantizer, TensorwiseQuantizer)  # not selected: its recipe's quantizer
    for fqn in ("0", "4"):
        assert report.amax[fqn] == plain.amax[fqn]
        assert report.scales[fqn] == plain.scales[fqn] / 4
        want = scale_from_amax(torch.tensor(plain.amax[fqn]), E4M3, margin=2)
        assert_same_bits(model.get_submodule(fqn).input_quantizer.scale, want)
    with pytest.raises(ValueError, match="margin 18 is too large"):
        ops.calibrate(_converted(), batches, margin=18)


def test_rowwise_layers_and_layers_inside_an_ops_sequential_are_skipped_and_reported():
    model = _mlp()
    ops.convert(model, filter_fn=lambda m, fqn: fqn != "2")
    ops.convert(model, recipe=Recipe.rowwise(), filter_fn=lambda m, fqn: fqn == "2")  # layer 2: per-row inputs
    report = ops.calibrate(model, _batches())
    assert list(report.amax) == ["0", "4"]
    assert "per row (RowwiseQuantizer)" in report.skipped["2"]
    assert type(model[2].input_quantizer).__name__ == "RowwiseQuantizer"

    # A Sequential runs its Linears as basic ops, without their forward; a plain module inside it runs its own.
    seq = ops.Sequential(ops.Linear(32, 32), ops.SiLU(), torch.nn.Sequential(ops.Linear(32, 32))).to(BF16)
    report = ops.calibrate(seq, _batches())
    assert list(report.amax) == ["ops.2.0"] and list(report.skipped) == ["ops.0"]
    assert "run by the ops.Sequential '<root>' without its forward" in report.skipped["ops.0"]
    with pytest.raises(ValueError, match="no Linear of the model can be calibrated.*without its forward"):
        ops.calibrate(ops.Sequential(ops.Linear(32, 32), ops.SiLU()).to(BF16), _batches())


def test_a_linear_that_saw_no_input_raises_naming_it_and_nothing_changes():
    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = ops.Linear(32, 32), ops.Linear(32, 32)

        def forward(self, x):
            return self.used(x)

    model = Branches().to(BF16)
    with pytest.raises(ValueError, match="saw no input in 3 batch.*unused"):
        ops.calibrate(model, _batches())
    assert all(isinstance(m.input_quantizer, TensorwiseQuantizer) for _, m in _linears(model))
    with pytest.raises(ValueError, match="saw no input in 0 batch"):
        ops.calibrate(_converted(), [])
    assert list(ops.calibrate(model, _batches(), filter_fn=lambda m, fqn: fqn == "used").amax) == ["used"]


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_calibration_inputs_raise_naming_the_layer(bad):
    model = _converted()
    batches = _batches()
    batches[1][3, 5] = bad
    with pytest.raises(ValueError, match=r"non-finite inputs \(inf or NaN\) reached 0 \(amax (inf|nan)\)"):
        ops.calibrate(model, batches)
    assert all(isinstance(m.input_quantizer, TensorwiseQuantizer) for _, m in _linears(model))


@pytest.mark.parametrize("fp8_weights", [False, True], ids=["hp_weights", "fp8_weights"])
def test_inf_or_nan_at_inference_gives_a_non_finite_output(fp8_weights):
    model = _converted(fp8_weights)
    ops.calibrate(model, _batches())
    for bad in (float("inf"), float("nan")):
        for tokens in (4, TOKENS):
            x = torch.randn(tokens, 32, dtype=BF16)
            x[1, 2] = bad
            assert torch.isnan(model[0].input_quantizer.quantize(x).scale_inv)  # never a saturated, finite cast
            with torch.no_grad():
                y = model(x)
            assert not torch.isfinite(y[1]).any()  # the row that held it, whichever path ran
            if tokens == TOKENS or not fp8_weights:
                assert not torch.isfinite(y).any()  # cast with the NaN scale-inverse: every output


def _calibration_hooks(model):
    """The forward pre-hooks on model's modules other than ops.convert's SwiGLU fusion's."""
    from float8.ops.swiglu_fusion import SwiGLUFusion

    return [
        h
        for m in model.modules()
        for h in m._forward_pre_hooks.values()
        if not isinstance(getattr(h, "__self__", None), SwiGLUFusion)
    ]


def test_hooks_are_removed_and_modes_restored_after_an_error():
    model = _converted()
    model.train()
    model[2].eval()  # a mixed model: each module's own flag comes back

    def exploding(m, batch):
        if batch is batches[1]:
            raise RuntimeError("boom")
        assert not m.training and not torch.is_grad_enabled()
        return m(batch)

    batches = _batches()
    with pytest.raises(RuntimeError, match="boom"):
        ops.calibrate(model, batches, forward=exploding)
    assert not _calibration_hooks(model)
    assert [m.training for m in model] == [True, True, False, True, True]
    assert torch.is_grad_enabled()
    assert all(isinstance(m.input_quantizer, TensorwiseQuantizer) for _, m in _linears(model))
    ops.calibrate(model, batches)
    assert not _calibration_hooks(model)
    assert [m.training for m in model] == [True, True, False, True, True]


def test_a_calibrated_linear_trains_with_its_fixed_input_scale():
    torch.manual_seed(0)
    current = ops.Linear(32, 64).to(BF16)
    static = copy.deepcopy(current)
    ops.calibrate(static, _batches())
    x = torch.randn(8, 32, dtype=BF16) * 2
    g = torch.randn(8, 64, dtype=BF16)
    grads = []
    for lin in (current, static):
        xi = x.clone().requires_grad_(True)
        (lin(xi).float() * g.float()).sum().backward()
        grads.append((xi.grad, lin.weight.grad, lin.bias.grad))
    (dx_c, dw_c, db_c), (dx_s, dw_s, db_s) = grads
    assert_same_bits(dx_s, dx_c)  # dx = dy8 @ w8: the input's scale does not enter
    assert_same_bits(db_s, db_c)
    dw_ref = g.double().t() @ x.double()
    assert sqnr_db(dw_ref, dw_s) >= SQNR_DB["grad"]  # the weight gradient reads the statically cast input
    assert not torch.equal(dw_s, dw_c)


def test_set_input_scale_on_one_linear():
    lin = ops.Linear(32, 32).to(BF16)
    q = ops.set_input_scale(lin, amax=3.5)
    assert lin.input_quantizer is q and "input_quantizer.static_scale" in lin.state_dict()
    assert_same_bits(q.scale, scale_from_amax(torch.tensor(3.5), E4M3))
    ops.set_input_scale(lin, scale=torch.tensor(64.0))
    assert lin.input_quantizer.scale.item() == 64.0 and lin.input_quantizer is not q
    ops.set_input_scale(lin, amax=0.0)
    assert lin.input_quantizer.scale.item() == 1.0  # amax 0: scale 1, the library's rule
    for kwargs, match in [
        ({}, "exactly one"),
        ({"scale": 2.0, "amax": 1.0}, "exactly one"),
        ({"scale": 2.0, "margin": 1}, "margin applies to amax"),
        ({"amax": float("inf")}, "finite value >= 0"),
        ({"amax": -1.0}, "finite value >= 0"),
        ({"scale": 0.0}, "scale must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            ops.set_input_scale(lin, **kwargs)
    with pytest.raises(ValueError, match="per row"):
        ops.set_input_scale(ops.Linear(32, 32, recipe=Recipe.rowwise()), amax=1.0)
    with pytest.raises(TypeError, match="float8.ops.Linear"):
        ops.set_input_scale(torch.nn.Linear(32, 32), amax=1.0)


def test_a_static_scale_inside_a_sequential_is_written_by_the_fused_kernels():
    def build(fuse, static=True):
        torch.manual_seed(0)
        seq = ops.Sequential(
            ops.RMSNorm(32), ops.Linear(32, 32, bias=False), ops.SiLU(), ops.Linear(32, 32, bias=False), fuse=fuse
        )
        if static:
            ops.set_input_scale(seq[1], amax=4.0)
            ops.set_input_scale(seq[3], amax=0.25)  # saturates: the SiLU kernel casts with it
        return seq

    x = torch.randn(8, 32)  # float32: fused and unfused run the same arithmetic (tests/ops/test_fusion.py)
    with torch.no_grad():
        fused, unfused, current = build(True)(x), build(False)(x), build(True, static=False)(x)
    assert_same_bits(fused, unfused)
    assert not torch.equal(fused, current)


def test_a_calibrated_model_compiles_fullgraph_and_matches_eager():
    torch._dynamo.reset()
    model = _converted()
    ops.calibrate(model, _batches())
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(5, 32, dtype=BF16) * (step + 1)
            assert_same_bits(compiled(x), model(x))
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for one shape"
    # Training through the compiled model: outputs and gradients are eager's bits.
    x = torch.randn(5, 32, dtype=BF16)
    results = []
    for run in (model, compiled):
        xi = x.clone().requires_grad_(True)
        y = run(xi)
        y.float().square().sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    for want, got in zip(*results):
        assert_same_bits(got, want)


def test_static_scaling_state_is_a_static_quantizer_with_its_scale_in_the_state_dict():
    x = torch.randn(16, 32, dtype=BF16) * 4
    q = StaticScalingState(torch.tensor(8.0), torch.float8_e5m2)
    want = StaticQuantizer(8.0, torch.float8_e5m2)._quantize(x, True)
    got = q._quantize(x, True)
    assert_same_bits(got.fp8_data, want.fp8_data)
    assert_same_bits(got.scale_inv, want.scale_inv)
    assert_same_bits(got._transpose, want._transpose)
    assert set(q.state_dict()) == {"static_scale", "_extra_state"}
    with pytest.raises(ValueError, match="made for torch.float8_e5m2.*casts to torch.float8_e4m3fn"):
        StaticScalingState(1.0).load_state_dict(q.state_dict())
    with pytest.raises(ValueError, match="scale must be"):
        StaticScalingState(float("inf"))


def _calibrate_over_the_group(rank, world):
    import torch.distributed as dist

    torch.manual_seed(0)  # the same weights on every rank
    lin = ops.Linear(32, 32, amax_group=dist.group.WORLD).to(BF16)
    report = ops.calibrate(lin, [torch.full((4, 32), float(rank + 1), dtype=BF16)])  # rank r sees amax r + 1
    assert lin.input_quantizer.amax_group is dist.group.WORLD  # an FP8 all-gather may rely on one scale
    return report.amax["<root>"], lin.input_quantizer.scale.clone()


def test_the_amax_is_reduced_over_the_linears_amax_group():
    from tests.distributed.harness import run_ranks

    (a0, s0), (a1, s1) = run_ranks(_calibrate_over_the_group, timeout=120)
    assert a0 == a1 == 2.0
    assert_same_bits(s0, s1)
    assert_same_bits(s0, scale_from_amax(torch.tensor(2.0), E4M3))
