"""FP8 GEMM between Float8Tensors: `mm` and `addmm` (so `@`, `torch.matmul` and `F.linear`, which
decompose into views, `t` and these, run in FP8 too).

The GEMM is cuBLASLt through `torch._scaled_mm` (1225-1278 TFLOP/s at large shapes on the H100 here,
benchmarks/results/latest.md, README "Performance"); `torch._scaled_mm` also runs on the CPU. Its rules, which we enforce the same way
on every device so a CPU test catches what the GPU would refuse:
- A (M, K) row-major and B (K, N) column-major: we take each operand's data or its cached transpose,
  whichever already has the layout, and copy only when neither does;
- K and N multiples of 16 (M is free): otherwise a ValueError names the shapes; pad the tensors yourself;
- not both operands E5M2 (the tensor cores need one E4M3 operand);
- scales constant along K: per-tensor (0-d) or per-row of A (M, 1) and per-column of B (1, N). Block
  scales, or per-row scales along K, go to the high-precision fallback (with a warning).
What an operand's scales are is the layout its quantizer declares (`Float8Tensor.requantizer.layout`):
TENSOR and ROW take the FP8 GEMM where the scales run as above, BLOCK and OTHER never do; a tensor built
from its parts without a quantizer is taken by its scale's shape alone.
The output has the nominal dtype of the operands.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from float8 import dispatch
from float8.checks import ScaleLayout, dequantized_gemms
from float8.kernels.reference import dequantize_ref
from float8.kernels.transpose import transpose_fp8
from float8.tensor import Float8Tensor, _is_float8
from float8.writes import requantize_into

aten = torch.ops.aten


class Operand(NamedTuple):
    """A GEMM operand's parts, as a Float8Tensor holds them (optionally viewed transposed)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    transpose: Optional[torch.Tensor]
    dtype: torch.dtype
    layout: Optional[ScaleLayout] = None  # the quantizer's; None: a tensor built from its parts

    @property
    def shape(self) -> torch.Size:
        """The operand's logical shape."""
        return self.data.shape

    @property
    def fp8_dtype(self) -> torch.dtype:
        """The operand's FP8 format."""
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        """The operand's device."""
        return self.data.device


def operand(t: Float8Tensor, transposed: bool = False) -> Operand:
    """t, or t.t() without building a tensor (no dispatch: this is on every Linear's hot path)."""
    qid = t._quantizer_id
    layout = None if qid is None else qid[0]
    if not transposed:
        return Operand(t._data, t._scale_inv, t._transpose, t.dtype, layout)
    s = t._scale_inv if t._scale_inv.dim() == 0 else t._scale_inv.mT
    if t._transpose is not None:
        return Operand(t._transpose, s, t._data, t.dtype, layout)
    return Operand(t._data.mT, s, None, t.dtype, layout)


def column_major_only(t: Float8Tensor) -> Operand:
    """t as the B operand of a later GEMM, keeping only the layout that GEMM reads.

    A Linear's weight-gradient GEMM reads its input column-major, which is the transpose cache; saving
    just that (not the row-major bits the forward GEMM already used) halves the activation memory a
    Linear keeps for backward. Same bits, same GEMM call."""
    if t._transpose is None:
        return operand(t)
    return operand(t)._replace(data=t._transpose.mT, transpose=None)


def _aligned(d: torch.Tensor, unit: int = 16) -> bool:
    """Whether d starts `unit` bytes into an allocation (allocations are aligned, so only a view's offset
    can break it). Under torch.compile the offset is not known while tracing (dynamo cannot return an int
    from inside an autograd.Function): assumed aligned there, since graphs allocate their own tensors; a
    misaligned view reaching cuBLASLt in a graph fails loudly (CUBLAS_STATUS_NOT_SUPPORTED), not silently."""
    if torch.compiler.is_compiling():
        return True
    return d.storage_offset() * d.element_size() % unit == 0


def _row_major(t: Operand) -> torch.Tensor:
    """(M, K) data, contiguous: the data itself, or a copy (a transposed view: by the FP8 transpose kernel)."""
    d = t.data
    if d.is_contiguous():
        return d if _aligned(d) else d.clone()
    return _transposed_copy(d.mT) if d.mT.is_contiguous() else d.contiguous()


def _col_major(t: Operand) -> torch.Tensor:
    """(K, N) data with strides (1, K): the data viewed, the cached transpose viewed, or a copy."""
    d = t.data
    if d.mT.is_contiguous():
        if _aligned(d):
            return d
        if t.transpose is None:
            return d.mT.clone().mT
    if t.transpose is not None:
        return t.transpose.mT
    return _transposed_copy(d).mT if d.is_contiguous() else d.mT.contiguous().mT


