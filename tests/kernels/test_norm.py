"""kernels/norm.py: RMSNorm / LayerNorm forward, backward and forward-to-FP8, against the references.

What is compared how:
- The per-row stats (mean, rstd) are row sums, and the kernels sum in another order than torch: they
  agree with the references to a few float32 ulps (STATS_RTOL), and bit for bit where every partial sum
  is exact (test_exact_inputs_everything_bit_exact).
- Everything after the stats runs the same float32 operations in the same order (no FMA contraction:
  test_no_fma_contraction_in_ptx), so given the kernel's own stats, y, the FP8 data and data_t, scale_inv
  and amax equal the references bit for bit (norm_apply_ref + quantize_y_ref).
- Fused == unfused: the FP8 ops' stats are the forward's bits because their first launch is the forward's
  compiled kernel (test_fp8_stats_come_from_the_forward_kernel): on the GPU the order of a row sum follows
  the register layout Triton picks per compiled kernel, which the interpreter cannot show.
- The references take float32 square roots correctly rounded (norm.sqrt_rn), like the kernels' sqrt_rn:
  torch's CPU sqrt is a vectorised approximation, an ulp off for ~20% of inputs.
- Backward (dx, dweight, dbias) sums rows and columns in another order: close to the reference, and
  within 1e-5 (relative to the largest element) of a float64 autograd computation for float32 inputs.
The Triton launchers run on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py), with the
interpreter's float conversions made hardware-faithful by tests/kernels/conftest.py.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import float8.kernels.norm as nm
from float8.kernels.cast_transpose import cast_transpose_triton, quantize_transpose_tensorwise_triton
from float8.kernels.reference import fp8_max

from .helpers import FP8, assert_bits, needs_interpreter
from .helpers import assert_outputs as check_outputs

EPS = 1e-5
STATS_RTOL = 1e-6  # ~8 float32 ulps: another summation order of at most a few hundred terms
# Chunked rows, rows masked off at the end, several programs per kernel, several row blocks per program.
SMALL = dict(BLOCK_M=4, BLOCK_N=16, num_warps=1, GRID=2)
SMALL2 = dict(BLOCK_M=8, BLOCK_N=32, num_warps=2, GRID=1)  # one backward program for all row blocks
F32, BF16 = torch.float32, torch.bfloat16
CASES = [  # (shape, dtype, config)
    ((1, 16), F32, None),
    ((7, 33), BF16, None),
    ((17, 128), F32, None),
    ((4, 3, 64), BF16, None),
    ((7, 33), F32, SMALL),
    ((4, 3, 64), BF16, SMALL2),
]
CASE_IDS = [f"{'x'.join(map(str, s))}-{str(d)[6:]}{'-small' if c else ''}" for s, d, c in CASES]
FP8_SCALING = [(torch.float8_e4m3fn, 0, False), (torch.float8_e5m2, 2, True)]  # (fp8_dtype, margin, power_of_2)
KINDS = ["rms", "ln"]
FP8_NAMES = ("data", "data_t", "scale_inv", "amax")


def inputs(shape, dtype, kind, seed=0, with_bias=True):
    g = torch.Generator().manual_seed(seed)
    N = shape[-1]
    x = (torch.randn(shape, generator=g) * 2.0 + 0.7).to(dtype)
    w = (1.0 + 0.5 * torch.randn(N, generator=g)).to(dtype)
    b = (0.3 * torch.randn(N, generator=g)).to(dtype) if kind == "ln" and with_bias else None
    return x, w, b


def exact_inputs(shape, dtype, kind, seed=0):
    """x = a / 4, small integers a with each row summing to a multiple of N (N a power of two): every
    partial sum of x, x^2 and (x - mean)^2 is exact in float32, in any order."""
    g = torch.Generator().manual_seed(seed)
    N = shape[-1]
    a = torch.randint(-8, 9, shape, generator=g).reshape(-1, N)
    r = a.sum(-1).remainder(N)
    for i in range(a.shape[0]):
        idx = torch.randperm(N, generator=g)[: int(r[i])]
        a[i, idx] -= 1
    x = (a.float() / 4).reshape(shape).to(dtype)
    _, w, b = inputs(shape, dtype, kind, seed)
    return x, w, b


# ---- thin dispatch over rms / ln ---------------------------------------------------------------------


def mean_or_none(kind, mean):
    """The ops' mean output as the helpers below hand it on: None for RMSNorm, whose ops return an empty
    (0,) float32 tensor there (checked here)."""
    if kind == "rms":
        assert mean.shape == (0,) and mean.dtype == torch.float32, mean
        return None
    return mean


def fwd_triton(kind, x, w, b, config=None):
    """(y, mean or None, rstd)."""
    y, mean, rstd = nm.norm_fwd_triton(x, w, b, EPS, kind == "rms", config)
    return y, mean_or_none(kind, mean), rstd


def fwd_ref(kind, x, w, b):
    y, mean, rstd = nm.norm_fwd_ref(x, w, b, EPS, kind == "rms")
    return y, mean_or_none(kind, mean), rstd


def fp8_triton(kind, x, w, b, fp8_dtype, scale=None, margin=0, power_of_2=False, with_t=False, config=None):
    """(data, data_t, scale_inv, amax), mean or None, rstd."""
    *out, mean, rstd = nm.norm_fp8_triton(
        x, w, b, EPS, kind == "rms", fp8_dtype, scale, margin, power_of_2, with_t, config
    )
    return out, mean_or_none(kind, mean), rstd


def bwd_triton(kind, dy, x, w, mean, rstd, config=None):
    """(dx, dweight, dbias or None for RMSNorm, whose op returns an empty (0,) dbias of w's dtype)."""
    dx, dw, db = nm.norm_bwd_triton(dy, x, w, mean, rstd, config)
    if kind == "rms":
        assert db.shape == (0,) and db.dtype == w.dtype, db
        db = None
    return dx, dw, db


def assert_outputs(ours, ref, names=FP8_NAMES):
    """helpers.assert_outputs, by default over the FP8 outputs (data, data_t, scale_inv, amax)."""
    check_outputs(ours, ref, names)


def assert_fwd_bits(kind, got, want):
    """(y, mean or None, rstd) twice, bit for bit."""
    names = ("y", "rstd") if kind == "rms" else ("y", "mean", "rstd")
    assert_outputs([t for t in got if t is not None], [t for t in want if t is not None], names)


def y_from_stats(x, w, b, mean, rstd):
    """The reference's y (x.dtype, x.shape) from the kernel's own stats."""
    return nm.norm_apply_ref(x, w, b, mean, rstd).to(x.dtype).reshape(x.shape)


def assert_stats_close(mean, rstd, ref_mean, ref_rstd, rtol=STATS_RTOL):
    torch.testing.assert_close(rstd, ref_rstd, rtol=rtol, atol=0)
    if ref_mean is None:
        assert mean is None
    else:
        # The mean can be ~0 where x's values cancel: relative to the row's scale, not to itself.
        torch.testing.assert_close(mean, ref_mean, rtol=rtol, atol=rtol / ref_rstd.min().item())


def max_rel_err(ours, ref) -> float:
    """max |ours - ref| / max |ref|: the error relative to the tensor's scale."""
    ref = ref.double()
    return ((ours.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


def hp_rtol(dtype) -> float:
    # One rounding of the output apart: where the float32 results differ by an ulp, the rounded ones may
    # land on neighbouring bf16/fp16 values (relative to the largest element: at most one ulp of it).
    return {torch.float32: 1e-6, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}[dtype]


# ---- the Triton launchers under the interpreter, against the references ------------------------------


@needs_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "shape, dtype, config", [*CASES, ((7, 33), torch.float16, None)], ids=[*CASE_IDS, "7x33-float16"]
)
def test_forward(kind, dtype, shape, config):
    x, w, b = inputs(shape, dtype, kind)
    y, mean, rstd = fwd_triton(kind, x, w, b, config)
    y_ref, mean_ref, rstd_ref = fwd_ref(kind, x, w, b)
    assert_stats_close(mean, rstd, mean_ref, rstd_ref)
    assert_bits(y, y_from_stats(x, w, b, mean, rstd), "y from the kernel's stats")
    assert max_rel_err(y, y_ref) <= hp_rtol(dtype)


@needs_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fp8_dtype, margin, power_of_2", FP8_SCALING, ids=["e4m3", "e5m2-m2-p2"])
@pytest.mark.parametrize("with_t", [False, True], ids=["", "T"])
@pytest.mark.parametrize("shape, dtype, config", CASES, ids=CASE_IDS)
def test_fp8_current_scaling(kind, dtype, fp8_dtype, with_t, margin, power_of_2, shape, config):
    x, w, b = inputs(shape, dtype, kind)
    out, mean, rstd = fp8_triton(kind, x, w, b, fp8_dtype, None, margin, power_of_2, with_t, config)
    _, mean_ref, rstd_ref = fwd_ref(kind, x, w, b)
    assert_stats_close(mean, rstd, mean_ref, rstd_ref)
    y = y_from_stats(x, w, b, mean, rstd)
    assert_outputs(out, nm.quantize_y_ref(y, fp8_dtype, None, margin, power_of_2, with_t))
    # Fused == unfused: the same stats as the high-precision forward (same row kernel, same tile).
    _, mean_fwd, rstd_fwd = fwd_triton(kind, x, w, b, config)
    assert_bits(rstd, rstd_fwd, "rstd vs the forward's")
    if mean is not None:
        assert_bits(mean, mean_fwd, "mean vs the forward's")


@needs_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("with_t", [False, True], ids=["", "T"])
@pytest.mark.parametrize("shape, dtype, config", CASES, ids=CASE_IDS)
def test_fp8_given_scale(kind, dtype, fp8_dtype, with_t, shape, config):
    x, w, b = inputs(shape, dtype, kind)
    y_ref, mean_ref, rstd_ref = fwd_ref(kind, x, w, b)
    # Saturates the top half of |y|, and is not a power of two: the products round.
    scale = (fp8_max(fp8_dtype) / (0.5 * y_ref.float().abs().max()) * 1.37).reshape(1)
    # margin and power_of_2 are ignored with a given scale
    out, mean, rstd = fp8_triton(kind, x, w, b, fp8_dtype, scale, 3, True, with_t, config)
    assert_stats_close(mean, rstd, mean_ref, rstd_ref)
    y = y_from_stats(x, w, b, mean, rstd)
    assert_outputs(out, nm.quantize_y_ref(y, fp8_dtype, scale, with_transpose=with_t))
    assert out[0].float().abs().max() == fp8_max(fp8_dtype)  # saturation was exercised
    _, mean_fwd, rstd_fwd = fwd_triton(kind, x, w, b, config)
    assert_fwd_bits(kind, (y, mean, rstd), (y, mean_fwd, rstd_fwd))  # fused == unfused


@needs_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "shape, dtype", [((1, 16), F32), ((17, 128), BF16), ((4, 3, 64), F32), ((5, 256), BF16)], ids=str
)
def test_exact_inputs_everything_bit_exact(kind, dtype, shape):
    """Where every partial sum is exact, the stats match too: all outputs == the full references' bits."""
    x, w, b = exact_inputs(shape, dtype, kind)
    assert_fwd_bits(kind, fwd_triton(kind, x, w, b), fwd_ref(kind, x, w, b))
    fp8_dtype = FP8[shape[0] % 2]
    names = (*FP8_NAMES, "mean", "rstd")
    for scale in (None, torch.tensor(7.3)):
        args = (x, w, b, EPS, kind == "rms", fp8_dtype, scale, 1, False, True)
        assert_outputs(nm.norm_fp8_triton(*args), nm.norm_fp8_ref(*args), names)


@needs_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape, dtype, config", CASES, ids=CASE_IDS)
def test_backward(kind, dtype, shape, config):
    x, w, b = inputs(shape, dtype, kind)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    _, mean, rstd = fwd_ref(kind, x, w, b)
    ours = nm.norm_bwd_triton(dy, x, w, mean, rstd, config)
    ref = nm.norm_bwd_ref(dy, x, w, mean, rstd)
    for name, ours, r in zip(("dx", "dweight", "dbias"), ours, ref):
        assert ours.dtype == r.dtype and ours.shape == r.shape and ours.is_contiguous(), name
        if r.numel() == 0:  # RMSNorm's dbias
            continue
        assert max_rel_err(ours, r) <= hp_rtol(dtype), name


@needs_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape, dtype, config", CASES, ids=CASE_IDS)
def test_backward_adds_the_residual_gradient(kind, dtype, shape, config):
    # dres is added to dx as a separate add would: dx rounded to x.dtype first, then the sum rounded.
    x, w, b = inputs(shape, dtype, kind)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    dres = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    _, mean, rstd = fwd_ref(kind, x, w, b)
    fused = nm.norm_bwd_triton(dy, x, w, mean, rstd, config, dres=dres)
    plain = nm.norm_bwd_triton(dy, x, w, mean, rstd, config)
    assert_bits(fused[0], plain[0] + dres, "dx + dres")
    for name, f, p in zip(("dweight", "dbias"), fused[1:], plain[1:]):
        assert torch.equal(f, p), name
    ref = nm.norm_bwd_ref(dy, x, w, mean, rstd, dres)
    assert torch.equal(ref[0], nm.norm_bwd_ref(dy, x, w, mean, rstd)[0] + dres)
    assert max_rel_err(fused[0], ref[0]) <= hp_rtol(dtype)
    with pytest.raises(ValueError, match="dres must have x's shape, dtype"):
        nm.norm_bwd(dy, x, w, mean, rstd, dres.float() if dtype != torch.float32 else dres.half())


# ---- against float64 autograd -----------------------------------------------------------------------


def float64_norm(kind, x, w, b):
    x, w = x.double(), w.double()
    if kind == "rms":
        y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + EPS) * w
    else:
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + EPS) * w + b.double()
    return y


