"""The public custom ops on CPU tensors: same as the references, well-formed for torch.library and
torch.compile, and clear errors for bad input."""

import importlib
import pkgutil

import pytest
import torch

import float8.kernels as K

from .helpers import FP8, assert_outputs, make_x

E4M3, E5M2 = FP8
S = torch.tensor(0.37)
Q = ["data", "data_t", "scale_inv", "amax"]


def _cases(specials):
    x = make_x((4, 256), torch.bfloat16, specials=specials)
    x3 = make_x((2, 3, 128), torch.float16)
    data, scale_inv = K.quantize_blockwise_ref(make_x((256, 128), torch.float32), 128, 128, E4M3)
    return [
        ("amax", K.amax, K.amax_ref, (x,), ["amax"]),
        ("quantize_tensorwise", K.quantize_tensorwise, K.quantize_tensorwise_ref, (x, E4M3, S), Q),  # a given scale
        ("quantize_tensorwise", K.quantize_tensorwise, K.quantize_tensorwise_ref, (x3, E5M2, None, 1, True), Q),
        ("quantize_tensorwise", K.quantize_tensorwise, K.quantize_tensorwise_ref, (x3, E5M2, S, 0, False, True), Q),
        ("quantize_tensorwise", K.quantize_tensorwise, K.quantize_tensorwise_ref, (x, E4M3, None, 0, False, True), Q),
        ("quantize_rowwise", K.quantize_rowwise, K.quantize_rowwise_ref, (x3, E4M3, 0, False), ["data", "scale_inv"]),
        (
            "quantize_blockwise",
            K.quantize_blockwise,
            K.quantize_blockwise_ref,
            (x3, 1, 128, E4M3, 2, False),
            ["data", "scale_inv"],
        ),
        (
            "quantize_blockwise",
            K.quantize_blockwise,
            K.quantize_blockwise_ref,
            (make_x((256, 128)), 128, 128, E5M2, 0, True),
            ["data", "scale_inv"],
        ),
        ("dequantize", K.dequantize, K.dequantize_ref, (data, scale_inv, torch.bfloat16), ["out"]),
    ]


CASES = _cases(specials=True)
FINITE_CASES = _cases(specials=False)  # opcheck compares outputs with assert_close, where NaN != NaN
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_op_on_cpu_is_the_reference(case):
    name, op, ref, args, outs = case
    got, want = op(*args), ref(*args)
    if len(outs) == 1:
        got, want = [got], [want]
    assert_outputs(list(got), list(want), outs)
    assert getattr(torch.ops.float8, name).default is not None  # registered under float8::


@pytest.mark.parametrize("case", FINITE_CASES, ids=IDS)
def test_opcheck(case):
    name, _, _, args, _ = case
    tests = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    if any(isinstance(a, torch.Tensor) and a.dtype in FP8 for a in args):
        # test_schema compares inputs before/after with ops that have no FP8 CPU kernel ("mul_cpu_reduced_float").
        tests.remove("test_schema")
    torch.library.opcheck(getattr(torch.ops.float8, name).default, args, test_utils=tests)


def test_the_ops():
    # One custom op per kernel family, all registered under float8::.
    ops = set()
    for m in pkgutil.iter_modules(K.__path__):
        mod = importlib.import_module(f"float8.kernels.{m.name}")
        ops |= {
            f"{v.op._namespace}::{v.op._name}" for v in vars(mod).values() if hasattr(getattr(v, "op", None), "_name")
        }
    assert ops == {
        f"float8::{n}"
        for n in (
            "amax",
            "quantize_tensorwise",
            "quantize_rowwise",
            "quantize_blockwise",
            "dequantize",
            "norm_fwd",
            "norm_fp8",
            "norm_bwd",
            "act_fwd",
            "act_fp8",
            "act_bwd",
            "dact_fp8",
            "act_fp8_save_input",
            "transpose_fp8",
            "pack_heads_fp8",
            "fp8_weight_mm",
            "fp8_rowwise_input_mm",
            "fp8_block_mm",
        )
    }


