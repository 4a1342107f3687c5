"""Inputs and comparisons shared by the kernel tests."""

from __future__ import annotations

import os

import pytest
import torch

from float8.kernels.reference import HIGH_PRECISION_DTYPES

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
HP = HIGH_PRECISION_DTYPES

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the Triton launchers on CPU tensors: needs TRITON_INTERPRET=1 (tests/conftest.py sets it "
    "when there is no CUDA)",
)


# ---- comparisons ------------------------------------------------------------------------------------

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def assert_bits(ours: torch.Tensor, ref: torch.Tensor, what: str = "", nan_bits: bool = True) -> None:
    """Same dtype, shape and bits. nan_bits=False: where ref is NaN, ours only has to be a NaN (any code).

    The GPU's cvt.rn.satfinite may not keep a NaN's sign, torch's conversion does, and an amax's NaN payload
    is whatever NaN the input had: NaN payloads are not part of the contract, NaN-ness is.
    """
    assert ours.dtype == ref.dtype, f"{what}: dtype {ours.dtype} != {ref.dtype}"
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    assert ours.is_contiguous(), f"{what}: output not contiguous"
    a = ours.reshape(-1).view(_BITS[ours.element_size()])
    b = ref.contiguous().reshape(-1).view(_BITS[ref.element_size()])
    same = a == b
    if not nan_bits:
        same |= ref.reshape(-1).float().isnan() & ours.reshape(-1).float().isnan()
    bad = (~same).nonzero().flatten()
    if bad.numel():
        i = bad[:5].tolist()
        raise AssertionError(
            f"{what}: {bad.numel()} of {a.numel()} elements differ, first at flat {i}: "
            f"ours {ours.reshape(-1)[i].float().tolist()} (bits {a[i].tolist()}) vs "
            f"ref {ref.reshape(-1)[i].float().tolist()} (bits {b[i].tolist()})"
        )


def assert_outputs(ours, ref, names, nan_bits=True) -> None:
    """Output by output, bit for bit (assert_bits), named by `names`, with two exceptions to the NaN bits.

    An amax's NaN payload is the input's: compared as NaN-ness. And where the reference's scale_inv holds
    a NaN (a non-finite amax under current scaling: reference.scale_from_amax), data and data_t are
    x * NaN, whose sign is the platform's pick of NaN operand when x is a NaN too (numpy's interpreter
    keeps x's, torch's CPU kernels the scale's): their NaNs are compared as NaN-ness too.
    """
    assert len(ours) == len(ref) == len(names)
    nan_scale = "scale_inv" in names and bool(ref[list(names).index("scale_inv")].isnan().any())
    for o, r, n in zip(ours, ref, names):
        exact = nan_bits and n != "amax" and not (nan_scale and n in ("data", "data_t"))
        assert_bits(o, r, n, nan_bits=exact)


class CountedLaunches:
    """Stands in for a JITFunction: counts launches (kernel[grid](...)) and forwards them."""

    def __init__(self, fn):
        self.fn, self.n = fn, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.fn[grid]


# ---- inputs -----------------------------------------------------------------------------------------


def fp8_grid(fp8_dtype: torch.dtype) -> torch.Tensor:
    """float32: all 256 codes decoded, the midpoints between adjacent finite codes of the same sign, and
    each midpoint nudged one float32 ulp down and up (RTNE must go to the even code at the midpoint, to
    the nearer code off it). Also +-(max + half an ulp) etc. come out of the top midpoints."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).float()
    finite = codes[torch.isfinite(codes)]
    pos = torch.unique(finite[finite >= 0])  # sorted, one zero
    mids = (pos[1:] + pos[:-1]) / 2  # exact in float32: FP8 has 2-3 mantissa bits
    mids = torch.cat([mids, pos[-1:] * (1 + 2.0**-4)])  # beyond the largest: saturates
    nudged = torch.cat([torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), float("inf")))])
    grid = torch.cat([codes, mids, -mids, nudged, -nudged])
    return grid


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """0, -0, the smallest subnormal and normal of `dtype`, +-inf, NaN, values around the FP8 maxima."""
    fi = torch.finfo(dtype)
    v = [
        0.0,
        -0.0,
        fi.smallest_normal,
        -fi.smallest_normal,
        fi.tiny / 2,
        float("inf"),
        float("-inf"),
        float("nan"),
        448.0,
        449.0,
        464.0,
        465.0,
        500.0,
        -500.0,
        57344.0,
        61440.0,
        61441.0,
        -70000.0,
        7.93,
    ]
    t = torch.tensor(v, dtype=torch.float32)
    if dtype != torch.float32:
        t = torch.cat([t, torch.tensor([2.0**-149, 1e-30], dtype=torch.float32)])
    sub = torch.tensor([fi.smallest_normal * 0.375], dtype=torch.float32)  # a subnormal of dtype
    return torch.cat([t, sub]).to(dtype)


def make_x(shape, dtype=torch.bfloat16, layout="contiguous", seed=0, specials=False, scale=3.0, device="cpu"):
    """Random normal * scale in `dtype`, `shape`, laid out as asked:
    contiguous; transposed (a .transpose(-2, -1) view); offset (x[1:, 2:] of a bigger tensor);
    strided (every other column)."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)

    def rnd(s):
        t = torch.randn(s, generator=g) * scale
        if specials and t.numel():
            sv = special_values(dtype).float()
            idx = torch.randperm(t.numel(), generator=g)[: min(len(sv), t.numel())]
            t.view(-1)[idx] = sv[: len(idx)]
        return t.to(dtype).to(device)  # the view below is taken on the device

    if layout == "contiguous" or len(shape) < 2:
        return rnd(shape)
    if layout == "transposed":
        return rnd((*shape[:-2], shape[-1], shape[-2])).transpose(-2, -1)
    if layout == "offset":
        return rnd((*shape[:-2], shape[-2] + 1, shape[-1] + 2))[..., 1:, 2:]
    if layout == "strided":
        return rnd((*shape[:-1], 2 * shape[-1]))[..., ::2]
    raise ValueError(layout)