@needs_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape, config", [((7, 33), None), ((17, 128), None), ((7, 33), SMALL)], ids=str)
def test_against_float64_autograd(kind, shape, config):
    x, w, b = inputs(shape, torch.float32, kind)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = b.double().requires_grad_() if b is not None else None
    y64 = float64_norm(kind, x64, w64, b64)
    grads = torch.autograd.grad(y64, [t for t in (x64, w64, b64) if t is not None], dy.double())

    y, mean, rstd = fwd_triton(kind, x, w, b, config)
    dx, dw, db = bwd_triton(kind, dy, x, w, mean, rstd, config)
    for name, ours, ref in zip(("y", "dx", "dweight", "dbias"), (y, dx, dw, db), (y64, *grads)):
        assert max_rel_err(ours, ref) < 1e-5, name


# ---- fused == unfused with the other kernels --------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fp8_dtype", FP8, ids=["e4m3", "e5m2"])
def test_equals_norm_then_quantize_kernels(kind, fp8_dtype):
    """norm -> FP8 in one op gives the bits of the high-precision norm followed by kernels/cast_transpose."""
    x, w, b = inputs((17, 128), torch.bfloat16, kind)
    y, _, _ = fwd_triton(kind, x, w, b)
    out, _, _ = fp8_triton(kind, x, w, b, fp8_dtype, None, 1, True, True)
    assert_outputs(out, quantize_transpose_tensorwise_triton(y, fp8_dtype, 1, True))
    scale = torch.tensor([0.37])
    out, _, _ = fp8_triton(kind, x, w, b, fp8_dtype, scale, with_t=True)
    assert_outputs(out, cast_transpose_triton(y, scale, fp8_dtype))


