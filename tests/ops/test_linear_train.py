"""The eager training path of a lone ops.Linear (ops/linear_train.py) against the general path (the op
runner, which the same Linear takes inside an ops.Sequential): the same bits for the output and every
gradient, the same refusals, and the general path wherever the fast one does not apply."""

import copy
import weakref

import pytest
import torch

import float8.ops as ops
from float8 import Float8Tensor, Format, Recipe, TensorwiseScaling
from float8.scaling import DelayedScaling

# The CUDA cases belong to the GPU tier (pytest -m gpu).
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])
TRAIN_NODE = "_TrainLinearBackward"


def _pair(k, n, bias, recipe=None, w_dtype=torch.bfloat16, device="cpu"):
    torch.manual_seed(0)
    fast = ops.Linear(k, n, bias=bias, recipe=recipe).to(device, w_dtype)
    general = ops.Sequential(copy.deepcopy(fast))  # the same op, run by the op runner
    return fast, general


def _step(model, x, dy):
    x = x.detach().clone().requires_grad_(x.requires_grad)
    y = model(x)
    y.backward(dy)
    lin = model if isinstance(model, ops.Linear) else model[0]
    grads = [lin.weight.grad] + ([lin.bias.grad] if lin.bias is not None else [])
    return y, x.grad, grads


def _same(a, b):
    if a is None or b is None:
        assert a is None and b is None
        return
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b), (a - b).abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("lead", [(32,), (2, 16)])
@pytest.mark.parametrize(
    "x_dtype,w_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.bfloat16, torch.float32)],
)
# 256 x 64: not a small weight, so the backward quantizes it again
@pytest.mark.parametrize("k", [48, 256], ids=["small-weight", "weight-quantized-again"])
def test_same_bits_as_the_op_runner(device, bias, x_grad, lead, x_dtype, w_dtype, k):
    recipe = Recipe(min_fp8_gemm_flops=0)
    fast, general = _pair(k, 64, bias, recipe, w_dtype, device)
    x = (torch.randn(*lead, k, device=device) * 3).to(x_dtype).requires_grad_(x_grad)
    dy = torch.randn(*lead, 64, device=device).to(x_dtype)
    y = fast(x.detach().requires_grad_(x_grad))
    assert type(y.grad_fn).__name__ == TRAIN_NODE  # the fast path ran
    assert type(general(x).grad_fn).__name__ != TRAIN_NODE
    for a, b in zip(_flat(_step(fast, x, dy)), _flat(_step(general, x, dy))):
        _same(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", ["none", "trained", "frozen"])
@pytest.mark.parametrize("lead", [(32,), (2, 16)])
@pytest.mark.parametrize("k", [48, 256], ids=["small-weight", "large-weight"])
def test_frozen_weight_same_bits_as_the_op_runner(device, bias, lead, k):
    """A frozen weight (fine-tuning adapters around it): the input's and the bias's gradients, over steps in
    which the bias moves, from the weight's cached FP8 copy, as the general path."""
    fast, general = _pair(k, 64, bias != "none", Recipe(min_fp8_gemm_flops=0), device=device)
    for model in (fast, general[0]):
        model.weight.requires_grad_(False)
        if bias == "frozen":
            model.bias.requires_grad_(False)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad] or [torch.zeros(1)], lr=0.1)
            for m in (fast, general)]  # fmt: skip
    for _ in range(3):
        x = (torch.randn(*lead, k, device=device) * 3).to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn(*lead, 64, device=device).to(torch.bfloat16)
        assert type(fast(x.detach().requires_grad_(True)).grad_fn).__name__ == TRAIN_NODE
        results = []
        for model, opt in zip((fast, general), opts):
            opt.zero_grad()
            xi = x.detach().clone().requires_grad_(True)
            y = model(xi)
            y.backward(dy)
            lin = model if isinstance(model, ops.Linear) else model[0]
            results.append([y, xi.grad, lin.weight.grad] + ([lin.bias.grad] if bias != "none" else []))
            opt.step()
        for a, b in zip(*results):
            _same(a, b)
    assert fast._weight_cache.w8 is not None  # the frozen weight's FP8 copy is cached, as on the general path


def _flat(result):
    y, dx, grads = result
    return [y, dx, *grads]


