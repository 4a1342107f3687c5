"""Make the Triton interpreter convert floats like the hardware does.

Triton's interpreter (triton/runtime/interpreter.py `_convert_float`, used by `create_fp_to_fp` and
`cast_impl`) gets float conversions wrong in ways the GPU does not, checked in test_interpreter.py:
- float32 -> FP8 loses the carry when rounding crosses a power of two (7.93 -> 4.0, not 8.0), does not
  saturate (500 -> 256, 465 -> NaN), rounds subnormals wrongly and turns NaN into a number (384);
- FP8 -> float32 decodes E4M3's NaN as 480 and E5M2's inf/NaN as 65536..114688;
- float32 -> bfloat16 truncates instead of rounding, and bfloat16 subnormals widen wrongly.
The fixture below replaces exactly those conversions (between float32, float16, bfloat16, FP8 E4M3 and
E5M2, in round-to-nearest-even) with what the hardware does: torch's RTNE conversions, and for an FP8
destination the satfinite cast of `cvt.rn.satfinite` (clamp to +-max, NaN stays NaN). Every other
conversion goes to the original. Test-side only: the library never patches Triton.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

try:
    import triton.language as tl
    from triton.runtime import interpreter as _interp
except ImportError:  # pragma: no cover - no triton: the kernel tests skip themselves
    tl = _interp = None

ORIGINAL_CONVERT_FLOAT = None if _interp is None else _interp._convert_float

if _interp is not None and os.environ.get("TRITON_INTERPRET") == "1":
    from float8.kernels.cast import _cast_kernel

    if not isinstance(_cast_kernel, _interp.InterpretedFunction):
        raise RuntimeError(
            "triton and float8 were imported before tests/conftest.py set TRITON_INTERPRET=1, so the Triton "
            "kernels were built for a GPU and cannot run on CPU tensors. Usual cause: a filterwarnings entry in "
            "pyproject.toml naming a float8 class (pytest imports it before any conftest). Remove it there: "
            "tests/conftest.py registers the same filter in pytest_configure. Or run with -o filterwarnings=."
        )

if tl is not None:
    _TORCH_OF = {
        tl.float32: torch.float32,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
    }
_INT_OF_BITS = {8: (np.uint8, torch.uint8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32)}


def hardware_convert_float(input, input_dtype, output_dtype, rounding_mode):
    """Drop-in for interpreter._convert_float: returns the output bits as unsigned ints."""
    src, dst = _TORCH_OF.get(input_dtype), _TORCH_OF.get(output_dtype)
    rtne = rounding_mode is None or rounding_mode == _interp._ir.ROUNDING_MODE.RTNE
    if src is None or dst is None or not rtne:
        return ORIGINAL_CONVERT_FLOAT(input, input_dtype, output_dtype, rounding_mode)
    in_np, in_t = _INT_OF_BITS[input_dtype.primitive_bitwidth]
    bits = np.ascontiguousarray(input).view(in_np)
    x = torch.from_numpy(bits.copy()).view(in_t).view(src)
    if dst in (torch.float8_e4m3fn, torch.float8_e5m2):
        limit = torch.finfo(dst).max
        x = torch.clamp(x.float(), -limit, limit)  # keeps NaN, +-inf -> +-limit: satfinite
    out_np, out_t = _INT_OF_BITS[output_dtype.primitive_bitwidth]
    y = x.to(dst).view(out_t).numpy()
    return y.view(getattr(np, f"uint{output_dtype.primitive_bitwidth}")).reshape(np.shape(input))


@pytest.fixture(autouse=True)
def hardware_float_conversions(monkeypatch):
    if _interp is not None:
        monkeypatch.setattr(_interp, "_convert_float", hardware_convert_float)
    # The interpreter computes with numpy, which warns where the GPU silently gives inf/NaN (inf * s, 1 / 0).
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        yield