# ---- what the interpreter cannot show: one compiled row kernel, no FMA contraction --------------------


def spec_key(kernel, args, kwargs):
    """What Triton's JIT keys a compiled kernel on (triton/runtime/jit.py, 3.x): constexpr values, a tensor's
    dtype and 16-byte alignment, an int's width, == 1 and divisibility by 16 (unless the kernel lists it in
    do_not_specialize), a float's type; and the launch options. Equal keys: one binary."""
    jit_kwargs = getattr(kernel, "kwargs", None) or {}  # the interpreter's InterpretedFunction
    no_spec = set(getattr(kernel, "do_not_specialize", None) or jit_kwargs.get("do_not_specialize") or ())
    params = list(inspect.signature(kernel.fn).parameters.values())
    values = {**dict(zip([p.name for p in params], args)), **kwargs}
    key = []
    for p in params:
        v = values.pop(p.name)
        if "constexpr" in str(p.annotation):
            key.append((p.name, "constexpr", v))
        elif isinstance(v, torch.Tensor):
            key.append((p.name, v.dtype, v.data_ptr() % 16 == 0))
        elif isinstance(v, bool):
            key.append((p.name, "i1", v))
        elif isinstance(v, int):
            width = "i32" if -(2**31) <= v < 2**31 else "i64"
            key.append((p.name, width) if p.name in no_spec else (p.name, width, v == 1, v % 16 == 0))
        elif isinstance(v, float):
            key.append((p.name, "fp32"))
        else:
            raise TypeError(f"{p.name}: {type(v)}")
    return tuple(key), tuple(sorted(values.items()))  # what is left: num_warps, enable_fp_fusion


