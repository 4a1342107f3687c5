"""The scaling semantics of float8, stated once, in plain PyTorch.

Every kernel in this folder has a `*_ref` twin built from these functions, and every test compares
against them. DESIGN.md section 3 in code:

- scale = fp8_max / amax, divided by 2**margin, optionally rounded down to a power of two; computed in
  float32 and clamped to the largest finite float32. scale_inv = 1 / scale.
- amax == 0 gives scale 1; a non-finite amax gives scale 1 here (delayed scaling keeps its previous
  scale instead, see `float8.recipe`).
- cast: x.float() * scale, rounded to nearest even, saturating: |v| > fp8_max -> +-fp8_max,
  +-inf -> +-fp8_max, NaN -> NaN. That is what Triton's `.to(tl.float8e4nv)` / `.to(tl.float8e5)`
  do on Hopper. Eager `tensor.to(torch.float8_e4m3fn)` does not saturate (500 -> NaN), so we clamp first.
- dequantize: fp8.float() * scale_inv, then cast to the nominal dtype.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLOAT32_MAX = torch.finfo(torch.float32).max


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 format: 448 for E4M3, 57344 for E5M2."""
    check_fp8_dtype(fp8_dtype)
    return float(torch.finfo(fp8_dtype).max)


def check_fp8_dtype(fp8_dtype) -> None:
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(
            f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}"
        )


def scale_from_amax(
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    power_of_2: bool = False,
) -> torch.Tensor:
    """float32 scale(s) for the given amax(es), elementwise. Never inf, never NaN, never 0."""
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
    good = torch.isfinite(amax) & (amax > 0)
    return torch.where(good, scale, torch.ones_like(scale))


def cast_to_fp8_ref(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """RTNE, saturating cast of x.float() * scale (scale broadcasts against x)."""
    limit = fp8_max(fp8_dtype)
    scaled = x.float() * scale.float()
    # clamp keeps NaN as NaN and maps +-inf to +-limit: the saturating (satfinite) cast.
    return torch.clamp(scaled, -limit, limit).to(fp8_dtype)


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
    return (data.float() * expand_blocks(scale_inv, data.shape)).to(dtype)
