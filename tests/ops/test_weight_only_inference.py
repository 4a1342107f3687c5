"""ops.Linear's inference forward with an FP8-only weight, without the op runner (`Linear._inference_forward`).

At <= weight_only.MAX_TOKENS (128) tokens one fp8_weight_mm (kernels/weight_only.py), or from
Recipe.inference_fp8_input_from tokens fp8_rowwise_input_mm (kernels/rowwise_input_mm.py: x quantized per row, an
FP8 x FP8 kernel) for a weight that one takes; above, the general path's own
`linear_fwd` called directly (the same bits as the one-op Sequential). Which calls take it (no backward to
record, a per-tensor or per-row FP8 weight, a bf16/fp16 input), that it gives the kernel's reference bits
(on the CPU the op is its reference) or the general path's, that every other call takes the general path,
and that it compiles without a graph break.
"""

import dataclasses

import pytest
import torch

import float8.ops as ops
from float8 import Float8Tensor, Recipe
from float8.kernels import rowwise_input_mm, weight_only
from float8.ops.base import BasicOp
from tests.tolerances import sqnr_db


def _linear(k=64, n=48, bias=False, recipe=None, dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=bias)).to(dtype)
    ops.convert(model, recipe=recipe, fp8_weights=True)
    return model[0]


def _weight_only(lin, x):
    w = lin.weight
    y = weight_only.fp8_weight_mm_ref(x.reshape(-1, lin.in_features), w.fp8_data, w.scale_inv, lin.bias)
    return y.reshape(*x.shape[:-1], lin.out_features)


def _general(lin, x):
    return BasicOp.forward(lin, x)  # the one-op Sequential the fast path stands in for


@pytest.mark.parametrize("shape", [(1, 64), (16, 64), (2, 3, 64), (128, 64)])
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_few_tokens_take_the_weight_only_kernel(shape, mode):
    lin = _linear()
    x = torch.randn(shape, dtype=torch.bfloat16)
    with getattr(torch, mode)():
        y = lin(x)
        assert torch.equal(y, _weight_only(lin, x))
        # ... which is not what the FP8 x FP8 GEMM gives (the activation's cast is gone) ...
        assert not torch.equal(y, _general(lin, x))
    # ... and is closer to the high-precision product than that GEMM.
    want = x.double() @ lin.weight.dequantize(torch.float32).double().t()
    assert sqnr_db(y.double(), want) >= sqnr_db(_general(lin, x).double(), want)