class Recorder:
    """Stands in for a kernel: records each launch's key (and write_y), runs nothing."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            write_y = dict(zip(inspect.signature(self.kernel.fn).parameters, args)).get("write_y")
            self.launches.append((spec_key(self.kernel, args, kwargs), write_y))

        return launch


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "shape, dtype, config",
    [
        ((7, 33), BF16, None),
        ((5, 256), F32, None),
        ((3, 9000), torch.float16, None),
        ((7, 33), F32, SMALL),
        ((1, 16), BF16, None),
    ],
    ids=["7x33-bf16", "5x256-f32", "3x9000-f16-chunked", "7x33-f32-small", "1x16-bf16"],
)
def test_fp8_stats_come_from_the_forward_kernel(monkeypatch, kind, shape, dtype, config):
    """Every FP8 op's first launch is the forward's compiled row kernel (write_y, not specialized on, apart),
    for contiguous x and for a row slice: so the stats, and with them y and the FP8 bits, are the forward's.

    The GPU tier caught the alternative: a one-launch row kernel casting to FP8 compiled to another register
    layout (16 elements a thread), so another summation order, and its rstd was an ulp off the forward's in
    28 of 129 rows (H100, (129, 96) fp16). Wrong-reference check: with write_y specialized on (as a plain
    int argument is, where it is 1), the keys differ and this test fails.
    """
    rows = Recorder(nm._norm_rows_kernel)
    monkeypatch.setattr(nm._rows_launcher, "kernel", rows)  # the kernel its FastLauncher launches
    monkeypatch.setattr(nm._fp8_tiles_launcher, "kernel", Recorder(nm._norm_fp8_tiles_kernel))
    assert "write_y" in nm.ROWS_NOT_SPECIALIZED
    x, w, b = inputs(shape, dtype, kind)
    x_slice = inputs((shape[0], 2 * shape[-1]), dtype, kind)[0][:, 1 : shape[-1] + 1]  # row stride 2N, offset
    for xx in (x, x_slice):
        rows.launches.clear()
        fwd_triton(kind, xx, w, b, config)
        for fp8_dtype, with_t in [(torch.float8_e4m3fn, True), (torch.float8_e5m2, False)]:
            fp8_triton(kind, xx, w, b, fp8_dtype, None, 1, True, with_t, config)
            fp8_triton(kind, xx, w, b, fp8_dtype, torch.tensor([3.0]), with_t=with_t, config=config)
        (fwd_key, fwd_write), *fp8 = rows.launches
        assert fwd_write == 1 and len(fp8) == 4 and all(wy == 0 for _, wy in fp8)
        for key, _ in fp8:
            assert key == fwd_key


ROOT = Path(__file__).resolve().parents[2]
COMPILE_FOR_SM90 = r"""
import json, re, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import float8.kernels.norm as nm
from float8.kernels.reference import fp8_max
from tests.kernels.sm90_lowering import signature_of

