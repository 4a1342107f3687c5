"""Clear errors for bad input to the ops, delayed-scaling state in checkpoints, and the functional primitive."""

import inspect

import pytest
import torch

import float8.ops as ops
from float8 import DelayedScalingState, Float8Tensor, Recipe, RowwiseScaling
from tests.tolerances import assert_same_bits

pytestmark = pytest.mark.filterwarnings("ignore::float8.ops.Float8PrecisionWarning")


@pytest.mark.parametrize("sizes", [(0, 16), (16, 0), (-1, 16)])
def test_empty_linear_is_refused(sizes):
    with pytest.raises(ValueError, match="positive int"):
        ops.Linear(*sizes)


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        ops.Linear(16, 16, False)
    with pytest.raises(TypeError):
        ops.RMSNorm(16, 1e-5)
    with pytest.raises(TypeError):
        ops.GELU("tanh")


@pytest.mark.parametrize("shape", [(16,), (2, 16, 16)])
def test_functional_linear_wrong_rank_weight(shape):
    with pytest.raises(ValueError, match="weight must be 2-D"):
        ops.functional.linear(torch.randn(4, 16), torch.randn(*shape))


def test_functional_norm_wrong_rank_weight():
    with pytest.raises(ValueError, match="weight must be 1-D"):
        ops.functional.rms_norm(torch.randn(4, 16), torch.randn(16, 16))
    with pytest.raises(ValueError, match="weight must be 1-D"):
        ops.functional.layer_norm(torch.randn(4, 16), torch.randn(1, 16))


def test_in_place_on_a_transposed_rowwise_tensor():
    w8 = Float8Tensor.quantize(torch.randn(16, 32), scaling=RowwiseScaling())
    with pytest.raises(ValueError, match="transposed row-wise"), pytest.warns(Warning, match="add_"):
        w8.t().add_(1)


def test_fp8_weight_that_requires_grad_is_refused():
    lin = ops.Linear(32, 16, bias=False)
    lin.weight = torch.nn.Parameter(Float8Tensor.quantize(lin.weight.detach()))  # requires_grad=True
    with pytest.raises(ValueError, match="no high-precision master"):
        lin(torch.randn(4, 32))
    with torch.no_grad():
        lin(torch.randn(4, 32))  # inference is fine
    with pytest.raises(ValueError, match="no high-precision master"):
        ops.functional.linear(torch.randn(4, 32), lin.weight)


def _delayed_block():
    torch.manual_seed(0)
    return ops.Sequential(ops.RMSNorm(32), ops.Linear(32, 64), ops.GELU(), ops.Linear(64, 32), recipe=Recipe.delayed())


def test_delayed_checkpoint_loads_strictly_and_resumes_with_the_same_scales():
    trained = _delayed_block()
    for _ in range(3):
        x = torch.randn(8, 32, requires_grad=True)
        trained(x).sum().backward()
    fresh = _delayed_block()
    assert set(fresh.state_dict()) == set(trained.state_dict())  # the state exists from construction
    fresh.load_state_dict(trained.state_dict(), strict=True)
    x = torch.randn(8, 32)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_a, y_b = trained(xa), fresh(xb)
    assert_same_bits(y_a, y_b)
    y_a.sum().backward()
    y_b.sum().backward()
    assert_same_bits(xa.grad, xb.grad)  # the gradient quantizers resumed too
    states = [(a, b) for a, b in zip(trained.modules(), fresh.modules()) if isinstance(a, DelayedScalingState)]
    assert len(states) == 6
    for a, b in states:
        assert_same_bits(a.scale, b.scale)


def test_linear_holds_typed_quantizers_and_a_typed_backward_record():
    lin = ops.Linear(32, 16, recipe=Recipe.delayed())
    assert all(isinstance(q, DelayedScalingState) for q in lin.quantizers)
    assert {"input_quantizer.scale", "weight_quantizer.amax_history", "grad_quantizer.scale"} <= set(lin.state_dict())


@pytest.mark.parametrize("recipe", [Recipe(), Recipe.rowwise(), Recipe.blockwise()], ids=["tensor", "row", "block"])
def test_functional_linear_is_the_op_without_state(recipe):
    torch.manual_seed(1)
    lin = ops.Linear(128, 256, recipe=recipe)
    x = torch.randn(4, 8, 128)
    dy = torch.randn(4, 8, 256)
    xa = x.clone().requires_grad_(True)
    ya = lin(xa)
    ya.backward(dy)
    w, b = lin.weight.detach().clone().requires_grad_(True), lin.bias.detach().clone().requires_grad_(True)
    xb = x.clone().requires_grad_(True)
    yb = ops.functional.linear(xb, w, b, recipe=recipe)
    yb.backward(dy)
    assert_same_bits(ya, yb)
    assert_same_bits(xa.grad, xb.grad)
    assert_same_bits(lin.weight.grad, w.grad)
    assert_same_bits(lin.bias.grad, b.grad)