def _transposed_copy(d: torch.Tensor) -> torch.Tensor:
    """d.mT, contiguous: the FP8 transpose kernel for a matrix (torch's strided copy of 1-byte elements
    is far below copy bandwidth), torch for a batch."""
    return transpose_fp8(d) if d.dim() == 2 else d.mT.contiguous()


def _aligned_scale(s: torch.Tensor) -> torch.Tensor:
    # cuBLASLt wants a scale pointer 16-byte aligned: a per-tensor scale that is a view at another offset
    # (one element of a shared buffer) failed with CUBLAS_STATUS_NOT_SUPPORTED on the H100. Copy it.
    return s.clone() if s.dim() == 0 and not _aligned(s) else s


def _gemm_scales(a: Operand, b: Operand):
    """(scale_a, scale_b, rowwise) in the layout _scaled_mm takes, or None where an operand's layout is not
    one an FP8 GEMM reads, or its scales do not run along the GEMM's outer dims."""
    if dequantized_gemms(a.layout) or dequantized_gemms(b.layout):
        return None
    sa, sb = _aligned_scale(a.scale_inv), _aligned_scale(b.scale_inv)
    m, n = a.shape[0], b.shape[1]
    a_ok = sa.dim() == 0 or tuple(sa.shape) == (m, 1)
    b_ok = sb.dim() == 0 or tuple(sb.shape) == (1, n)
    if not (a_ok and b_ok):
        return None
    if sa.dim() == 0 and sb.dim() == 0:
        return sa, sb, False
    sa = sa.expand(m, 1) if sa.dim() == 0 else sa
    sb = sb.expand(1, n) if sb.dim() == 0 else sb
    return sa.contiguous(), sb.contiguous(), True