calls = []
class Rec:
    def __init__(self, fn): self.fn = fn
    def __getitem__(self, grid): return lambda *a, **k: calls.append((self.fn, a, k))
for launcher in (nm._rows_launcher, nm._fp8_tiles_launcher, nm._bwd_launcher):  # FastLaunchers
    launcher.kernel = Rec(launcher.kernel)
for dtype in (torch.bfloat16, torch.float32):
    for N in (96, 4096, 9000):
        x = torch.randn(64, N).to(dtype); w = torch.randn(N).to(dtype)
        for b in (None, w):
            nm.norm_fwd_triton(x, w, b, 1e-5, b is None)
            nm.norm_fp8_triton(x, w, b, 1e-5, b is None, torch.float8_e4m3fn, None, 0, False, True)
            nm.norm_fp8_triton(x, w, b, 1e-5, b is None, torch.float8_e5m2, torch.tensor([2.0]), 0, False, False)
            nm.norm_bwd_triton(x, x, w, None if b is None else torch.zeros(64), torch.ones(64))
out, seen = [], set()
for fn, a, k in calls:
    sig, consts, attrs, options = signature_of(fn, a, k)
    for n in nm.ROWS_NOT_SPECIALIZED if fn.__name__ == "_norm_rows_kernel" else ():
        consts.pop(n, None); sig[n] = "i32"; attrs.pop((fn.arg_names.index(n),), None)
    key = (fn.__name__, json.dumps(sig, sort_keys=True), json.dumps(consts, sort_keys=True, default=str), str(attrs))
    if key in seen:
        continue
    seen.add(key)
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                         target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    ops = re.findall(r"\b((?:fma|mul|add|sub)(?:\.\w+)*\.f32)\b", ptx)
    out.append({"kernel": fn.__name__, "constexprs": {c: str(v) for c, v in consts.items()},
                "fma": sum(o.startswith("fma") for o in ops),
                "contractible": sorted({o for o in ops if not o.startswith("fma") and ".rn" not in o})})
print(json.dumps(out))
"""


def test_no_fma_contraction_in_ptx():
    """Compiled for sm_90 (no GPU needed): no fma.*.f32 in any norm kernel, and every float32 mul/add/sub
    carries .rn, which ptxas may not contract either (a bare mul.f32 + add.f32 it may fuse). So y is
    (x * rstd) * w (+ b), each step rounded, on the GPU as in the references: that is what enable_fp_fusion=False
    buys, and the GPU tier's y == y_from_stats(kernel's stats) relies on. Wrong-reference check: launched
    without enable_fp_fusion=False, the row kernels' PTX has fma.rn.f32 and this fails."""
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: the GPU tier compiles and runs the kernels for real")
    try:
        from triton.backends import backends

        if "nvidia" not in backends:
            pytest.skip("this triton has no NVIDIA backend to compile with")
    except ImportError:
        pytest.skip("this triton has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # 3.9 warns when unset; the launches set it themselves
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM90], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in compiled} == {"_norm_rows_kernel", "_norm_fp8_tiles_kernel", "_norm_bwd_kernel"}
    for r in compiled:
        assert r["fma"] == 0 and not r["contractible"], r


# ---- edge cases -------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_row(kind, value):
    """A NaN or inf poisons its own row's stats only; but amax is NaN, so the current scale is NaN
    (reference.scale_from_amax) and every FP8 output is NaN: nothing dequantizes to finite values. With a
    given scale only that row holds NaNs (RMSNorm of an inf row: rstd 0, y = inf * 0 there, 0 elsewhere)."""
    x, w, b = inputs((7, 33), torch.float32, kind)
    x[3, 5] = value
    out, mean, rstd = fp8_triton(kind, x, w, b, torch.float8_e4m3fn, None, 0, False, True, SMALL)
    others = torch.arange(7) != 3
    assert torch.isfinite(rstd[others]).all() and (mean is None or torch.isfinite(mean[others]).all())
    assert out[3].isnan() and out[2].isnan()
    assert out[0].float().isnan().all() and out[1].float().isnan().all()
    y = y_from_stats(x, w, b, mean, rstd)
    assert_outputs(out, nm.quantize_y_ref(y, torch.float8_e4m3fn, None, 0, False, True))
    out, _, _ = fp8_triton(kind, x, w, b, torch.float8_e4m3fn, torch.tensor([3.0]), with_t=True, config=SMALL)
    assert out[0][3].float().isnan().any() and not out[0][others].float().isnan().any() and out[3].isnan()


