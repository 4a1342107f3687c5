"""torch.compile(fullgraph=True) of ops: Sequentials under each current-scaling recipe, ops.convert models,
Linears alone, the functional forms and the fused linear + cross-entropy, forward and backward.

On the CPU with the aot_eager backend (the graph AOTAutograd traces, run op by op): the same kernels as
eager, so outputs and gradients must match eager bit for bit. Each case runs three steps of one shape and
asserts one compiled frame (no graph break: fullgraph; no recompile: the frame count stays 1).
"""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from float8 import BlockwiseScaling, DelayedScaling, Recipe, RowwiseScaling, ops
from float8.ops import functional as FO
from tests.tolerances import assert_same_bits

RECIPES = {
    "tensorwise": None,
    "lean": Recipe(lean_activations=True),
    "rowwise": Recipe(input=RowwiseScaling(), weight=RowwiseScaling(), grad=RowwiseScaling()),
    "block": Recipe(
        input=BlockwiseScaling((1, 128)), weight=BlockwiseScaling((128, 128)), grad=BlockwiseScaling((1, 128))
    ),
}


def _block(recipe):
    torch.manual_seed(0)
    return ops.Sequential(
        ops.Residual(),
        ops.RMSNorm(128),
        ops.Linear(128, 256),
        ops.SwiGLU(),
        ops.Linear(128, 128),
        ops.AddResidual(),
        ops.LayerNorm(128),
        ops.Linear(128, 128, bias=True),
        ops.GELU(),
        recipe=recipe,
    ).to(torch.bfloat16)


def _grads(module, x, *extra):
    x = x.detach().clone().requires_grad_(True)
    y = module(x, *extra)
    y.float().square().sum().backward()
    out = [y.detach(), x.grad] + [p.grad for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return out


def _compare_steps(build, make_input, steps=3, extra=()):
    torch._dynamo.reset()
    eager, compiled = build(), build()
    counter = CompileCounterWithBackend("aot_eager")
    run = torch.compile(compiled, backend=counter, fullgraph=True)
    for step in range(steps):
        x = make_input(step)
        for want, got in zip(_grads(eager, x, *extra), _grads(run, x, *extra)):
            assert_same_bits(got, want)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames for one shape"


@pytest.mark.parametrize("name", list(RECIPES))
def test_sequential_compiles_fullgraph_and_matches_eager(name):
    _compare_steps(lambda: _block(RECIPES[name]), lambda s: torch.randn(2, 16, 128, dtype=torch.bfloat16))


def test_converted_model_compiles_fullgraph_and_matches_eager():
    from benchmarks.distributed import Block

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(Block(64, 4, 2, 16, 128), Block(64, 4, 2, 16, 128)).to(torch.bfloat16)
        # Bit for bit against eager without the SwiGLU fusion: compiled code runs torch's own SwiGLU backward
        # (the fused eager one rounds once: tests/ops/test_swiglu_fusion.py).
        return ops.convert(model, fuse_swiglu=False)

    _compare_steps(build, lambda s: torch.randn(2, 32, 64, dtype=torch.bfloat16))


def test_bias_then_activation_compiles():
    """A Bias op fused with the activation after it saves the bias parameter itself (`.to()` of the same
    dtype): an alias of the Function's input, which dynamo refused while the contexts lived outside it."""

    def build():
        torch.manual_seed(0)
        return ops.Sequential(ops.Bias(64), ops.GELU(), ops.Linear(64, 64)).to(torch.bfloat16)

    _compare_steps(build, lambda s: torch.randn(2, 16, 64, dtype=torch.bfloat16))


def test_linear_alone_with_float32_master_weights():
    def build():
        torch.manual_seed(0)
        return ops.Linear(64, 32)  # float32 parameters, bfloat16 activations

    _compare_steps(build, lambda s: torch.randn(8, 64, dtype=torch.bfloat16))


def test_functional_linear_compiles():
    torch._dynamo.reset()
    torch.manual_seed(0)
    w = torch.randn(32, 64, requires_grad=True)
    counter = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda x: FO.linear(x, w), backend=counter, fullgraph=True)
    for _ in range(2):
        x = torch.randn(8, 64, dtype=torch.bfloat16)
        assert_same_bits(f(x), FO.linear(x, w))
    assert counter.frame_count == 1


def test_sequential_ending_in_linear_cross_entropy_compiles():
    def build():
        torch.manual_seed(0)
        return ops.Sequential(ops.RMSNorm(64), ops.Linear(64, 64), ops.GELU(), ops.LinearCrossEntropy(64, 128)).to(
            torch.bfloat16
        )

    target = torch.randint(0, 128, (16,))
    _compare_steps(build, lambda s: torch.randn(16, 64, dtype=torch.bfloat16), extra=(target,))


