"""Recipe(lean_activations=True): activations keep an E4M3 copy of their input, and a Linear takes its FP8
input and gradient in rows only, making the transposes in its backward (ops/activations.py, ops/linear.py).
The forward is unchanged; rows-only layouts change no bit; the rounded input moves gradients by less than
the FP8 backward's own rounding; the peak memory of a step falls (GPU)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import float8.ops as ops
from float8 import BlockwiseScaling, Format, Recipe, RowwiseScaling, TensorwiseScaling
from float8.ops.base import OpContext, RunState
from tests.tolerances import sqnr_db

LEAN = Recipe(lean_activations=True)


def mlp(act: str, recipe: Recipe, d=64, f=96, bias=False):
    width = 2 * f if act == "swiglu" else f
    activation = {"swiglu": ops.SwiGLU, "gelu": ops.GELU, "relu": ops.ReLU, "silu": ops.SiLU}[act]()
    return ops.Sequential(
        ops.RMSNorm(d), ops.Linear(d, width, bias=bias), activation, ops.Linear(f, d, bias=bias), recipe=recipe
    )


def run(model, x, dy):
    x = x.clone().requires_grad_(True)
    y = model(x)
    y.backward(dy)
    return [y, x.grad] + [p.grad for p in model.parameters()]


def pair(act, bias=False, recipe=Recipe()):
    torch.manual_seed(0)
    plain = mlp(act, recipe, bias=bias).to(torch.bfloat16)
    lean = copy.deepcopy(plain)
    for op in lean:
        op.set_recipe(dataclasses.replace(recipe, lean_activations=True), overwrite=True)
    x = torch.randn(3, 40, 64, dtype=torch.bfloat16)
    dy = torch.randn(3, 40, 64, dtype=torch.bfloat16)
    return run(plain, x, dy), run(lean, x, dy)


def test_recipe_field_is_checked():
    assert Recipe().lean_activations is False
    with pytest.raises(TypeError, match="lean_activations must be a bool"):
        Recipe(lean_activations=1)


@pytest.mark.parametrize("bias", [False, True])
def test_relu_keeps_its_input_and_rows_only_gradients_change_no_bit(bias):
    # ReLU saves its high-precision input under the lean recipe too; what changes is the gradient's layout
    # (rows, transposed by the GEMM that needs it): the same bits everywhere.
    plain, lean = pair("relu", bias)
    for a, b in zip(plain, lean):
        assert torch.equal(a, b)


@pytest.mark.parametrize("act", ["swiglu", "gelu", "silu"])
@pytest.mark.parametrize("bias", [False, True])
def test_smooth_kinds_same_forward_and_gradients_within_fp8_rounding(act, bias):
    plain, lean = pair(act, bias)
    assert torch.equal(plain[0], lean[0]), "the forward does not change"
    for a, b in zip(plain[1:], lean[1:]):
        assert sqnr_db(a, b) >= 20, "the rounded input moves gradients by FP8 rounding at most"


def test_delayed_scaling_works_lean():
    plain, lean = pair("swiglu", recipe=Recipe.delayed())
    assert torch.equal(plain[0], lean[0])
    assert all(torch.isfinite(g).all() for g in lean[1:])


@pytest.mark.parametrize("scaling", [RowwiseScaling(), BlockwiseScaling((1, 128))], ids=["rowwise", "block"])
def test_per_tensor_weight_with_other_input_scaling_works_lean(scaling):
    # The weight quantizer alone would allow re-quantizing the weight; the input's layout picks GEMMs that
    # read the forward's weight copy, so it is kept (a review found the backward crashing here).
    recipe = Recipe(Format.E4M3, input=scaling, weight=TensorwiseScaling(), grad=scaling)
    torch.manual_seed(0)
    plain = ops.Sequential(
        ops.Linear(128, 128, bias=False), ops.GELU(), ops.Linear(128, 128, bias=False), recipe=recipe
    )
    plain = plain.to(torch.bfloat16)
    lean = copy.deepcopy(plain)
    for op in lean:
        op.set_recipe(dataclasses.replace(recipe, lean_activations=True), overwrite=True)
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    dy = torch.randn(32, 128, dtype=torch.bfloat16)
    a, b = run(plain, x, dy), run(lean, x, dy)
    assert torch.equal(a[0], b[0])
    for u, v in zip(a[1:], b[1:]):
        assert sqnr_db(u, v) >= 20


def _saved(act, request=None, grad=True):
    op = {"swiglu": ops.SwiGLU, "gelu": ops.GELU, "relu": ops.ReLU}[act](recipe=LEAN)
    ctx = OpContext(RunState(grad))
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    op.activation_forward(ctx, x, request)
    return ctx, x


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_smooth_kinds_save_one_byte_per_element(act):
    from float8.quantizer import QuantRequest

    request = QuantRequest(Recipe().quantizers().input, True)
    for r in (request, None):  # fused with the next Linear's FP8 request, and on its own
        ctx, x = _saved(act, r)
        assert ctx.saved.dtype == torch.float8_e4m3fn and ctx.saved.shape == x.shape
        assert ctx.x_scale_inv.dtype == torch.float32 and ctx.x_scale_inv.dim() == 0
    ctx, x = _saved(act, request, grad=False)  # no backward to run: nothing quantized for it
    assert ctx.saved is x and ctx.x_scale_inv is None


def test_relu_saves_its_input():
    ctx, x = _saved("relu")
    assert ctx.saved is x and ctx.x_scale_inv is None


def test_linear_asks_for_rows_only_and_saves_rows():
    x = torch.randn(16, 32, dtype=torch.bfloat16)
    for recipe, with_t in ((Recipe(), True), (LEAN, False)):
        lin = ops.Linear(32, 32, recipe=recipe).to(torch.bfloat16)
        assert lin.input_request(True, 16).with_transpose is with_t
        assert lin.grad_request().with_transpose is with_t
        ctx = OpContext(RunState(True))
        lin.op_forward(ctx, x)
        assert lin.grad_request(ctx).with_transpose is with_t
        saved = ctx.saved.x  # the input for the weight gradient: column-major by default, rows when lean
        assert saved.data.is_contiguous() is not with_t and saved.transpose is None


@pytest.mark.parametrize("recipe", [LEAN, Recipe()], ids=["lean", "default"])
def test_weight_is_quantized_again_in_backward_not_kept(recipe):
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    lin = ops.Linear(32, 32, bias=False, recipe=recipe).to(torch.bfloat16)
    ctx = OpContext(RunState(True))
    lin.op_forward(ctx, x)
    assert ctx.saved.w is None and ctx.saved.rebuild[0] is lin.weight  # nothing FP8 of the weight held
    frozen = ops.Linear(32, 32, bias=False, recipe=recipe).to(torch.bfloat16).requires_grad_(False)
    ctx = OpContext(RunState(True))
    frozen.op_forward(ctx, x)  # a frozen weight's copies are cached across steps: the cache serves both
    assert ctx.saved.w is not None and ctx.saved.rebuild is None
    for recipe in (Recipe.delayed(), Recipe.rowwise()):  # stateful or not per-tensor: kept as before
        other = ops.Linear(32, 32, bias=False, recipe=dataclasses.replace(recipe, lean_activations=True))
        ctx = OpContext(RunState(True))
        other.to(torch.bfloat16).op_forward(ctx, x)
        assert ctx.saved.w is not None and ctx.saved.rebuild is None


def test_weight_written_between_forward_and_backward_is_refused():
    lin = ops.Linear(32, 32, bias=False, recipe=LEAN).to(torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2)
    # Autograd's own version check on the saved parameters refuses it first (ops/runner.py), as for torch.nn.
    with pytest.raises(RuntimeError, match="modified by an inplace operation|weight was modified in place after"):
        y.sum().backward()


def _float64_grads(model, x, dy):
    """Gradients of the same weights in float64 (the reference of both recipes)."""
    from tests.ops.test_gpu_ops import _hp_forward

    ref = copy.deepcopy(model).double()
    xd = x.double().requires_grad_(True)
    _hp_forward(ref, xd).backward(dy.double())
    return [xd.grad] + [p.grad for p in ref.parameters()]


@pytest.mark.parametrize("act", ["swiglu", "gelu"])
def test_gradients_against_float64_within_a_db_of_the_default(act):
    # Measured here (CPU, 512 tokens, d 256, 4 seeds), SQNR against float64: dx and the first weight's
    # gradient 20.7-20.8 -> 20.3-20.4 dB with SwiGLU, 21.3 -> 21.2-21.3 with GELU; the second weight's
    # unchanged; the norm weight's (a 256-vector) moves by up to 1 dB either way.
    torch.manual_seed(0)
    model = mlp(act, Recipe(), d=256, f=512).to(torch.bfloat16)
    lean = copy.deepcopy(model)
    for op in lean:
        op.set_recipe(LEAN, overwrite=True)
    x = torch.randn(512, 256, dtype=torch.bfloat16)
    dy = torch.randn(512, 256, dtype=torch.bfloat16)
    ref = _float64_grads(model, x, dy)
    plain, leaner = run(model, x, dy)[1:], run(lean, x, dy)[1:]
    for r, a, b in zip(ref, plain, leaner):
        assert sqnr_db(r, b) >= sqnr_db(r, a) - 1.25


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lean_step_peaks_lower_and_trains_alike():
    # An MLP step on the GPU: the peak of forward+backward falls by about the activation's input bytes
    # (half of them) and the gradient transpose (the other layout of the gradient), and gradients agree.
    def peak_and_grads(recipe):
        torch.manual_seed(0)
        model = (
            mlp("swiglu", dataclasses.replace(recipe, min_fp8_gemm_flops=0), d=1024, f=4096).cuda().to(torch.bfloat16)
        )
        x = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        run(model, x, dy)  # warm-up: kernels compiled, nothing kept
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = run(model, x, dy)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, out

    plain_peak, plain = peak_and_grads(Recipe())
    lean_peak, lean = peak_and_grads(LEAN)
    # The SwiGLU input (8192 x 8192 bf16, 128 MiB) is saved in 64 MiB, and neither the SwiGLU output's nor
    # its gradient's two FP8 layouts (64 MiB each) are alive together: the peak falls by 64 MiB at least.
    assert lean_peak <= plain_peak - 64 * 2**20, (plain_peak / 2**20, lean_peak / 2**20)
    assert torch.equal(plain[0], lean[0])
    for a, b in zip(plain[1:], lean[1:]):
        assert sqnr_db(a, b) >= 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rows_only_layouts_change_no_bit():
    # ReLU keeps its input, so only the layouts change: the transposes made in the backward (the FP8
    # transpose kernel) feed cuBLASLt the same bits, and every output and gradient is the same.
    torch.manual_seed(0)
    plain = mlp("relu", Recipe(min_fp8_gemm_flops=0), d=512, f=1024, bias=True).cuda().to(torch.bfloat16)
    lean = copy.deepcopy(plain)
    for op in lean:
        op.set_recipe(Recipe(min_fp8_gemm_flops=0, lean_activations=True), overwrite=True)
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    for a, b in zip(run(plain, x, dy), run(lean, x, dy)):
        assert torch.equal(a, b)


def test_compiled_linear_saves_its_input_and_quantizes_it_again_with_the_same_bits():
    """requantize_input (a Linear under torch.compile): the high-precision input is what the forward keeps,
    and the backward's quantization of it gives the eager path's gradients to the bit."""
    from float8.ops.linear_engine import linear_bwd, linear_fwd, quantize_weight

    torch.manual_seed(0)
    lin = ops.Linear(64, 32, bias=False, recipe=LEAN).to(torch.bfloat16)
    x, dy = torch.randn(16, 64, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    w8, wd = quantize_weight(lin.weight, lin.quantizers.weight, True)
    grads = []
    for requantize in (False, True):
        y, saved = linear_fwd(
            x, w8, wd, None, lin.quantizers, need_wgrad=True, need_dgrad=True, fast_accum=True,
            rows_only=True, requantize_input=requantize,
        )  # fmt: skip
        assert (saved.x is x) is requantize  # the input itself: nothing FP8 of it kept
        grads.append((y, *linear_bwd(dy, saved, lin.quantizers, torch.bfloat16)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", [LEAN, Recipe()], ids=["lean", "default"])
def test_compiled_converted_block_equals_eager_bits(recipe):
    """A converted Llama block compiled fullgraph with aot_eager (the Linears keep their inputs and quantize
    them in torch operations, again in the backward) gives eager's output and gradients to the bit."""
    from benchmarks.distributed import Block

    torch.manual_seed(0)
    base = Block(64, 4, 2, 16, 128).to(torch.bfloat16)
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    out = []
    for backend in (None, "aot_eager"):
        # fuse_swiglu=False: compiled code runs torch's own SwiGLU backward (tests/ops/test_swiglu_fusion.py)
        model = ops.convert(copy.deepcopy(base), recipe=recipe, fuse_swiglu=False)
        run_model = torch.compile(model, backend=backend, fullgraph=True) if backend else model
        xi = x.clone().requires_grad_(True)
        y = run_model(xi)
        y.float().square().sum().backward()
        out.append([y, xi.grad] + [p.grad for p in model.parameters()])
    for a, b in zip(*out):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")]),
    ],
)
def test_quantize_in_torch_ops_gives_the_kernels_bits_and_refuses_other_quantizers(device):
    from float8.quantizer import RowwiseQuantizer, TensorwiseQuantizer, quantize_in_torch_ops

    x = torch.randn(48, 80, dtype=torch.bfloat16, device=device) * 3
    for q in (TensorwiseQuantizer(), TensorwiseQuantizer(torch.float8_e5m2, margin=1, power_of_2=True)):
        a, b = q._quantize(x, True), quantize_in_torch_ops(q, x, True)
        assert torch.equal(a._data.view(torch.uint8), b._data.view(torch.uint8))
        assert torch.equal(a._transpose.view(torch.uint8), b._transpose.view(torch.uint8))
        assert torch.equal(a._scale_inv, b._scale_inv)
    with pytest.raises(ValueError, match="current per-tensor scaling"):
        quantize_in_torch_ops(RowwiseQuantizer(), x, False)