def test_torch_compile_fullgraph_aot_eager():
    def f(x):
        data, _, scale_inv, _ = K.quantize_tensorwise(x, E4M3, None, 0, False)
        d_row, s_row = K.quantize_rowwise(x, E5M2)
        d_t, t_t, s_t, _ = K.quantize_tensorwise(x, E4M3, torch.reciprocal(scale_inv), with_transpose=True)
        d_b, s_b = K.quantize_blockwise(x, 1, 128, E4M3)
        return (
            K.dequantize(data, scale_inv, torch.float32)
            + K.dequantize(d_row, s_row, torch.float32)
            + K.dequantize(t_t, s_t, torch.float32).t()
            + K.dequantize(d_b, s_b, torch.float32)
        )

    x = make_x((64, 256), torch.float32)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), f(x))


# ---- bad input --------------------------------------------------------------------------------------

X = torch.randn(4, 256)


@pytest.mark.parametrize(
    "call",
    [
        lambda x: K.amax(x),
        lambda x: K.quantize_tensorwise(x, E4M3, torch.tensor(1.0)),
        lambda x: K.quantize_tensorwise(x, E4M3),
        lambda x: K.quantize_tensorwise(x, E4M3, torch.tensor(1.0), with_transpose=True),
        lambda x: K.quantize_tensorwise(x, E4M3, with_transpose=True),
        lambda x: K.quantize_rowwise(x, E4M3),
        lambda x: K.quantize_blockwise(x, 1, 128, E4M3),
    ],
    ids=["amax", "given-scale", "current", "given-scale-transpose", "current-transpose", "rowwise", "blockwise"],
)
def test_bad_input_dtype(call):
    with pytest.raises(TypeError, match=r"must be float32, bfloat16 or float16, got torch.int32"):
        call(torch.ones(4, 256, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"already FP8 \(torch.float8_e4m3fn\)"):
        call(X.to(E4M3))


@pytest.mark.parametrize(
    "call",
    [
        lambda d: K.quantize_tensorwise(X, d, torch.tensor(1.0)),
        lambda d: K.quantize_tensorwise(X, d),
        lambda d: K.quantize_tensorwise(X, d, torch.tensor(1.0), with_transpose=True),
        lambda d: K.quantize_tensorwise(X, d, with_transpose=True),
        lambda d: K.quantize_rowwise(X, d),
        lambda d: K.quantize_blockwise(X, 1, 128, d),
    ],
)
@pytest.mark.parametrize("bad", [torch.bfloat16, torch.int8, torch.float8_e4m3fnuz])
def test_bad_fp8_dtype(call, bad):
    with pytest.raises(TypeError, match=r"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got"):
        call(bad)


def test_bad_scale():
    with pytest.raises(TypeError, match=r"scale must be float32, got torch.float64"):
        K.quantize_tensorwise(X, E4M3, torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"scale must hold one element, got shape \(2,\)"):
        K.quantize_tensorwise(X, E4M3, torch.ones(2), with_transpose=True)


def test_bad_margin():
    with pytest.raises(ValueError, match=r"margin must be an int >= 0, got -1"):
        K.quantize_rowwise(X, E4M3, -1)
    with pytest.raises(ValueError, match=r"margin 18 is too large for torch.float8_e4m3fn: at most 17"):
        K.quantize_rowwise(X, E4M3, 18)
    with pytest.raises(ValueError, match=r"margin 32 is too large for torch.float8_e5m2: at most 31"):
        K.quantize_blockwise(X, 1, 128, E5M2, 32)
    K.quantize_rowwise(X, E5M2, 31)  # the limits themselves are fine
    K.quantize_rowwise(X, E4M3, 17)
    with pytest.raises(ValueError, match=r"margin must be an int >= 0, got 1.5"):
        K.quantize_tensorwise(X, E4M3, None, 1.5)  # eager calls skip the op schema: our own check names it
    with pytest.raises(RuntimeError, match=r"Expected a value of type 'int' for argument 'margin'"):
        K.quantize_tensorwise.op(X, E4M3, None, 1.5)  # the registered op: the schema's own check
    K.quantize_tensorwise(X, E4M3, torch.tensor(1.0), 40)  # ignored with a given scale


@pytest.mark.parametrize(
    "shape,block,match",
    [
        ((4, 200), (1, 128), r"block \(1, 128\) does not tile shape \(4, 200\): 200 columns % 128 != 0"),
        ((200, 128), (128, 128), r"block \(128, 128\) does not tile shape \(200, 128\): 200 rows % 128 != 0"),
        (
            (2, 128, 128),
            (128, 128),
            r"block \(128, 128\) with more than one row needs a 2-D tensor, got shape \(2, 128",
        ),
        ((96, 96), (3, 32), r"unsupported block \(3, 32\) for shape \(96, 96\)"),
        ((256, 256), (256, 256), r"unsupported block \(256, 256\) for shape \(256, 256\)"),
        ((4, 128), (0, 128), r"block must be two positive ints, got \(0, 128\)"),
        ((), (1, 128), r"0-d tensor has no blocks"),
    ],
)
def test_bad_block(shape, block, match):
    with pytest.raises(ValueError, match=match):
        K.quantize_blockwise(torch.zeros(shape), *block, E4M3)


def test_bad_transpose_and_rowwise_rank():
    with pytest.raises(ValueError, match=r"at least 2 dims .* got shape \(5,\)"):
        K.quantize_tensorwise(torch.ones(5), E4M3, torch.tensor(1.0), with_transpose=True)
    with pytest.raises(ValueError, match=r"at least 2 dims"):
        K.quantize_tensorwise(torch.ones(5), E4M3, with_transpose=True)
    K.quantize_tensorwise(torch.ones(5), E4M3)  # without the transpose any shape goes
    with pytest.raises(ValueError, match=r"0-d tensor"):
        K.quantize_rowwise(torch.tensor(1.0), E4M3)


def test_bad_dequantize():
    data = torch.zeros(4, 256).to(E4M3)
    with pytest.raises(TypeError, match=r"data must be torch.float8_e4m3fn or torch.float8_e5m2, got torch.float32"):
        K.dequantize(torch.zeros(4, 256), torch.tensor(1.0), torch.float32)
    with pytest.raises(TypeError, match=r"scale_inv must be float32, got torch.float16"):
        K.dequantize(data, torch.tensor(1.0, dtype=torch.float16), torch.float32)
    with pytest.raises(TypeError, match=r"dtype must be float32, bfloat16 or float16, got torch.float8_e5m2"):
        K.dequantize(data, torch.tensor(1.0), E5M2)
    with pytest.raises(ValueError, match=r"scale_inv of shape \(3, 1\) does not block data of shape \(4, 256\)"):
        K.dequantize(data, torch.ones(3, 1), torch.float32)
    with pytest.raises(ValueError, match=r"scale_inv of shape \(4,\) does not block data"):
        K.dequantize(data, torch.ones(4), torch.float32)


_FAKE_CUDA_TRACE = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
import float8  # registers the ops
with FakeTensorMode():
    x = torch.empty(64, 256, dtype=torch.bfloat16, device="cuda")
    data, data_t, scale_inv, amax = torch.ops.float8.quantize_tensorwise(x, torch.float8_e4m3fn, None, 0, False, True)
    assert data.shape == (64, 256) and data_t.shape == (256, 64) and data.dtype == torch.float8_e4m3fn, data
    assert torch.ops.float8.amax(x).shape == ()
    assert torch.ops.float8.act_fwd(x, "swiglu").shape == (64, 128)
print("ok")
"""


def test_triton_ops_trace_fake_cuda_tensors_without_a_gpu():
    # Tracing for a GPU on a host without one (export, AOT): the triton_ops' bodies ran
    # torch.cuda.get_device_capability on fake CUDA tensors and failed ("Torch not compiled with CUDA
    # enabled"); the custom ops they were had fake implementations. A fresh interpreter without
    # TRITON_INTERPRET (this suite's interpreter cannot trace a launch on fake tensors).
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _FAKE_CUDA_TRACE], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]