@needs_interpreter
def test_layernorm_without_bias():
    x, w, _ = inputs((7, 33), torch.bfloat16, "ln")
    y, mean, rstd = fwd_triton("ln", x, w, None)
    assert_bits(y, y_from_stats(x, w, None, mean, rstd), "y")
    assert_stats_close(mean, rstd, *fwd_ref("ln", x, w, None)[1:])
    scale = torch.tensor([20.0])
    out, mean, rstd = fp8_triton("ln", x, w, None, torch.float8_e4m3fn, scale, with_t=True, config=SMALL)
    y = y_from_stats(x, w, None, mean, rstd)
    assert_outputs(out, nm.quantize_y_ref(y, torch.float8_e4m3fn, scale, with_transpose=True))
    dy = torch.randn(7, 33).to(torch.bfloat16)
    for o, r in zip(nm.norm_bwd_triton(dy, x, w, mean, rstd), nm.norm_bwd_ref(dy, x, w, mean, rstd)):
        assert max_rel_err(o, r) <= 2.0**-7


@needs_interpreter
@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_rows(kind):
    """x a column slice (row stride 2N) and a transposed view (copied): same as the contiguous x."""
    x, w, b = inputs((7, 66), torch.bfloat16, kind)
    xs = x[:, :33]
    for view in (xs, x[:, :33].t().contiguous().t()):
        assert not view.is_contiguous()
        got, want = (
            fwd_triton(kind, view, w[:33], None if b is None else b[:33]),
            fwd_triton(kind, view.contiguous(), w[:33], None if b is None else b[:33]),
        )
        for o, r in zip(got, want):
            if r is not None:
                assert_bits(o, r, "non-contiguous")
    dy = torch.randn(7, 66).to(torch.bfloat16)[:, 1:34]
    _, mean, rstd = fwd_ref(kind, xs, w[:33], None if b is None else b[:33])
    got = bwd_triton(kind, dy, xs, w[:33], mean, rstd)
    want = bwd_triton(kind, dy.contiguous(), xs.contiguous(), w[:33], mean, rstd)
    for o, r in zip(got, want):
        if r is not None:
            assert_bits(o, r, "non-contiguous backward")


@needs_interpreter
@pytest.mark.parametrize("kind", KINDS)
def test_empty_rows(kind):
    x, w, b = inputs((0, 16), torch.bfloat16, kind)
    out, mean, rstd = fp8_triton(kind, x, w, b, torch.float8_e4m3fn, None, 0, False, True)
    assert out[0].shape == (0, 16) and out[1].shape == (16, 0) and rstd.shape == (0,)
    assert out[2].item() == 1.0 and out[3].item() == 0.0
    out, _, _ = fp8_triton(kind, x, w, b, torch.float8_e5m2, torch.tensor([4.0]))
    assert out[1].shape == (0,) and out[2].item() == 0.25 and out[3].item() == 0.0
    dx, dw, db = bwd_triton(kind, x, x, w, mean, rstd)
    assert dx.shape == (0, 16) and not dw.any() and dw.dtype == w.dtype


# ---- the public ops (CPU: the references) -----------------------------------------------------------


def op_cases():
    x, w, b = inputs((4, 3, 32), torch.bfloat16, "ln")
    x32 = x.float()
    _, mean, rstd = nm.norm_fwd_ref(x, w, b, EPS, False)
    e4, e5 = FP8
    s = torch.tensor([2.5])
    return [
        ("norm_fwd", (x, w, None, EPS, True), nm.norm_fwd_ref),
        ("norm_fwd", (x, w, b, EPS, False), nm.norm_fwd_ref),
        ("norm_fwd", (x32, w, None, EPS, False), nm.norm_fwd_ref),
        ("norm_fp8", (x, w, None, EPS, True, e4, None, 1, True, True), nm.norm_fp8_ref),
        ("norm_fp8", (x, w, b, EPS, False, e5, None, 0, False, False), nm.norm_fp8_ref),
        ("norm_fp8", (x32, w, None, EPS, True, e4, s, 0, False, False), nm.norm_fp8_ref),
        ("norm_fp8", (x, w, b, EPS, False, e5, s.reshape(()), 0, False, True), nm.norm_fp8_ref),
        ("norm_bwd", (x, x32, w, None, rstd), nm.norm_bwd_ref),
        ("norm_bwd", (x, x, w, mean, rstd), nm.norm_bwd_ref),
    ]


OP_CASES = op_cases()
OP_IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(OP_CASES)]


def test_the_ops():
    # One op per job, rms a flag, a given scale or None: three ops, no others under float8:: from norm.py.
    assert {name for name, _, _ in OP_CASES} == {"norm_fwd", "norm_fp8", "norm_bwd"}
    for old in (
        "rmsnorm_fwd",
        "layernorm_fwd",
        "rmsnorm_fp8",
        "layernorm_fp8",
        "rmsnorm_fp8_scaled",
        "layernorm_fp8_scaled",
        "rmsnorm_bwd",
        "layernorm_bwd",
    ):
        assert not hasattr(nm, old) and not hasattr(torch.ops.float8, old), old