@pytest.mark.parametrize(
    "recipe",
    [
        Recipe(min_fp8_gemm_flops=0, fprop_fast_accum=False),
        Recipe(min_fp8_gemm_flops=0, format=Format.E4M3),
        Recipe(min_fp8_gemm_flops=0, input=TensorwiseScaling(margin=1), grad=TensorwiseScaling(power_of_2=True)),
    ],
    ids=["no-fast-accum", "e4m3-gradients", "margin-power-of-2"],
)
def test_same_bits_under_other_per_tensor_settings(recipe):
    fast, general = _pair(32, 48, True, recipe)
    x = torch.randn(64, 32).to(torch.bfloat16).requires_grad_(True)
    dy = torch.randn(64, 48).to(torch.bfloat16)
    assert type(fast(x).grad_fn).__name__ == TRAIN_NODE
    for a, b in zip(_flat(_step(fast, x, dy)), _flat(_step(general, x, dy))):
        _same(a, b)


@pytest.mark.parametrize("k,n,small", [(32, 48, True), (256, 64, False)])
def test_keeps_the_input_transpose_a_small_weights_transpose_and_the_parameters(k, n, small):
    lin = ops.Linear(k, n, bias=True, recipe=Recipe(min_fp8_gemm_flops=0)).to(torch.bfloat16)
    x = torch.randn(64, k, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    x_t, scale_inv, w_t, w_scale_inv = y.grad_fn.state
    assert x_t.dtype == torch.float8_e4m3fn and tuple(x_t.shape) == (k, 64) and scale_inv.dim() == 0
    if small:  # 1 byte per weight element, at most 16 KiB: one quantization fewer in the backward
        assert tuple(w_t.shape) == (k, n) and w_scale_inv.dim() == 0
    else:  # the backward quantizes the weight again
        assert w_t is None and w_scale_inv is None
    assert [t.data_ptr() for t in y.grad_fn.saved_tensors] == [lin.weight.data_ptr(), lin.bias.data_ptr()]


def test_backward_lets_the_input_transpose_go_before_the_input_gradient(monkeypatch):
    """As the general path: the saved FP8 input is freed after the weight gradient's GEMM, before the input
    gradient's (the backward's largest output when K > N)."""
    lin = ops.Linear(256, 256, bias=False, recipe=Recipe(min_fp8_gemm_flops=0)).to(torch.bfloat16)
    y = lin(torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True))
    x_t = weakref.ref(y.grad_fn.state[0])
    alive, scaled_mm = [], torch._scaled_mm

    def spy(*args, **kwargs):
        alive.append(x_t() is not None)
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    y.backward(torch.ones_like(y))
    assert alive == [True, False]


class _FP8Gradient(torch.autograd.Function):
    """The identity, whose backward hands the gradient on as a Float8Tensor (a custom op after the Linear)."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        return Float8Tensor.quantize(dy, torch.float8_e4m3fn, with_transpose=True)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [64, 256], ids=["small-weight", "weight-quantized-again"])
def test_fp8_output_gradient_same_bits_as_the_op_runner(bias, k):
    fast, general = _pair(k, 48, bias, Recipe(min_fp8_gemm_flops=0))
    x = torch.randn(32, k).to(torch.bfloat16)
    dy = torch.randn(32, 48).to(torch.bfloat16)
    results = []
    for model in (fast, general):
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        _FP8Gradient.apply(y).backward(dy)
        lin = model if isinstance(model, ops.Linear) else model[0]
        results.append([y, xi.grad, lin.weight.grad] + ([lin.bias.grad] if bias else []))
    for a, b in zip(*results):
        _same(a, b)


def _gather_weight(lin, fp8_dtype=torch.float8_e4m3fn):
    """Put in the Linear's weight what FSDP2's FP8 all-gather leaves there (float8/fsdp.py
    fsdp_post_all_gather): a Float8Tensor parameter of the master's bits, marked as a trained master's copy."""
    w8 = Float8Tensor.quantize(lin.weight.detach(), fp8_dtype=fp8_dtype)
    gathered = Float8Tensor(w8._data, w8._scale_inv, lin.weight.dtype)
    gathered._gathered_master = True
    lin._parameters["weight"] = torch.nn.Parameter(gathered)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fp8_dy", [False, True], ids=["bf16-dy", "fp8-dy"])
def test_fsdp_gathered_fp8_weight_same_bits_as_the_op_runner(device, bias, fp8_dy):
    """FSDP2's FP8 all-gather leaves each Linear a Float8Tensor weight; eager steps of a converted model used to
    take the op runner for it (docs/distributed.md). This path takes it: the same output and gradients (the
    weight's in high precision, for the master), and the bits of both are read as they are."""
    fast, general = _pair(64, 48, bias, Recipe(min_fp8_gemm_flops=0), device=device)
    for lin in (fast, general[0]):
        _gather_weight(lin)
    x = (torch.randn(2, 16, 64, device=device) * 3).to(torch.bfloat16)
    dy = torch.randn(2, 16, 48, device=device).to(torch.bfloat16)
    results = []
    for model in (fast, general):
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        assert (type(y.grad_fn).__name__ == TRAIN_NODE) == (model is fast)
        (_FP8Gradient.apply(y) if fp8_dy else y).backward(dy)
        lin = model if isinstance(model, ops.Linear) else model[0]
        assert type(lin.weight.grad) is torch.Tensor and lin.weight.grad.dtype == torch.bfloat16
        results.append([y, xi.grad, lin.weight.grad] + ([lin.bias.grad] if bias else []))
    for a, b in zip(*results):
        _same(a, b)


@pytest.mark.parametrize("case", ["e5m2", "frozen", "fp8-only"])
def test_a_gathered_weight_this_path_does_not_take_runs_the_general_path(case):
    lin = ops.Linear(32, 32, bias=False, recipe=Recipe(min_fp8_gemm_flops=0)).to(torch.bfloat16)
    _gather_weight(lin, torch.float8_e5m2 if case == "e5m2" else torch.float8_e4m3fn)
    if case == "frozen":
        lin.weight.requires_grad_(False)
    elif case == "fp8-only":
        lin.weight._gathered_master = False
        lin.weight.requires_grad_(False)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    assert _general(lin, x)


def test_a_replaced_weight_of_the_wrong_shape_is_refused_as_the_general_path_refuses_it():
    lin = ops.Linear(64, 48, bias=False, recipe=Recipe(min_fp8_gemm_flops=0)).to(torch.bfloat16)
    lin.weight = torch.nn.Parameter(torch.randn(32, 64, dtype=torch.bfloat16))
    with pytest.raises((ValueError, RuntimeError)):
        lin(torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)).sum().backward()


