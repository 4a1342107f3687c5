"""The amax of a current-scaling cast, traced: torch's own reduction (which inductor fuses into the kernel that
writes x), eagerly the Triton kernel; the two agree exactly, NaN included (kernels/amax.py amax_for_cast)."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.kernels.helpers import assert_bits, needs_interpreter

amax_m, ct_m, quant_m = (importlib.import_module(f"float8.kernels.{m}") for m in ("amax", "cast_transpose", "quantize"))


class _Seen(TorchDispatchMode):
    """A dispatch mode that records the aten ops run under it (and runs them)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _x(special):
    torch.manual_seed(0)
    x = torch.randn(300, 70, dtype=torch.bfloat16) * 40
    if special is not None:
        x[123, 45] = special
    return x


@needs_interpreter
@pytest.mark.parametrize("special", [None, float("nan"), float("inf"), -float("inf"), -1e30])
@pytest.mark.parametrize("transposed", [False, True])
def test_traced_amax_is_eagers_to_the_bit(special, transposed):
    x = _x(special)
    if transposed:
        x = x.t().contiguous().t()  # the transposed-contiguous layout the cast-transpose path reads
        x = x.transpose(-2, -1)
    eager = amax_m.amax_for_cast(x)
    with _Seen() as seen:
        traced = amax_m.amax_for_cast(x)
    assert "amax" in seen.ops  # torch's reduction ran, under the mode
    assert_bits(traced, eager, "amax", nan_bits=False)  # an amax's NaN payload is not part of the contract
    if special is not None and special != special:
        assert traced.isnan()


@needs_interpreter
def test_comparison_of_amaxes_can_fail():
    x = _x(None)
    eager = amax_m.amax_for_cast(x)
    with _Seen():
        traced = amax_m.amax_for_cast(x * 2)
    with pytest.raises(AssertionError):
        assert_bits(traced, eager, "amax")


# ---- GPU tier: inductor fuses the amax, the bits stay eager's -----------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("with_transpose", [False, True])
@pytest.mark.parametrize("special", [None, float("nan"), float("inf")])
def test_gpu_compiled_current_scaling_equals_eager_without_the_amax_kernel(with_transpose, special):
    """silu(g) * u quantized at current scaling, compiled with inductor: the same data, transpose, scale_inv
    and amax as eager, and no launch of the amax kernel (its reduction went into inductor's kernel)."""
    from torch._inductor.utils import run_and_get_code

    def f(g, u):
        return quant_m.quantize_tensorwise(F.silu(g) * u, torch.float8_e4m3fn, None, 0, False, with_transpose)

    torch.manual_seed(0)
    g = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16) * 3
    u = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16) * 3
    if special is not None:
        u[17, 900] = special
    want = f(g, u)
    torch._dynamo.reset()
    got, code = run_and_get_code(torch.compile(f, fullgraph=True), g, u)
    for o, w, name in zip(got, want, ("data", "data_t", "scale_inv", "amax")):
        assert_bits(o.contiguous(), w, name, nan_bits=False)
    assert "_amax_kernel" not in "\n".join(code)
    assert ("_cast_transpose_kernel" if with_transpose else "_cast_kernel") in "\n".join(code)


@pytest.mark.gpu
def test_gpu_eager_current_scaling_still_launches_the_amax_kernel(monkeypatch):
    launched = []
    real = amax_m.launch_amax
    monkeypatch.setattr(amax_m, "launch_amax", lambda x, out: launched.append(x.shape) or real(x, out))
    x = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    quant_m.quantize_tensorwise(x, torch.float8_e4m3fn)
    ct_m.quantize_transpose_tensorwise_triton(x, torch.float8_e4m3fn)
    assert launched == [x.shape, x.shape]