def _public_names():
    """Public classes and functions of the package, and the public methods and properties that our
    classes define themselves (inherited torch.nn.Module / Enum members are not ours to document)."""
    import float8.quantizer

    for module in (float8, float8.quantizer, ops, ops.functional):
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            yield f"{module.__name__}.{name}", obj
            if inspect.isclass(obj) and obj.__module__.startswith("float8"):
                for member, value in vars(obj).items():
                    if member.startswith("_") or member in TORCH_PROTOCOL:
                        continue
                    if inspect.isfunction(value) or isinstance(value, (property, classmethod, staticmethod)):
                        yield f"{module.__name__}.{name}.{member}", inspect.getattr_static(obj, member)


# nn.Module's own protocol: documented by torch (an override needs no docstring of its own).
TORCH_PROTOCOL = {"forward", "extra_repr", "get_extra_state", "set_extra_state"}


@pytest.mark.parametrize("name, obj", list(_public_names()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_name_has_a_docstring(name, obj):
    # inspect.getdoc inherits a docstring from the method or property it overrides (op_forward from BasicOp).
    doc = inspect.getdoc(obj)
    assert doc and len(doc) > 20, f"{name} has no docstring"


def test_writing_into_a_saved_input_before_backward_is_refused():
    # The ops keep what their backward reads; the input is the one a caller can still change. Like torch's
    # own ops, a backward after an in-place write into it raises instead of using the changed values.
    x = torch.randn(4, 32, requires_grad=True)
    h = x * 1
    y = ops.RMSNorm(32)(h)
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_heads=0, head_dim=8), "num_heads"),
        (dict(num_heads=-4, head_dim=8), "num_heads"),
        (dict(num_heads=4, head_dim=0), "head_dim"),
        (dict(num_heads=4, head_dim=8, num_kv_heads=0), "num_kv_heads"),
        (dict(num_heads=4, head_dim=8, num_kv_heads=-2), "num_kv_heads"),
        (dict(num_heads=4.0, head_dim=8), "num_heads"),
        (dict(num_heads=4, head_dim=8, num_kv_heads=3), "multiple"),
    ],
)
def test_attention_arguments_are_checked(kwargs, match):
    """Attention(0, 8) raised ZeroDivisionError, num_kv_heads=0 silently meant the default and negative head
    counts passed (issue 23 item 12): each is a ValueError naming the argument."""
    heads, dim = kwargs.pop("num_heads"), kwargs.pop("head_dim")
    with pytest.raises(ValueError, match=match):
        ops.Attention(heads, dim, **kwargs)


def _second_backward_cases(device="cpu"):
    """Each case: (the input and parameters whose gradients are compared, a function giving the loss)."""
    from float8.ops.functional import linear
    from tests.ops.test_no_reference_cycles import _block

    torch.manual_seed(0)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, device=device)
    target = torch.randint(0, 128, (2, 16), device=device)
    w = torch.randn(64, 64, dtype=torch.bfloat16, device=device)
    lean = Recipe(lean_activations=True)
    plain_mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 64))
    modules = {
        "Linear": ops.Linear(64, 64),
        "Sequential": ops.Sequential(ops.RMSNorm(64), ops.Linear(64, 64), ops.GELU()),
        "Sequential, residual, attention, SwiGLU": _block(Recipe()),  # a Llama-style block, GQA
        "Sequential, lean activations": ops.Sequential(
            ops.Linear(64, 128), ops.GELU(), ops.Linear(128, 64), recipe=lean
        ),
        "converted torch.nn, lean activations": ops.convert(plain_mlp, recipe=lean),
        "linear_cross_entropy": ops.LinearCrossEntropy(64, 128, recipe=Recipe()),
        "linear_cross_entropy, reduction none": ops.LinearCrossEntropy(64, 128, recipe=Recipe(), reduction="none"),
    }
    cases = {}
    for name, m in modules.items():
        m.to(device, torch.bfloat16)
        leaves = [x.clone().requires_grad_(), *m.parameters()]
        if name.startswith("linear_cross_entropy"):
            loss = lambda m=m, leaves=leaves: m(leaves[0], target).float().sum()  # noqa: E731
        else:
            loss = lambda m=m, leaves=leaves: m(leaves[0]).float().pow(2).sum()  # noqa: E731
        cases[name] = (leaves, loss)
    leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    cases["functional.linear"] = (leaves, lambda: linear(leaves[0], leaves[1]).float().pow(2).sum())
    return cases