# ---- the device-side scale rule, alone --------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from float8.kernels.common import fp8_constants  # noqa: E402
from float8.kernels.common import scale_from_amax as _device_scale_from_amax  # noqa: E402


@triton.jit
def _scale_kernel(
    amax_ptr,  # (N,) fp32
    scale_ptr,  # (N,) fp32
    n,
    margin_div,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,  # reference.min_scale(fp8_dtype), for scale_from_amax
    POWER_OF_2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(amax_ptr + offs, mask=offs < n, other=1.0)
    tl.store(scale_ptr + offs, _device_scale_from_amax(a, FP8_MAX, MIN_SCALE, margin_div, POWER_OF_2), mask=offs < n)


def device_scale(amax: torch.Tensor, fp8_dtype, margin=0, power_of_2=False) -> torch.Tensor:
    """common.scale_from_amax (what every kernel computes) applied to a float32 vector of amaxes."""
    amax = amax.float().contiguous()
    out = torch.empty_like(amax)
    block = 1024
    _scale_kernel[(triton.cdiv(amax.numel(), block),)](
        amax, out, amax.numel(), float(2.0**margin), **fp8_constants(fp8_dtype), POWER_OF_2=power_of_2, BLOCK=block
    )
    return out


def exact_pow2_floor(s: torch.Tensor) -> torch.Tensor:
    """The largest power of two <= s (s >= 0, finite; 0 and NaN stay), independently of the kernels' bit trick."""
    _, e = torch.frexp(s)  # s = m * 2**e, m in [0.5, 1)
    return torch.where((s == 0) | s.isnan(), s, torch.ldexp(torch.ones_like(s), e - 1))


def amax_samples(device="cpu", n=4000, seed=0) -> torch.Tensor:
    """float32 amaxes: log-uniform over the whole float32 range, plus every edge the scale rule has."""
    g = torch.Generator().manual_seed(seed)
    logs = torch.rand(n, generator=g, dtype=torch.float64) * 277 - 149  # 2**-149 .. 2**128
    rnd = torch.exp2(logs).float()
    rnd = rnd[torch.isfinite(rnd) & (rnd > 0)]
    f32 = torch.finfo(torch.float32)
    edges = [
        0.0,
        -0.0,
        2.0**-149,
        1e-45,
        1e-40,
        f32.tiny,
        1e-37,
        448 / f32.max,
        1e-36,
        2.0**-126,
        1.0,
        448.0,
        57344.0,
        448.0 * (1 + 2**-23),
        3.0,
        1e30,
        f32.max,
        float("inf"),
        float("nan"),
        -1.0,
        float("-inf"),
        1.75 * 2.0**127,
        1.7500001 * 2.0**127,
        1.7499999 * 2.0**127,
        3e38,
    ]  # 1.75 * 2**127: scale = min_scale
    # amaxes whose scale lands on, or one ulp either side of, a power of two
    p = torch.exp2(torch.arange(-20, 21, dtype=torch.float32))
    at = 448.0 / p
    near = torch.cat([at, torch.nextafter(at, torch.zeros(())), torch.nextafter(at, torch.full((), 1e38))])
    return torch.cat([rnd, torch.tensor(edges), near]).to(device)