def test_whole_training_step_compiled_forward_backward_and_optimizer():
    """The step users run: a compiled model (fullgraph) and a compiled AdamW step, against eager."""
    from benchmarks.distributed import Block

    def build():
        torch.manual_seed(0)
        # fuse_swiglu=False: as in test_converted_model_compiles_fullgraph_and_matches_eager
        return ops.convert(torch.nn.Sequential(Block(64, 4, 2, 16, 128)).to(torch.bfloat16), fuse_swiglu=False)

    torch._dynamo.reset()
    eager, compiled = build(), build()
    counter = CompileCounterWithBackend("aot_eager")
    run = torch.compile(compiled, backend=counter, fullgraph=True)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, foreach=True)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2, foreach=True)
    # torch's optimizers break the graph on purpose around their step (torch.optim's _use_grad): compiled
    # as PyTorch documents it, without fullgraph.
    step_c = torch.compile(opt_c.step, backend="aot_eager")
    for _ in range(3):
        x = torch.randn(2, 32, 64, dtype=torch.bfloat16)
        for model, opt, step in ((eager, opt_e, opt_e.step), (run, opt_c, step_c)):
            opt.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()
        for pe, pc in zip(eager.parameters(), compiled.parameters()):
            assert_same_bits(pc.grad, pe.grad)  # the step's gradients: ours, the same bits
        opt_e.step()
        step_c()
        for pe, pc in zip(eager.parameters(), compiled.parameters()):
            torch.testing.assert_close(pc, pe, rtol=0, atol=1e-2)  # torch's AdamW, compiled: rounding may differ
            pc.data.copy_(pe.data)  # keep the two models on one trajectory, so gradients stay comparable
    assert counter.frame_count == 1


def test_a_new_shape_compiles_once_more_and_no_more():
    torch._dynamo.reset()
    model = _block(None)
    counter = CompileCounterWithBackend("aot_eager")
    run = torch.compile(model, backend=counter, fullgraph=True, dynamic=False)
    for tokens in (16, 16, 32, 32, 16):
        run(torch.randn(2, tokens, 128, dtype=torch.bfloat16)).float().sum().backward()
    assert counter.frame_count == 2


def test_delayed_scaling_under_compile_names_the_problem():
    torch._dynamo.reset()
    model = _block(Recipe(input=DelayedScaling(), weight=DelayedScaling(), grad=DelayedScaling()))
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="delayed scaling, which torch.compile cannot trace in training"):
        run(torch.randn(2, 16, 128, dtype=torch.bfloat16))


def test_delayed_scaling_trains_under_compile_without_fullgraph_as_eager_does():
    """Without fullgraph the delayed-scaling run falls back to eager (a graph break) and trains like eager,
    histories included; it failed in backward with "'OpContext' object has no attribute 'saved'" (issue 23)."""
    torch._dynamo.reset()
    recipe = Recipe(input=DelayedScaling(), weight=DelayedScaling(), grad=DelayedScaling())
    eager, model = _block(recipe), _block(recipe)
    run = torch.compile(model, backend="aot_eager")
    for step in range(3):
        x = torch.randn(2, 16, 128, dtype=torch.bfloat16) * (1 + step)
        got, want = run(x), eager(x)
        assert_same_bits(got, want)
        got.float().sum().backward()
        want.float().sum().backward()
    for (name, a), b in zip(model.named_buffers(), eager.buffers(), strict=True):
        assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all()), name
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        assert_same_bits(a.grad, b.grad)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_delayed_scaling_compiles_for_inference_with_eagers_bits_and_history(mode):
    """An inference forward updates the input's amax history and scale in the compiled graph as eager does
    (the first call casts with current scaling, later ones with the history's scale), step after step. The
    weight's state gets an entry per compiled call (the graph quantizes the weight on every call; eager
    caches its copy): the same amax again, so the same scale."""
    torch._dynamo.reset()
    recipe = Recipe(input=DelayedScaling(history_len=4), weight=DelayedScaling(), grad=DelayedScaling())
    eager, compiled_model = _block(recipe), _block(recipe)
    run = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)

    def states(m):
        return [b for n, b in m.named_buffers() if "input_quantizer" in n or n.endswith("weight_quantizer.scale")]

    assert len(states(eager)) == 9  # three Linears: the input's history and scale, the weight's scale
    for step in range(6):  # past the history's length: the oldest amaxes leave it
        x = torch.randn(2, 16, 128, dtype=torch.bfloat16) * (1 + step % 3)
        with getattr(torch, mode)():
            assert_same_bits(run(x), eager(x))
        for a, b in zip(states(compiled_model), states(eager), strict=True):
            assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all())


def _attention_block(recipe=None, sequence_first=False):
    torch.manual_seed(0)
    return ops.Sequential(
        ops.Residual(),
        ops.RMSNorm(64),
        ops.Linear(64, (4 + 2 * 2) * 16, bias=False),
        ops.Attention(4, 16, num_kv_heads=2, sequence_first=sequence_first),
        ops.Linear(64, 64, bias=False),
        ops.AddResidual(),
        ops.Residual(),
        ops.RMSNorm(64),
        ops.Linear(64, 256, bias=False),
        ops.SwiGLU(),
        ops.Linear(128, 64, bias=False),
        ops.AddResidual(),
        recipe=recipe,
    ).to(torch.bfloat16)