@pytest.mark.parametrize("shape", [(33, 64), (2, 32, 64), (128, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_33_to_128_tokens_take_the_rowwise_input_kernel_where_the_recipe_asks(shape, bias):
    lin = _linear(bias=bias, recipe=Recipe(inference_fp8_input_from=33))
    x = torch.randn(shape, dtype=torch.bfloat16)
    x.view(-1, lin.in_features)[0] *= 1e5  # one loud token: with its own scale the others keep their resolution
    with torch.inference_mode():
        y = lin(x)
    w, x2 = lin.weight, x.reshape(-1, lin.in_features)
    want = rowwise_input_mm.fp8_rowwise_input_mm_ref(x2, w.fp8_data, w.scale_inv, lin.bias)
    assert torch.equal(y, want.reshape(*x.shape[:-1], lin.out_features))
    assert not torch.equal(y, _weight_only(lin, x))
    # One scale per token: the quiet tokens come out closer to the high-precision product than under the
    # general path's one scale per tensor, which the loud token sets: 1e5 times the others puts their values
    # among E4M3's subnormals (at 1000 times they stayed normal, 0.4-0.8 dB apart, and torch 2.11's general
    # path on the CPU came out ahead: H100 machine, 2026-11-27).
    exact = x.double() @ lin.weight.dequantize(torch.float32).double().t()
    exact = (exact + (0 if lin.bias is None else lin.bias.double())).reshape(-1, lin.out_features)[1:]
    general = _general(lin, x).double().reshape(-1, lin.out_features)[1:]
    assert sqnr_db(y.double().reshape(-1, lin.out_features)[1:], exact) > sqnr_db(general, exact)


@pytest.mark.parametrize("weight", ["e5m2", "block"])
def test_33_to_128_tokens_keep_the_weight_only_kernel_for_weights_the_fp8_kernel_does_not_take(weight):
    if weight == "e5m2":
        lin = _linear(recipe=Recipe(inference_fp8_input_from=33))
        w = lin.weight.dequantize(torch.float32)
        lin.weight = torch.nn.Parameter(Float8Tensor.quantize(w, torch.float8_e5m2), requires_grad=False)
    else:
        lin = _linear(k=256, n=384, recipe=dataclasses.replace(Recipe.blockwise(), inference_fp8_input_from=33))
    x = torch.randn(64, lin.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(lin(x), _weight_only(lin, x))


def test_the_recipe_field_is_checked():
    for bad in (0, 33.0, True):
        with pytest.raises(ValueError, match="inference_fp8_input_from"):
            Recipe(inference_fp8_input_from=bad)


def test_grad_mode_without_anything_requiring_grad_takes_it_too():
    lin, x = _linear(), torch.randn(4, 64, dtype=torch.bfloat16)
    assert torch.equal(lin(x), _weight_only(lin, x))


def _no_runner(monkeypatch):
    """Make the op runner raise: a call that gets through did not use it."""

    def refuse(*a, **k):
        raise AssertionError("the op runner ran")

    monkeypatch.setattr(BasicOp, "forward", refuse)


@pytest.mark.parametrize("recipe", [None, Recipe.rowwise(), Recipe.delayed()], ids=["tensorwise", "rowwise", "delayed"])
@pytest.mark.parametrize("bias", [None, "bfloat16", "float32"])
def test_more_tokens_call_linear_fwd_without_the_runner(recipe, bias, monkeypatch):
    """More than MAX_TOKENS: the activation quantized by the input quantizer and the FP8 GEMM, as the one-op Sequential
    does (the same bits, a delayed history advanced the same way), without the runner's host time."""
    lin = _linear(bias=bias is not None, recipe=recipe)
    twin = _linear(bias=bias is not None, recipe=recipe)
    if bias == "float32":
        lin.bias.data, twin.bias.data = lin.bias.data.float(), twin.bias.data.float()
    x = torch.randn(3, 50, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = [_general(twin, x) for _ in range(2)]
        with monkeypatch.context() as m:
            _no_runner(m)
            got = [lin(x) for _ in range(2)]
    for g, w in zip(got, want):
        assert g.shape == (3, 50, 48) and torch.equal(g, w)
    mine = lin.state_dict()
    for key, value in twin.state_dict().items():  # the delayed recipe's amax history included
        if isinstance(value, torch.Tensor):
            a, b = (getattr(t, "fp8_data", t).float() for t in (mine[key], value))
            assert torch.allclose(a, b, rtol=0, atol=0, equal_nan=True), key  # an unused state's scale is NaN


def test_calibrated_scale_is_one_cast_without_the_runner(monkeypatch):
    lin, twin = _linear(), _linear()
    x = torch.randn(weight_only.MAX_TOKENS + 1, 64, dtype=torch.bfloat16)
    for op in (lin, twin):
        ops.set_input_scale(op, scale=448.0 / 4.0)
    with torch.inference_mode():
        want = _general(twin, x)
        with monkeypatch.context() as m:
            _no_runner(m)
            got = lin(x)
    assert torch.equal(got, want)


def test_block_scaled_weights_take_the_weight_only_kernel_then_the_block_gemm():
    """128x128 block-scaled FP8 weights (Recipe.blockwise(), or a hub checkpoint) read as FP8 by the kernel,
    each block's scale applied to its part of the sum; above the token limit, x is quantized in 1x128
    blocks and the block-scaled FP8 GEMM runs (DeepSeek's scheme), not a GEMM on the dequantized weight."""
    from float8 import kernels as K

    lin = _linear(k=256, n=384, recipe=Recipe.blockwise(), bias=True)
    w = lin.weight
    assert tuple(w.scale_inv.shape) == (3, 2)
    x = torch.randn(2, 5, 256, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(lin(x), _weight_only(lin, x))
        big = torch.randn(2, weight_only.MAX_TOKENS, 256, dtype=torch.bfloat16)
        data, s = K.quantize_blockwise(big.reshape(-1, 256), 1, 128, torch.float8_e4m3fn)
        want = K.fp8_block_mm_ref(data, s, w.fp8_data, w.scale_inv, lin.bias, torch.bfloat16).reshape(2, -1, 384)
        got = lin(big)
        assert torch.equal(got, want)
        exact = big.double() @ w.dequantize(torch.float32).double().t() + lin.bias.double()
        assert sqnr_db(got.double(), exact) > sqnr_db(_general(lin, big).double(), exact) - 1  # as accurate


@pytest.mark.parametrize("case", ["input requires grad", "float32 input", "bias in float32"])
def test_other_calls_keep_the_general_path(case):
    lin = _linear(bias=case == "bias in float32")
    x = torch.randn(8, lin.in_features, dtype=torch.bfloat16)
    if case == "float32 input":
        x = x.float()
    if case == "bias in float32":
        lin.bias.data = lin.bias.data.float()
    if case == "input requires grad":
        x.requires_grad_(True)
    with pytest.warns() if case == "float32 input" else _nothing():
        y = lin(x)
    with torch.no_grad(), pytest.warns() if case == "float32 input" else _nothing():
        assert torch.equal(y.detach(), _general(lin, x.detach()))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("recipe", [None, Recipe.rowwise()], ids=["tensorwise", "rowwise"])
def test_bias_and_row_scaled_weights(recipe):
    lin = _linear(bias=True, recipe=recipe)
    assert lin.weight.scale_inv.numel() == (1 if recipe is None else lin.out_features)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(lin(x), _weight_only(lin, x))


def test_non_finite_input_gives_non_finite_rows():
    lin = _linear()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    x[1, 7] = float("inf")
    with torch.inference_mode():
        y = lin(x)
    assert not torch.isfinite(y[1]).all() and torch.isfinite(y[[0, 2]]).all()


def test_compiles_fullgraph_with_eagers_bits():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 32)).to(torch.bfloat16)
    ops.convert(model, fp8_weights=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for tokens in (16, 200):  # the weight-only path, then the general one
        x = torch.randn(tokens, 64, dtype=torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(compiled(x), model(x))


# ---- GPU tier ---------------------------------------------------------------------------------------


def _gpu_mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512, bias=True), torch.nn.SiLU(), torch.nn.Linear(512, 256, bias=False)
    ).to("cuda", torch.bfloat16)
    return ops.convert(model, fp8_weights=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_inductor_and_cuda_graphs_give_eagers_bits(mode):
    """Inductor launches the same Triton kernel (the op is a triton_op), so the bits are eager's; under
    CUDA graphs (compile's reduce-overhead) too, replay after replay."""
    model = _gpu_mlp()
    compiled = torch.compile(model, mode=mode)
    for tokens in (1, 16, 128, 200, 16, 1):  # the weight-only kernel, then quantize + FP8 GEMM
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            want = model(x)
            for _ in range(3):
                assert torch.equal(compiled(x), want)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_compiled_split_k_layers_give_eagers_bits(mode):
    """Narrow layers split K (4096 -> 256: 8 column tiles at 16 tokens). A compiled call sums the partials in
    a second kernel, a prepared eager call in its main kernel, in the same order: the same bits, call after
    call and replay after replay."""
    from float8.kernels import weight_only

    torch._dynamo.reset()  # the tests before compiled Sequential.forward too: fullgraph fails past the recompile limit
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4096, 256, bias=True), torch.nn.SiLU(), torch.nn.Linear(256, 4096, bias=False)
    ).to("cuda", torch.bfloat16)
    ops.convert(model, fp8_weights=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert weight_only.plan(16, 256, 4096, 0)[1] > 1 or sms < 16  # the first layer does split K
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    for tokens in (16, 1, 128, 16):
        x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            want = model(x)
            for _ in range(3):
                assert torch.equal(compiled(x), want)


@pytest.mark.gpu
def test_gpu_weight_only_is_closer_to_float64_than_fp8xfp8():
    lin = _gpu_mlp()[0]
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        y = lin(x)
        general = _general(lin, x)
    want = x.double() @ lin.weight.dequantize(torch.float32).double().t() + lin.bias.double()
    assert sqnr_db(y.double(), want) > sqnr_db(general.double(), want)


def test_a_transposed_input_gives_its_contiguous_copys_bits():
    """Memory layout does not pick the numerics: a column-major input takes the weight-only kernel too."""
    lin = _linear(bias=True)
    xt = torch.randn(64, 16, dtype=torch.bfloat16).t()
    with torch.inference_mode():
        assert torch.equal(lin(xt), lin(xt.contiguous()))
        assert torch.equal(lin(xt), _weight_only(lin, xt))
