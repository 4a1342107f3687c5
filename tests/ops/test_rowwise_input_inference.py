"""ops.Linear's inference forward with an FP8-only weight at 33-128 tokens: x quantized per row, then the
row-wise scaled FP8 GEMM (kernels/rowwise_input_mm.py), without the op runner.

Which calls take it (a bf16 input, an E4M3 weight scaled per tensor or per row, K and N multiples of 16)
and which keep the weight-only kernel (fewer tokens, fp16, block-scaled weights), the bits it gives (its
reference on the CPU), its accuracy, compile with eager's bits, and on the GPU the prepared repeat calls:
the same bits as the first call, and a weight's new scale seen after a load.
"""

import pytest
import torch

import float8.ops as ops
from float8 import Recipe
from float8.kernels import rowwise_input_mm, weight_only
from float8.ops.base import BasicOp
from tests.ops.test_weight_only_inference import _linear, _weight_only
from tests.tolerances import SQNR_DB, sqnr_db


def _rowwise(lin, x):
    w = lin.weight
    y = rowwise_input_mm.fp8_rowwise_input_mm_ref(x.reshape(-1, lin.in_features), w.fp8_data, w.scale_inv, lin.bias)
    return y.reshape(*x.shape[:-1], lin.out_features)


def _exact(lin, x):
    y = x.double() @ lin.weight.dequantize(torch.float32).double().t()
    return y if lin.bias is None else y + lin.bias.double()


def test_the_token_range():
    assert rowwise_input_mm.MIN_TOKENS == 33 and weight_only.MAX_TOKENS == 128


@pytest.mark.parametrize("shape", [(33, 64), (64, 64), (128, 64), (2, 40, 64)])
@pytest.mark.parametrize("recipe", [None, Recipe.rowwise()], ids=["tensor-scaled weight", "row-scaled weight"])
@pytest.mark.parametrize("bias", [False, True])
def test_33_to_128_tokens_take_the_rowwise_input_gemm(shape, recipe, bias, monkeypatch):
    lin = _linear(bias=bias, recipe=recipe)
    x = torch.randn(shape, dtype=torch.bfloat16)
    monkeypatch.setattr(BasicOp, "forward", lambda *a, **k: pytest.fail("the op runner ran"))
    with torch.inference_mode():
        y = lin(x)
    assert y.shape == (*shape[:-1], 48)
    assert torch.equal(y, _rowwise(lin, x))
    assert not torch.equal(y, _weight_only(lin, x))
    assert sqnr_db(_exact(lin, x), y) >= SQNR_DB["linear"]


@pytest.mark.parametrize("case", ["32 tokens", "129 tokens", "fp16 input", "block-scaled weight"])
def test_other_calls_do_not_take_it(case):
    k, n, recipe, dtype, tokens = 256, 48, None, torch.bfloat16, 64
    if case == "32 tokens":
        tokens = 32
    if case == "129 tokens":
        tokens = 129
    if case == "fp16 input":
        dtype = torch.float16
    if case == "block-scaled weight":
        n, recipe = 384, Recipe.blockwise()
    lin = _linear(k=k, n=n, recipe=recipe, dtype=dtype)
    x = torch.randn(tokens, k, dtype=dtype)
    with torch.inference_mode():
        y = lin(x)
        if tokens <= weight_only.MAX_TOKENS:
            assert torch.equal(y, _weight_only(lin, x))
        else:
            assert torch.equal(y, BasicOp.forward(lin, x))
    if dtype == torch.bfloat16 and case != "block-scaled weight":
        assert not torch.equal(y, _rowwise(lin, x))


def test_compiles_fullgraph_with_eagers_bits():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 32)).to(torch.bfloat16)
    ops.convert(model, fp8_weights=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for tokens in (16, 64, 200):  # weight-only, row-wise input, the general path
        x = torch.randn(tokens, 64, dtype=torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(compiled(x), model(x))


# ---- GPU tier ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_repeat_calls_are_prepared_and_give_the_first_calls_bits():
    lin = _linear(k=512, n=256, bias=True, device="cuda")
    x = torch.randn(2, 48, 512, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        first = lin(x)
        prepared = lin._inference_plans.get((x.shape, x.dtype))
        assert isinstance(prepared, rowwise_input_mm.PreparedRowwiseMM)
        for _ in range(3):
            assert torch.equal(lin(x), first)
        x2 = torch.randn_like(x)
        assert torch.equal(lin(x2), rowwise_input_mm.fp8_rowwise_input_mm(x2.view(96, 512), *_w(lin)).view(2, 48, 256))


def _w(lin):
    return lin.weight.fp8_data, lin.weight.scale_inv, lin.bias


@pytest.mark.gpu
def test_gpu_a_loaded_weight_is_used_by_the_next_prepared_call():
    """Loading another checkpoint, or writing the scale in place, changes what the next prepared call
    multiplies by."""
    lin = _linear(k=256, n=128, device="cuda", seed=0)
    other = _linear(k=256, n=128, device="cuda", seed=1)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        for _ in range(2):
            lin(x)
        lin.load_state_dict(other.state_dict())
        assert torch.equal(lin(x), other(x))
        lin.weight.scale_inv.mul_(2)  # in place: the quantize kernel reads it at every call
        assert torch.equal(lin(x), rowwise_input_mm.fp8_rowwise_input_mm(x, *_w(lin)))
