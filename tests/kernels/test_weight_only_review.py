"""Regression tests from the adversarial review of float8::fp8_weight_mm and FastLauncher (2026-11-25).

Each was a silent wrong result or a silent loss on the GPU path before its fix. The GPU path of
fp8_weight_mm is `fp8_weight_mm_triton`; on a CPU it runs on the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), and the Linear-level tests send the op there with monkeypatch (`weight_only.use_triton
-> True`), which is what a CUDA sm_89+ device does. float16 activations: the interpreter's bfloat16 tl.dot
is wrong (test_weight_only.py).
"""

import pytest
import torch

import float8.kernels as K
import float8.ops as ops
from float8 import Recipe
from float8.kernels import weight_only as W
from float8.quantizer import RowwiseQuantizer

from .helpers import needs_interpreter

HALF = torch.float16
E4M3 = torch.float8_e4m3fn


def _rowwise_weight_rows_of_different_magnitude(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]
    return RowwiseQuantizer().quantize(w)  # Float8Tensor, scale_inv (n, 1)


def _rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


# ---- 1. a per-row scale that is not contiguous (a row-strided view of a Float8Tensor) ---------------------


def test_a_row_strided_weight_view_is_not_taken_by_the_kernel():
    """w[::2] of a row-scaled Float8Tensor (de-interleaving a fused gate/up weight) has scale_inv (N, 1) with
    strides (2, 1); the kernels read row scales at stride 1, so such a scale is refused (the op) or left to
    the general path (ops.Linear), never read wrong."""
    v = _rowwise_weight_rows_of_different_magnitude(64, 64)[::2]
    x = torch.randn(4, 64, dtype=HALF)
    assert v.scale_inv.stride() == (2, 1) and not W.supports(x, v.fp8_data, v.scale_inv)
    with pytest.raises(ValueError, match=r"contiguous \(N, 1\)"):
        K.fp8_weight_mm(x, v.fp8_data, v.scale_inv)


@needs_interpreter
def test_linear_with_a_row_strided_fp8_weight_on_the_kernel_path(monkeypatch):
    """The same through ops.Linear: an FP8-only weight replaced by a row-strided view goes to the kernel."""
    monkeypatch.setattr(W, "use_triton", lambda x: True)  # what an sm_89+ CUDA device does
    torch.manual_seed(0)
    model = ops.convert(
        torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).half(), recipe=Recipe.rowwise(), fp8_weights=True
    )
    lin = model[0]
    v = _rowwise_weight_rows_of_different_magnitude(64, 64)[::2]
    lin.weight = torch.nn.Parameter(v, requires_grad=False)
    x = torch.randn(4, 64, dtype=HALF)
    with torch.no_grad():
        y = lin(x)
    want = (x.float() @ v.dequantize(torch.float32).t()).half()
    # The general path (its FP8 activation cast costs ~3% here); before the fix the error was ~0.99, each
    # row taking another row's scale.
    assert _rel_err(y, want) < 5e-2


# ---- 2. a strided bias ----------------------------------------------------------------------------------


def test_a_strided_bias_is_refused_by_the_op():
    """The kernels read the bias at stride 1: a strided one is refused, never read wrong."""
    g = torch.Generator().manual_seed(0)
    d, _, s, _ = K.quantize_tensorwise_ref(torch.randn(32, 64, generator=g) * 0.05, E4M3)
    x = torch.randn(4, 64, generator=g).to(HALF)
    b = torch.randn(64, generator=g).to(HALF)[::2]  # (32,), stride 2
    with pytest.raises(ValueError, match="contiguous"):
        K.fp8_weight_mm(x, d, s, b)


@needs_interpreter
def test_linear_with_a_strided_bias_on_the_kernel_path(monkeypatch):
    monkeypatch.setattr(W, "use_triton", lambda x: True)
    torch.manual_seed(0)
    model = ops.convert(torch.nn.Sequential(torch.nn.Linear(64, 32)).half(), fp8_weights=True)
    lin = model[0]
    lin.bias = torch.nn.Parameter(
        torch.randn(64, dtype=HALF)[::2], requires_grad=False
    )  # e.g. a de-interleaved fused bias
    x = torch.randn(4, 64, dtype=HALF)
    with torch.no_grad():
        y = lin(x)
    want = (x.float() @ lin.weight.dequantize(torch.float32).t() + lin.bias.float()).half()
    # The general path now (its FP8 activation cast: errors ~0.04 at these magnitudes); before the fixes
    # (kernel and _scaled_mm's epilogue both read the bias as contiguous) the error was ~3.
    assert (y.float() - want.float()).abs().max().item() < 0.15


# ---- 3. forward-mode AD silently dropped on the kernel path ------------------------------------------------


@needs_interpreter
def test_forward_ad_tangent_is_not_silently_dropped(monkeypatch):
    """A dual input does not require grad; the weight-only path and the ops' direct eager calls now step
    aside under forward AD and functorch transforms (kernels/common.py forward_ad_or_functorch_active)."""
    import torch.autograd.forward_ad as fwAD

    monkeypatch.setattr(W, "use_triton", lambda x: True)
    torch.manual_seed(0)
    lin = ops.convert(torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).half(), fp8_weights=True)[0]
    x = torch.randn(4, 64, dtype=HALF)
    with fwAD.dual_level():
        try:
            y = lin(fwAD.make_dual(x, torch.ones_like(x)))
        except NotImplementedError as e:  # refused by name: loud is fine
            assert "forward-mode AD" in str(e), str(e)
        else:
            assert fwAD.unpack_dual(y).tangent is not None  # was: the tangent lost silently


# ---- 4. FastLauncher key vs the AMD backend's specialization ----------------------------------------------


def test_no_launch_shortcut_on_rocm(monkeypatch):
    """On ROCm, Triton also specializes a pointer on whether its storage spans under 2 GiB, which the
    launcher's key does not hold: there every launch goes through Triton's own `kernel[grid]`."""
    from float8.kernels.launch import FastLauncher

    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert FastLauncher(W._fp8_weight_mm_kernel).interpreted