SECOND_BACKWARD_CASES = list(_second_backward_cases())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", SECOND_BACKWARD_CASES)
def test_backward_twice_with_retain_graph(case, device):
    """loss.backward(retain_graph=True), then loss.backward(), as torch.nn allows (issue 23 item 6; it
    failed with a NoneType error, then with an error naming the problem): what the forward saved (FP8
    activations, SDPA's graph, linear_cross_entropy's gradients) stays while the graph is kept, so the second
    backward adds the same gradients again: the leaves hold exactly twice the first backward's, which are
    those of a backward that keeps nothing."""
    leaves, loss_fn = _second_backward_cases(device)[case]
    plain_run = loss_fn()
    plain_run.backward()
    once = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    loss = loss_fn()
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in leaves]
    loss.backward()
    for a, b, c in zip(once, first, leaves):
        assert torch.equal(a, b)
        assert torch.equal(c.grad, 2 * b)


def test_a_weight_written_between_forward_and_backward_is_refused():
    """An optimizer step between a retain_graph backward and the next (or between a forward and its backward)
    changed a norm's weight, which its backward reads live: the gradients mixed old and new weights (4x the
    first backward's instead of 2x), silently. The parameters are saved for autograd's version check now, as
    torch's own ops save their weights, so this raises torch's error."""
    m = ops.Sequential(ops.RMSNorm(64), ops.Linear(64, 64), ops.GELU()).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    loss = m(x).float().pow(2).sum()
    loss.backward(retain_graph=True)
    with torch.no_grad():
        m[0].weight.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("case", ["Linear", "Sequential", "functional.linear", "linear_cross_entropy"])
def test_a_second_backward_without_retain_graph_names_the_problem(case):
    """Without retain_graph=True the first backward lets go of the FP8 copies; a second one says so (torch's
    own message where torch notices first, as for its ops)."""
    leaves, loss_fn = _second_backward_cases()[case]
    loss = loss_fn()
    loss.backward()
    with pytest.raises(
        RuntimeError, match="second backward through the same graph|backward through the graph a second time"
    ):
        loss.backward()


def test_a_linear_does_not_hold_its_high_precision_input_until_backward():
    """A Linear keeps only the FP8 copy of its input for backward; the input's own memory is free once the
    forward is done (nothing the backward reads can change by a write into it)."""
    import weakref

    lin = ops.convert(torch.nn.Sequential(torch.nn.Linear(64, 32)))[0]
    x = torch.randn(8, 64, requires_grad=True)
    h = x * 2  # an activation: only the Linear refers to it after this line
    alive = weakref.ref(h)
    y = lin(h)
    del h
    assert alive() is None
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_writing_into_an_input_a_high_precision_linear_keeps_is_refused():
    # ops.high_precision: the Linear keeps its input itself for the weight gradient, so the write is caught.
    model = ops.convert(torch.nn.Sequential(torch.nn.Linear(32, 16)))
    x = torch.randn(4, 32, requires_grad=True)
    h = x * 1
    with ops.high_precision(model):
        y = model(h)
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "nested"])
@pytest.mark.parametrize("entry", ["converted Linear", "Sequential", "RMSNorm", "Float8Tensor.quantize"])
def test_sparse_and_nested_inputs_are_refused_by_name(layout, entry):
    """They used to fail deep inside torch ("NestedTensorImpl doesn't support sizes", aten::amax not
    implemented for SparseCPU); now a TypeError names the layout and what to do."""
    from float8 import Float8Tensor

    dense = torch.randn(3, 16)
    x = {
        "sparse_coo": lambda: dense.to_sparse(),
        "sparse_csr": lambda: dense.to_sparse_csr(),
        "nested": lambda: torch.nested.nested_tensor([torch.randn(2, 16), torch.randn(3, 16)]),
    }[layout]()
    call = {
        "converted Linear": lambda: ops.convert(torch.nn.Sequential(torch.nn.Linear(16, 16)))[0],
        "Sequential": lambda: ops.Sequential(ops.Linear(16, 16)),
        "RMSNorm": lambda: ops.RMSNorm(16),
        "Float8Tensor.quantize": lambda: Float8Tensor.quantize,
    }[entry]()
    with pytest.raises(TypeError, match="nested tensor: pad it" if layout == "nested" else f"layout torch.{layout}"):
        call(x)


def test_importing_and_using_the_library_prints_no_numpy_warning():
    """Issue 23 item 14: a test run printed "Failed to initialize NumPy" (torch without numpy installed). numpy
    is in the test extra (the Triton interpreter needs it); this pins that importing and using the library
    initializes it cleanly."""
    import subprocess
    import sys

    code = "import torch, float8, float8.ops; from float8 import Float8Tensor; Float8Tensor.quantize(torch.randn(4, 4)).dequantize().numpy()"
    run = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Failed to initialize NumPy" not in run.stderr + run.stdout