@pytest.mark.parametrize("name, args, ref", OP_CASES, ids=OP_IDS)
def test_public_op_on_cpu_is_the_reference(name, args, ref):
    got = getattr(torch.ops.float8, name)(*args)
    want = ref(*args)
    assert len(got) == len(want)
    for i, (o, r) in enumerate(zip(got, want)):
        assert_bits(o, r, f"{name} output {i}")
    assert_bits(getattr(nm, name)(*args)[0], want[0], f"{name}, the eager call")


@pytest.mark.parametrize("name, args, ref", OP_CASES, ids=OP_IDS)
def test_opcheck(name, args, ref):
    torch.library.opcheck(getattr(nm, name).op, args)  # .op: the registered op (eager calls skip it)


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 5, 48, dtype=torch.bfloat16)
        w = torch.empty(48, dtype=torch.bfloat16)
        out = nm.norm_fp8(x, w, w, EPS, False, torch.float8_e4m3fn, None, 0, False, True)
        assert [tuple(t.shape) for t in out] == [(2, 5, 48), (48, 10), (), (), (10,), (10,)]
        assert out[0].dtype == out[1].dtype == torch.float8_e4m3fn
        out = nm.norm_fp8(x, w, None, EPS, True, torch.float8_e5m2, torch.empty(1), with_transpose=False)
        assert [tuple(t.shape) for t in out] == [(2, 5, 48), (0,), (), (), (0,), (10,)]
        y, mean, rstd = nm.norm_fwd(x, w, None, EPS, True)
        assert y.shape == x.shape and mean.shape == (0,) and rstd.shape == (10,)
        dx, dw, db = nm.norm_bwd(x, x, w.float(), None, torch.empty(10))
        assert dx.dtype == torch.bfloat16 and dw.dtype == db.dtype == torch.float32 and db.shape == (0,)
        _, _, db = nm.norm_bwd(x, x, w, torch.empty(10), torch.empty(10))
        assert db.shape == (48,)


# ---- bad input --------------------------------------------------------------------------------------


def test_weight_shape_mismatch_names_both_shapes():
    x, w, b = inputs((4, 3, 32), torch.bfloat16, "ln")
    for call in (
        lambda: nm.norm_fwd(x, w[:31], None, EPS, True),
        lambda: nm.norm_fp8(x, w[:31], b, EPS, False, torch.float8_e4m3fn),
        lambda: nm.norm_fp8(x, w.reshape(2, 16), None, EPS, True, torch.float8_e4m3fn, torch.ones(1)),
    ):
        with pytest.raises(ValueError, match=r"\(4, 3, 32\)") as e:
            call()
        assert "(31,)" in str(e.value) or "(2, 16)" in str(e.value)
    with pytest.raises(ValueError, match=r"bias.*\(4, 3, 32\).*\(7,\)"):
        nm.norm_fwd(x, w, b[:7], EPS, False)


def test_bad_input_types():
    x, w, b = inputs((4, 32), torch.float32, "ln")
    _, mean, rstd = nm.norm_fwd_ref(x, w, b, EPS, False)
    e4 = torch.float8_e4m3fn
    with pytest.raises(TypeError, match="int32"):
        nm.norm_fwd(x.to(torch.int32), w, None, EPS, True)
    with pytest.raises(TypeError, match="weight"):
        nm.norm_fwd(x, w.to(torch.int64), b, EPS, False)
    with pytest.raises(ValueError, match=r"norm_fwd: rms=True \(RMSNorm\) takes no bias"):
        nm.norm_fwd(x, w, b, EPS, True)
    with pytest.raises(ValueError, match=r"norm_fp8: rms=True \(RMSNorm\) takes no bias"):
        nm.norm_fp8(x, w, b, EPS, True, e4)
    with pytest.raises(TypeError, match="rms must be a bool"):
        nm.norm_fwd(x, w, None, EPS, 1)
    with pytest.raises(TypeError, match="FP8"):
        nm.norm_fp8(x.to(e4), w, None, EPS, True, e4)
    with pytest.raises(TypeError, match="fp8_dtype"):
        nm.norm_fp8(x, w, None, EPS, True, torch.bfloat16)
    with pytest.raises(ValueError, match="margin"):
        nm.norm_fp8(x, w, b, EPS, False, e4, None, -1)
    with pytest.raises(ValueError, match=r"margin 18 is too large for torch.float8_e4m3fn"):
        nm.norm_fp8(x, w, b, EPS, False, e4, margin=18)
    nm.norm_fp8(x, w, b, EPS, False, e4, torch.ones(1), margin=18)  # ignored with a given scale
    with pytest.raises(TypeError, match="scale"):
        nm.norm_fp8(x, w, None, EPS, True, e4, torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="eps"):
        nm.norm_fwd(x, w, None, -1.0, True)
    with pytest.raises(ValueError, match="dy"):
        nm.norm_bwd(x[:2], x, w, mean, rstd)
    with pytest.raises(ValueError, match=r"rstd.*\(4,\).*\(3,\)"):
        nm.norm_bwd(x, x, w, None, rstd[:3])
    with pytest.raises(TypeError, match="mean"):
        nm.norm_bwd(x, x, w, mean.double(), rstd)
    with pytest.raises(ValueError, match=r"mean must have shape \(4,\)"):
        nm.norm_bwd(x, x, w, torch.empty(0), rstd)  # RMSNorm's backward takes mean None, not (0,)
    with pytest.raises(ValueError, match="last dim"):
        nm.norm_fwd(torch.empty(3, 0), torch.empty(0), None, EPS, True)