def test_second_backward_is_refused_by_name_and_retain_graph_keeps_the_state():
    lin = ops.Linear(32, 32, bias=False, recipe=Recipe(min_fp8_gemm_flops=0)).to(torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy, retain_graph=True)
    first = lin.weight.grad.clone()
    y.backward(dy)  # the state was kept by retain_graph
    torch.testing.assert_close(lin.weight.grad, 2 * first)
    with pytest.raises(RuntimeError, match="second time|second backward"):
        y.backward(dy)  # torch's own error: the parameters were saved through autograd


def test_weight_written_in_place_between_forward_and_backward_is_refused():
    lin = ops.Linear(32, 32, bias=False, recipe=Recipe(min_fp8_gemm_flops=0)).to(torch.bfloat16)
    y = lin(torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True))
    with torch.no_grad():
        lin.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_weight_written_through_data_between_forward_and_backward_is_quantized_again():
    """A write through .data moves no version counter, so autograd runs the backward; like the general path,
    the input gradient's GEMM then reads the new values quantized with their own scale (a review found that
    a cast with the forward's amax, tried 2026-11-28, saturated them)."""
    recipe = Recipe(min_fp8_gemm_flops=0)
    fast, general = _pair(256, 64, False, recipe)
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    dy = torch.randn(32, 64, dtype=torch.bfloat16)
    dxs = []
    for model, lin in ((fast, fast), (general, general[0])):
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        assert (type(y.grad_fn).__name__ == TRAIN_NODE) == (model is fast)
        lin.weight.data.mul_(3)  # values above the forward's amax
        y.backward(dy)
        dxs.append(xi.grad)
    _same(*dxs)


def test_output_takes_an_in_place_write():
    lin = ops.Linear(32, 32, bias=False, recipe=Recipe(min_fp8_gemm_flops=0)).to(torch.bfloat16)
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    y = torch.nn.ReLU(inplace=True)(lin(x))
    y.sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def _general(lin, x):
    y = lin(x)
    return type(y.grad_fn).__name__ != TRAIN_NODE


