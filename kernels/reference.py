"""The scaling semantics of float8, stated once, in plain PyTorch.

Every kernel in this folder has a `*_ref` twin built from these functions, and every test compares
against them:

- scale = fp8_max / amax, divided by 2**margin, clamped to the largest finite float32, optionally
  rounded down to a power of two, then clamped from below to min_scale(fp8_dtype) (2**-119 for E4M3,
  2**-112 for E5M2), all in float32. scale_inv = 1 / scale <= 1 / min_scale, so dequantizing any FP8
  value gives a finite float32, even for values near the float32 maximum.
- amax == 0 gives scale 1. A non-finite amax (inf or NaN) gives scale NaN: with current scaling a tensor
  (row, block) holding +-inf or NaN quantizes to NaN data with a NaN scale_inv, so it dequantizes to NaN,
  never to finite values (an overflowing gradient must not come out finite). Delayed scaling computes its
  scale from an amax history elsewhere (float8/recipe.py); with a given scale the cast below saturates.
- margin is at most max_margin(fp8_dtype) (17 for E4M3, 31 for E5M2): a larger one can send every value,
  amax included, to 0 (common.check_scaling_args refuses it).
- cast: x.float() * scale, rounded to nearest even, saturating: |v| > fp8_max -> +-fp8_max,
  +-inf -> +-fp8_max, NaN -> NaN. That is what Triton's `.to(tl.float8e4nv)` / `.to(tl.float8e5)`
  do on Hopper. Eager `tensor.to(torch.float8_e4m3fn)` does not saturate (500 -> NaN), so we clamp first.
- dequantize: fp8.float() * scale_inv, then cast to the nominal dtype.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLOAT32_MAX = torch.finfo(torch.float32).max


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 format: 448 for E4M3, 57344 for E5M2."""
    check_fp8_dtype(fp8_dtype)
    return float(torch.finfo(fp8_dtype).max)


def check_fp8_dtype(fp8_dtype: object) -> None:
    """TypeError unless fp8_dtype is torch.float8_e4m3fn or torch.float8_e5m2."""
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}")


def min_scale(fp8_dtype: torch.dtype) -> float:
    """The smallest scale: the smallest power of two p with fp8_max / p <= the largest float32.

    2**-119 for E4M3 (448 = 1.75 * 2**8), 2**-112 for E5M2 (57344 = 1.75 * 2**15). A scale_inv is at most
    1 / p, so fp8 * scale_inv never overflows to inf.
    """
    _, e = math.frexp(fp8_max(fp8_dtype))  # fp8_max = m * 2**e, m in [0.5, 1): m * 2**128 <= FLOAT32_MAX
    return 2.0 ** (e - 128)


def max_margin(fp8_dtype: torch.dtype) -> int:
    """The largest margin that still maps amax to a nonzero FP8 value, power_of_2 rounding included.

    With margin m (and the scale rounded down to a power of two) amax * scale lies in
    (fp8_max / 2**(m + 1), fp8_max / 2**m]; it rounds to a nonzero code while fp8_max / 2**(m + 1) is at
    least half the smallest subnormal s, i.e. while 2**m <= fp8_max / s: 17 for E4M3 (448 / 2**-9),
    31 for E5M2 (57344 / 2**-16).
    """
    fi = torch.finfo(fp8_dtype)
    smallest_subnormal = fi.smallest_normal * fi.eps
    _, e = math.frexp(fp8_max(fp8_dtype) / smallest_subnormal)
    return e - 1  # floor(log2(fp8_max / s))


def scale_from_amax(
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_2: bool = False,
) -> torch.Tensor:
    """float32 scale(s) for the given amax(es), elementwise.

    In [min_scale(fp8_dtype), largest float32] for a finite amax > 0; 1 for amax == 0; NaN for an inf or
    NaN amax. Never inf, never 0.
    """
    amax = amax.float()
    # Spelled out as torch evaluates `fp8_max / amax` (reciprocal, then multiply: two float32 roundings),
    # so that the kernels can reproduce it bit for bit.
    scale = amax.reciprocal() * fp8_max(fp8_dtype)
    if margin:
        scale = scale / (2.0**margin)
    scale = torch.clamp(scale, max=FLOAT32_MAX)
    if power_of_2:
        # Round down to a power of two, exactly (clear the mantissa): s = m * 2**e with m in [0.5, 1).
        # Multiplying by it is exact, so the only rounding left is the cast.
        _, exponent = torch.frexp(scale)
        scale = torch.where(scale > 0, torch.ldexp(torch.ones_like(scale), exponent - 1), scale)
    scale = torch.clamp(scale, min=min_scale(fp8_dtype))
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def cast_to_fp8_ref(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """RTNE, saturating cast of x.float() * scale (scale broadcasts against x)."""
    limit = fp8_max(fp8_dtype)
    scaled = x.float() * scale.float()
    # clamp keeps NaN as NaN and maps +-inf to +-limit: the saturating (satfinite) cast.
    return torch.clamp(scaled, -limit, limit).to(fp8_dtype)


def quantize_tensorwise_ref(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
    margin: int = 0,
    power_of_2: bool = False,
    with_transpose: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-tensor quantization: (data (x.shape), data_t (..., N, M) contiguous or an empty (0,) tensor,
    scale_inv () = 1 / scale, amax () = max|x|), all but data_t float32 scalars.

    scale None: current scaling, scale = scale_from_amax(max|x|, margin, power_of_2); else the given
    one-element scale (margin and power_of_2 ignored). float8::quantize_tensorwise (kernels/quantize.py)
    and the FP8 outputs of the fused norm and activation kernels follow it.
    """
    amax = amax_ref(x)
    if scale is None:
        scale = scale_from_amax(amax, fp8_dtype, margin, power_of_2)
    scale = scale.reshape(()).float()
    data = cast_to_fp8_ref(x.contiguous(), scale, fp8_dtype)
    if with_transpose:
        data_t = data.transpose(-2, -1).clone(memory_format=torch.contiguous_format)  # never a view of data
    else:
        data_t = torch.empty((0,), dtype=fp8_dtype, device=x.device)
    return data, data_t, scale.reciprocal(), amax


def amax_ref(x: torch.Tensor) -> torch.Tensor:
    """max(|x|) as a float32 scalar; NaN if x holds a NaN, 0 for an empty x."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    a = x.float().abs()
    # torch.amax propagates NaN, like the kernels (they reduce with a NaN-propagating max).
    return a.amax()


def expand_blocks(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Broadcast a per-block tensor (one value per block) to a tensor of `shape`.

    `scale` has 0 dims (one value for the tensor) or as many dims as `shape`, each dividing its
    counterpart: the block along dim d is shape[d] // scale.shape[d] elements long.
    """
    if scale.dim() == 0:
        return scale
    out = scale
    for d, (n, s) in enumerate(zip(shape, scale.shape)):
        if s not in (1, n):
            out = out.repeat_interleave(n // s, dim=d)
    return out


def dequantize_ref(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data.float() * scale_inv (broadcast over its blocks), in dtype."""
    return (data.float() * expand_blocks(scale_inv, data.shape)).to(dtype)