@pytest.mark.parametrize("name", ["tensorwise", "lean"])
@pytest.mark.parametrize("sequence_first", [False, True], ids=["bsd", "sbd"])
def test_block_with_attention_compiles_fullgraph_and_matches_eager(name, sequence_first):
    # Under compile the attention runs as SDPA under autograd between fused runs, the residual pairs as
    # plain adds (ops/runner.py _run_split_at_attention): eager's kernels, so eager's bits.
    _compare_steps(
        lambda: _attention_block(RECIPES[name], sequence_first), lambda s: torch.randn(2, 16, 64, dtype=torch.bfloat16)
    )


def test_nested_residuals_and_a_reshape_around_attention_keep_eager_bits():
    # Two pairs opened at one point (three uses of one activation: the gradients must meet in Residual's
    # order), and a Reshape inside a pair that changes the token dims (the pair adds as (rows, features)).
    def build():
        torch.manual_seed(0)
        return ops.Sequential(
            ops.Residual(),
            ops.Residual(),
            ops.RMSNorm(64),
            ops.Linear(64, 128, bias=False),
            ops.Attention(4, 16, num_kv_heads=2),
            ops.AddResidual(),
            ops.Reshape((4, 8, 64)),
            ops.Linear(64, 64),
            ops.AddResidual(),
        ).to(torch.bfloat16)

    _compare_steps(build, lambda s: torch.randn(2, 16, 64, dtype=torch.bfloat16))


def test_attention_alone_compiles_and_checks_its_input():
    torch._dynamo.reset()
    attn = ops.Attention(4, 16, num_kv_heads=2)
    _compare_steps(lambda: attn, lambda s: torch.randn(2, 8, 128, dtype=torch.bfloat16))
    run = torch.compile(attn, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="needs 128 features, got 96"):
        run(torch.randn(2, 8, 96, dtype=torch.bfloat16))


def test_compiled_cross_entropy_still_refuses_a_bad_label():
    torch._dynamo.reset()
    model = ops.LinearCrossEntropy(64, 128).to(torch.bfloat16)
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    target = torch.randint(0, 128, (16,))
    target[3] = 500
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        run(torch.randn(16, 64, dtype=torch.bfloat16), target)


def test_every_op_declares_the_context_fields_it_keeps():
    """Under compile only the context fields an op declares (`BasicOp.saves`, packed by ops/saved.py) reach
    its backward: a field kept but not declared would fail there. Every `ctx.<name> = ...` on an OpContext
    in an op class's methods must be declared by that class (or a base)."""
    import ast
    import importlib
    import pathlib

    checked = 0
    for path in (pathlib.Path(__file__).parents[2] / "ops").glob("*.py"):
        module = importlib.import_module(f"float8.ops.{path.stem}")
        for cls in ast.parse(path.read_text()).body:
            if not isinstance(cls, ast.ClassDef):
                continue
            written = set()
            for fn in ast.walk(cls):
                if not isinstance(fn, ast.FunctionDef):
                    continue
                if not any(a.arg == "ctx" and getattr(a.annotation, "id", None) == "OpContext" for a in fn.args.args):
                    continue
                for node in ast.walk(fn):
                    for t in node.targets if isinstance(node, ast.Assign) else []:
                        for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                            if isinstance(el, ast.Attribute) and getattr(el.value, "id", None) == "ctx":
                                written.add(el.attr)
            if written:
                declared = set(getattr(getattr(module, cls.name), "saves", ()))
                assert written <= declared, f"{path.name} {cls.name} keeps {sorted(written - declared)} undeclared"
                checked += 1
    assert checked >= 5, f"only {checked} op classes write their contexts: the scan is broken"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on the CPU every quantization is torch's")
def test_compiled_converted_block_quantizes_in_torch_operations_only():
    """Under torch.compile a converted block's Linears quantize their inputs, weights and output gradients
    in torch operations (ops/linear_engine.py `quantize_fusable`), which inductor fuses into the code that
    makes them: neither the forward graph nor the backward graph holds a float8 quantize, amax or transpose
    kernel (before, the backward quantized each output gradient and weight with them)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from benchmarks.distributed import Block

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    torch.manual_seed(0)
    # min_fp8_gemm_flops=0: these small GEMMs run in FP8 (not under the small-layer policy)
    model = ops.convert(Block(64, 4, 2, 16, 128).to(torch.bfloat16).cuda(), recipe=Recipe(min_fp8_gemm_flops=0))
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    compiled(x).float().square().sum().backward()
    assert len(graphs) == 2  # forward and backward
    kernels = {"float8::quantize_tensorwise", "float8::amax", "float8::transpose_fp8"}
    for gm in graphs:
        called = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        assert not {t for t in called if any(k.replace("::", ".") in t for k in kernels)}, called
    assert any("_scaled_mm" in str(n.target) for gm in graphs for n in gm.graph.nodes)  # the GEMMs are FP8