# ---- GPU tier ---------------------------------------------------------------------------------------

GPU_SHAPES = [
    ((16384, 4096), torch.bfloat16),
    ((3, 5, 1000), torch.bfloat16),
    ((257, 16384), torch.bfloat16),  # rows longer than MAX_ONE_CHUNK: the chunked loops
    ((33, 8192), torch.float32),
    ((129, 96), torch.float16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape, dtype", GPU_SHAPES, ids=str)
def test_gpu_against_references(kind, shape, dtype):
    torch.manual_seed(0)
    x, w, b = (t.cuda() if t is not None else None for t in inputs(shape, dtype, kind))
    y_ref, mean_ref, rstd_ref = fwd_ref(kind, x, w, b)
    # Longer rows, other summation trees: a looser (still tight) bound on the stats.
    rtol = 1e-5
    y, mean, rstd = fwd_triton(kind, x, w, b)
    assert_stats_close(mean, rstd, mean_ref, rstd_ref, rtol)
    assert_bits(y, y_from_stats(x, w, b, mean, rstd), "y from the kernel's stats")
    assert max_rel_err(y, y_ref) <= hp_rtol(dtype)

    for fp8_dtype, margin, p2, with_t in [(FP8[0], 0, False, True), (FP8[1], 1, True, False)]:
        out, m8, r8 = fp8_triton(kind, x, w, b, fp8_dtype, None, margin, p2, with_t)
        y8 = y_from_stats(x, w, b, m8, r8)
        assert_outputs(out, nm.quantize_y_ref(y8, fp8_dtype, None, margin, p2, with_t))
        # The forward's own compiled row kernel: the same stats, so fused == unfused bit for bit.
        assert_fwd_bits(kind, (y8, m8, r8), (y, mean, rstd))
        scale = torch.tensor([0.9 * fp8_max(fp8_dtype)], device="cuda") / y_ref.float().abs().max()
        out, m8, r8 = fp8_triton(kind, x, w, b, fp8_dtype, scale, with_t=with_t)
        y8 = y_from_stats(x, w, b, m8, r8)
        assert_outputs(out, nm.quantize_y_ref(y8, fp8_dtype, scale, with_transpose=with_t))
        assert_fwd_bits(kind, (y8, m8, r8), (y, mean, rstd))

    dy = torch.randn(shape, device="cuda").to(dtype)
    dx, dw, db = bwd_triton(kind, dy, x, w, mean, rstd)
    for name, ours, r in zip(("dx", "dweight", "dbias"), (dx, dw, db), nm.norm_bwd_ref(dy, x, w, mean, rstd)):
        if ours is not None:
            # dweight sums 16384 rows in float32 in another order: 1e-5 of the largest element.
            assert max_rel_err(ours, r) <= max(hp_rtol(dtype), 1e-5), name
    # With the residual's gradient added in the kernel (its own compiled variant: row sums may differ by an ulp).
    dres = torch.randn(shape, device="cuda").to(dtype)
    dx_res, dw_res, _ = nm.norm_bwd_triton(dy, x, w, mean, rstd, dres=dres)
    assert max_rel_err(dx_res, dx + dres) <= hp_rtol(dtype)
    assert max_rel_err(dw_res, dw) <= max(hp_rtol(dtype), 1e-5)

    # The ops' CUDA dispatch: the launchers' bits.
    rms = kind == "rms"
    for got, want in [
        (nm.norm_fwd(x, w, b, EPS, rms), nm.norm_fwd_triton(x, w, b, EPS, rms)),
        (
            nm.norm_fp8(x, w, b, EPS, rms, FP8[0], None, 1, True, True),
            nm.norm_fp8_triton(x, w, b, EPS, rms, FP8[0], None, 1, True, True),
        ),
        (nm.norm_fp8(x, w, b, EPS, rms, FP8[1], scale), nm.norm_fp8_triton(x, w, b, EPS, rms, FP8[1], scale)),
        (nm.norm_bwd(dy, x, w, mean, rstd), nm.norm_bwd_triton(dy, x, w, mean, rstd)),
    ]:
        for i, (o, r) in enumerate(zip(got, want)):
            assert o.device == x.device
            assert_bits(o, r, f"op output {i}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_exact_inputs_bit_exact(kind):
    x, w, b = (t.cuda() if t is not None else None for t in exact_inputs((1024, 4096), torch.bfloat16, kind))
    assert_fwd_bits(kind, fwd_triton(kind, x, w, b), fwd_ref(kind, x, w, b))