@pytest.mark.parametrize(
    "case",
    ["tokens-not-multiple-of-16", "float32-input", "frozen-weight-and-input", "no-grad", "autocast", "delayed", "rowwise",
     "lean", "high-precision", "1-d-input"],
)  # fmt: skip
def test_falls_back_to_the_general_path(case):
    recipe = Recipe(min_fp8_gemm_flops=0)
    if case == "delayed":
        recipe = Recipe(min_fp8_gemm_flops=0, input=DelayedScaling())
    elif case == "rowwise":
        recipe = Recipe.rowwise()
    elif case == "lean":
        recipe = Recipe(min_fp8_gemm_flops=0, lean_activations=True)
    lin = ops.Linear(32, 32, bias=False, recipe=recipe).to(torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    if case == "tokens-not-multiple-of-16":
        x = torch.randn(10, 32, dtype=torch.bfloat16, requires_grad=True)
    elif case == "float32-input":
        lin.float()
        x = x.float()
    elif case == "frozen-weight-and-input":
        lin.weight.requires_grad_(False)
        x.requires_grad_(False)
    elif case == "1-d-input":
        x = torch.randn(32, dtype=torch.bfloat16, requires_grad=True)
    if case == "no-grad":
        with torch.no_grad():
            assert lin(x).grad_fn is None
        return
    if case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert _general(lin, x)
        return
    if case == "high-precision":
        with ops.high_precision(lin):
            assert _general(lin, x)
        return
    with pytest.warns() if case == "float32-input" else _nothing():
        assert _general(lin, x)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_converted_model_trains_on_the_fast_path_like_the_runner():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).to(torch.bfloat16)
    fast = ops.convert(copy.deepcopy(model), recipe=Recipe(min_fp8_gemm_flops=0))
    general = ops.convert(copy.deepcopy(model), recipe=Recipe(min_fp8_gemm_flops=0))
    general[0], general[2] = ops.Sequential(general[0]), ops.Sequential(general[2])
    x = torch.randn(4, 16, 32, dtype=torch.bfloat16)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (fast, general)]
    for _ in range(3):
        losses = []
        for m, opt in zip((fast, general), opts):
            opt.zero_grad()
            loss = m(x).float().square().mean()
            loss.backward()
            opt.step()
            losses.append(loss)
        assert torch.equal(losses[0], losses[1])
    for a, b in zip(fast.parameters(), general.parameters()):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(16, 64, 64), (32, 128, 96), (1024, 512, 256)], ids=["tiny", "small", "tiled"])
def test_gpu_repeated_steps_same_bits_as_the_op_runner(bias, shape):
    """Steps after the first run the prepared quantizations (tiny and small shapes): still the runner's bits,
    AdamW updates included."""
    m, k, n = shape
    fast, general = _pair(k, n, bias, Recipe(min_fp8_gemm_flops=0), device="cuda")
    opts = [torch.optim.AdamW(mod.parameters(), lr=1e-2) for mod in (fast, general)]
    for step in range(4):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        results = []
        for mod, opt in zip((fast, general), opts):
            opt.zero_grad()
            results.append(_flat(_step(mod, x, dy)))
            opt.step()
        for a, b in zip(*results):
            _same(a, b)
    plan = next(iter(fast._train_plans.values()))
    prepared = [bool(getattr(plan, r)) for r in ("x", "w", "dy", "w_t")]

    def small(a, b):
        return a <= 128 and b <= 128

    # A small weight is quantized with its transpose in the forward ("w_t"), "w" never; with a bias, dy's
    # quantization is the bias gradient's fused kernel, not prepared.
    assert prepared == [small(m, k), False, not bias and small(m, n), small(n, k)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_a_first_call_that_cannot_be_prepared_is_prepared_later():
    lin = ops.Linear(64, 64, bias=False, recipe=Recipe(min_fp8_gemm_flops=0)).to("cuda", torch.bfloat16)
    buf = torch.randn(16 * 64 + 1, device="cuda").to(torch.bfloat16)
    misaligned = buf[1:].view(16, 64).requires_grad_(True)  # 2 bytes off: the kernel compiles unaligned
    lin(misaligned).sum().backward()
    plan = next(iter(lin._train_plans.values()))
    assert plan.x is None  # not prepared, and not given up on
    lin(torch.randn(16, 64, device="cuda").to(torch.bfloat16).requires_grad_(True)).sum().backward()
    assert plan.x


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_graphed_steps_of_a_tiny_linear_equal_eager_ones():
    """Prepared launches inside a CUDA graph (make_graphed_callables warms up, then captures them): each
    replay quantizes that step's input and weight, and the steps give the eager steps' bits."""
    torch.manual_seed(0)
    eager = ops.Linear(64, 64, bias=False, recipe=Recipe(min_fp8_gemm_flops=0)).cuda().to(torch.bfloat16)
    graphed_model = copy.deepcopy(eager)
    x0 = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(graphed_model, (x0,))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, graphed_model)]
    for _ in range(3):
        x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
        got = []
        for model, fn, opt in ((eager, eager, opts[0]), (graphed_model, graphed, opts[1])):
            opt.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            y = fn(xi)
            y.backward(dy)
            got.append([y.detach().clone(), xi.grad.clone(), model.weight.grad.clone()])
            opt.step()
        for a, b in zip(*got):
            assert torch.equal(a, b)
    assert next(iter(eager._train_plans.values())).x  # the eager steps ran prepared launches too