def _check_operands(a: Operand, b: Operand, pad: bool) -> None:
    if a.data.dim() != 2 or b.data.dim() != 2:
        raise ValueError(f"FP8 mm needs 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"FP8 mm operands are on different devices: {a.device} and {b.device}")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"FP8 mm shapes do not chain: {tuple(a.shape)} @ {tuple(b.shape)}")
    if (k % 16 or n % 16) and not pad:
        raise ValueError(
            f"FP8 GEMM needs K and N to be multiples of 16 (cuBLASLt), got (M, K) = {(m, k)} @ (K, N) = {(k2, n)}; "
            "pad the tensors, or dequantize for this product"
        )
    if a.fp8_dtype == torch.float8_e5m2 and b.fp8_dtype == torch.float8_e5m2:
        # ValueError, not TypeError: `a @ b` turns a TypeError into "unsupported operand type(s)".
        raise ValueError("FP8 GEMM of two E5M2 operands is not supported by the tensor cores: make one E4M3")


def _pad_to_16(mat_a, mat_b, sb):
    """Zero-pad K (both operands) and N (B, and its per-column scales) up to multiples of 16.

    Zero bits are +0.0 in both FP8 formats, so padded K terms add nothing; padded N columns are sliced off
    the output. Costs one copy of each padded operand: for the token dim of a wgrad GEMM (K = tokens) and
    layer widths that are not multiples of 16.
    """
    k, n = mat_b.shape
    pk, pn = -k % 16, -n % 16
    if pk:
        mat_a = F.pad(mat_a.view(torch.uint8), (0, pk)).view(mat_a.dtype)
    bt = mat_b.t()  # (N, K) row-major
    bt = F.pad(bt.contiguous().view(torch.uint8), (0, pk, 0, pn)).view(mat_b.dtype)
    if pn and sb.dim() == 2:
        sb = F.pad(sb, (0, pn), value=1.0)
    return mat_a, bt.t(), sb, n


def fp8_mm(
    a: Union[Float8Tensor, Operand],
    b: Union[Float8Tensor, Operand],
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    pad: bool = False,
    fast_accum: bool = False,
) -> Optional[torch.Tensor]:
    """a @ b (+ bias) as one FP8 GEMM; None if the scale layouts need the fallback.

    a, b: Float8Tensors or `operand(...)`s (ops pass `operand(w8, transposed=True)` for w8.t()).
    pad=True zero-pads K and N to multiples of 16 instead of refusing them (ops use it: token counts
    are arbitrary, and a wgrad GEMM's K is the token count).
    fast_accum=True lets cuBLASLt skip the periodic promotion of the FP8 tensor-core accumulator into
    float32 (CUDA only): faster, less precise; TransformerEngine and torchao use it for the forward GEMM.
    """
    a = a if isinstance(a, Operand) else operand(a)
    b = b if isinstance(b, Operand) else operand(b)
    _check_operands(a, b, pad)
    scales = _gemm_scales(a, b)
    if scales is None:
        return None
    out_dtype = out_dtype or torch.promote_types(a.dtype, b.dtype)
    sa, sb, rowwise = scales
    mat_a, mat_b = _row_major(a), _col_major(b)
    n_out = None
    if mat_a.shape[1] % 16 or mat_b.shape[1] % 16:
        mat_a, mat_b, sb, n_out = _pad_to_16(mat_a, mat_b, sb)
        if n_out % 16:
            bias = None if bias is None else F.pad(bias, (0, -n_out % 16))
    fast = fast_accum and a.device.type == "cuda"
    out = _gemm(mat_a, mat_b, sa, sb, rowwise, bias, out_dtype, a.device, a.fp8_dtype, b.fp8_dtype, fast)
    return out if n_out is None or n_out == out.shape[1] else out[:, :n_out].contiguous()


def fp8_mm_or_dequantized(
    a: Union[Float8Tensor, Operand],
    b: Union[Float8Tensor, Operand],
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    pad: bool = False,
    fast_accum: bool = False,
) -> torch.Tensor:
    """fp8_mm, or, where the two operands' scale layouts cannot meet in one FP8 GEMM (e.g. per-row
    gradients against a per-tensor input), the same product from the dequantized operands, in float32."""
    out = fp8_mm(a, b, bias=bias, out_dtype=out_dtype, pad=pad, fast_accum=fast_accum)
    if out is not None:
        return out
    out = _dequantized(a) @ _dequantized(b)
    return (out + bias if bias is not None else out).to(out_dtype)


def _dequantized(t) -> torch.Tensor:
    t = t if isinstance(t, Operand) else operand(t)
    return dequantize_ref(t.data, t.scale_inv, torch.float32)


def _gemm(mat_a, mat_b, sa, sb, rowwise, bias, out_dtype, device, fp8_a, fp8_b, fast_accum=False):
    cuda_rowwise = device.type == "cuda" and out_dtype == torch.bfloat16 and fp8_a == fp8_b == torch.float8_e4m3fn
    if not rowwise or cuda_rowwise:
        fused_bias = (
            bias is not None
            and not rowwise
            and bias.dim() == 1
            and bias.dtype == out_dtype
            and out_dtype != torch.float32
        )
        out = torch._scaled_mm(
            mat_a,
            mat_b,
            scale_a=sa,
            scale_b=sb,
            # _scaled_mm reads its bias as contiguous whatever its strides (a strided bias came out wrong on
            # the CPU, found in review 2026-11-25): give it contiguous memory (no copy when it already is).
            bias=bias.contiguous() if fused_bias else None,
            out_dtype=out_dtype,
            use_fast_accum=fast_accum,
        )
        if bias is not None and not fused_bias:
            out = out + bias
        return out
    # Per-row scales where _scaled_mm has no such mode: GEMM with unit scales in float32, then scale.
    # The same arithmetic as cuBLAS's (scales applied to the float32 accumulator), one extra pass.
    one = torch.ones((), dtype=torch.float32, device=device)
    acc = torch._scaled_mm(mat_a, mat_b, scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast_accum)
    out = acc * (sa * sb)  # the scales first, as cuBLAS folds them: acc * sa alone may overflow
    if bias is not None:
        out = out + bias
    return out.to(out_dtype)


def _fallback(func, args, kwargs):
    return dispatch.fallback(func, args, kwargs, _is_float8, requantize_into)


def _mixed(a, b) -> bool:
    """One Float8Tensor operand and one plain tensor: the product of the dequantized operand and the plain
    one, in high precision. This is what the backward pass of an FP8 GEMM between tensors that require
    grad computes (grad @ b8.t()), so it runs natively, without the fallback's warning."""
    return _is_float8(a) != _is_float8(b) and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)


def _plain(t):
    return t.dequantize() if _is_float8(t) else t


@dispatch.implements([aten.mm.default])
def _mm(func, args, kwargs):
    a, b = args[0], args[1]
    if _is_float8(a) and _is_float8(b):
        out = fp8_mm(a, b)
        if out is not None:
            return out
    elif _mixed(a, b):
        return torch.mm(_plain(a), _plain(b))
    return _fallback(func, args, kwargs)


@dispatch.implements([aten.addmm.default])
def _addmm(func, args, kwargs):
    bias, a, b = args[0], args[1], args[2]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if _is_float8(bias):
        return _fallback(func, args, kwargs)
    if _is_float8(a) and _is_float8(b):
        simple = beta == 1 and alpha == 1
        out = fp8_mm(a, b, bias=bias if simple else None)
        if out is not None:
            if simple:
                return out
            # beta == 0 ignores the input entirely (torch's rule: an inf or NaN there must not leak in).
            out = out if alpha == 1 else alpha * out
            return out if beta == 0 else out + beta * bias
    elif _mixed(a, b):
        return torch.addmm(bias, _plain(a), _plain(b), beta=beta, alpha=alpha)
    return _fallback(func, args, kwargs)
