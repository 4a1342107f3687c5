"""Collectives along the rows (tokens) of a 2-D activation, for tensor and sequence parallelism.

The ops of ops/parallel.py call these. Rows are dim 0; each rank holds an equal block of them, in
rank order. Unlike the c10d handlers (float8/collectives.py), which first agree with one small all-gather
on what every rank passes, these run on the hot path of every layer: the ops guarantee the shapes (and
check them where a mismatch could go unnoticed), and the scale check of an FP8 gather costs no host sync.

- `gather_rows` all-gathers a plain tensor, or a Float8Tensor as its FP8 bytes (uint8) plus its scales:
  row-wise and block scales travel with their rows; a per-tensor scale must be one across the group. A
  caller whose quantizer reduces the amax over the group knows the scales are equal (`one_scale=True`):
  the gathered scales are still compared on the device, and a mismatch makes the result's scale NaN (every
  value it gives is NaN, never a finite wrong one). Otherwise (`one_scale=False`) they are compared on the
  host and a mismatch raises ValueError on every rank.
- `reduce_scatter_rows` and `all_reduce_sum` reduce in high precision (a Float8Tensor is dequantized
  first): FP8 bits under different scales cannot be summed.

Under torch.compile the same functions trace: they call torch's functional collectives (which the
compiler schedules and can overlap), and no check syncs the host. The ops then compare shapes on the
device (`shapes_agree`) and turn the forward result of a mismatch NaN (`nan_unless`). An FP8 input whose
per-tensor scale nobody made one across the group (`one_scale=False`) is gathered dequantized there: the
host cannot compare the scales, and a NaN would punish an ordinary input.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from float8.kernels.reference import FP8_DTYPES, HIGH_PRECISION_DTYPES
from float8.tensor import Float8Tensor

# torch 2.13 renamed the single-tensor collectives (the old names warn); torch 2.11 has the old names only.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def check_group(group: object, who: str) -> dist.ProcessGroup:
    """`group`, if it is a ProcessGroup of an initialized torch.distributed; else a ValueError naming `who`."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{who} needs torch.distributed initialized (init_process_group) and a process group")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{who} takes a torch.distributed ProcessGroup, got {type(group).__name__}")
    return group


MAX_DIMS = 8


def check_same_shape(
    x: torch.Tensor, group: dist.ProcessGroup, who: str, shape: Optional[tuple] = None, grad: Optional[bool] = None
) -> None:
    """Every rank of `group` holds an activation of `shape` (default x's) and of one format, in one grad mode
    (`grad`: whether the run records a backward, when given), or every rank raises a ValueError naming them
    (a collective of tensors of different sizes would hang or mix up data; token dims that differ with the
    same number of tokens, a sequence split differently, would give finite wrong results; an FP8 activation
    on one rank and a high-precision one on another take different collectives, and a rank that records a
    backward runs collectives in it that the others never join: both hang). One all-gather of a few int64s
    and one host sync: the ops call it once per run, not once per collective."""
    gathered = _gather(_shape_row(x, shape, who, grad), group).tolist()  # the one host sync
    seen = [(tuple(row[1 : 1 + row[0]]), _FORMATS[row[-2]], _GRAD_MODES[row[-1]]) for row in gathered]
    if any(s != seen[0] for s in seen):
        raise ValueError(
            f"{who}: the ranks of the group hold activations of different shapes, formats or grad modes {seen}; "
            "tensor- and sequence-parallel collectives need the same shape (equal blocks of the sequence), the "
            "same format (all FP8, or all high precision, of one dtype) and the same grad mode (every rank "
            "training, or none) on every rank"
        )


_GRAD_MODES = ("no backward", "backward", "grad mode not given")  # indexed by the code: 0, 1, -1


# The formats an activation's row names (an index here): its dtype, FP8 bits by their format.
_DTYPES = (*HIGH_PRECISION_DTYPES, torch.float64)
_FORMATS = ("other", *(str(d)[6:] for d in _DTYPES), *("FP8 " + str(d)[6:] for d in FP8_DTYPES))
_CODES = {d: i + 1 for i, d in enumerate(_DTYPES)}
_FP8_CODES = {d: i + 1 + len(_DTYPES) for i, d in enumerate(FP8_DTYPES)}


def _format_code(x: torch.Tensor) -> int:
    if isinstance(x, Float8Tensor):
        return _FP8_CODES.get(x.fp8_dtype, 0)
    return _CODES.get(x.dtype, 0)


def _shape_row(x: torch.Tensor, shape: Optional[tuple], who: str, grad: Optional[bool] = None) -> torch.Tensor:
    """`shape` (default x's) as MAX_DIMS + 3 int64s on x's device: the count, the sizes padded with -1, the
    activation's format (an index into _FORMATS) and the grad mode (1, 0, or -1 when not given)."""
    shape = tuple(x.shape) if shape is None else tuple(shape)
    if len(shape) > MAX_DIMS:
        raise ValueError(f"{who}: activations of up to {MAX_DIMS} dims, got shape {shape}")
    grad_code = -1 if grad is None else int(bool(grad))
    row = [len(shape), *shape] + [-1] * (MAX_DIMS - len(shape)) + [_format_code(x), grad_code]
    return torch.tensor(row, dtype=torch.int64, device=x.device).reshape(1, -1)


def shapes_agree(
    x: torch.Tensor, group: dist.ProcessGroup, shape: Optional[tuple] = None, grad: Optional[bool] = None
) -> torch.Tensor:
    """Whether every rank of `group` holds an activation of `shape` (default x's), of one format and in one
    grad mode (as `check_same_shape`), as a bool tensor on x's device: the check of traced code
    (torch.compile), which cannot sync the host. One all-gather of a few int64s. A different number of tokens also makes the collective after it mismatch, which the backend
    itself ends (gloo aborts the process; NCCL's watchdog at the group's timeout): what this check turns
    NaN is the rest, token dims that differ with the same number of tokens."""
    shapes = _gather(_shape_row(x, shape, "shapes_agree", grad), group)
    return (shapes == shapes[0]).all()


def nan_unless(ok: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y where `ok` holds, else all NaN: a traced collective's result after `shapes_agree` found the ranks'
    shapes different, so that nothing computed from it is finite. A Float8Tensor's scale turns NaN (no
    pass over its bytes)."""
    if isinstance(y, Float8Tensor):
        scale_inv = torch.where(ok, y._scale_inv, torch.full_like(y._scale_inv, float("nan")))
        return Float8Tensor(y._data, scale_inv, y.dtype, transpose=y._transpose, quantizer_id=y._quantizer_id)
    return torch.where(ok, y, torch.full_like(y, float("nan")))


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return funcol.all_gather_tensor(x.contiguous(), 0, group)
    out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x.contiguous(), group=group)
    return out


def gather_rows(
    x: torch.Tensor, group: dist.ProcessGroup, *, with_transpose: bool = False, one_scale: bool = False
) -> torch.Tensor:
    """All-gather the rows of x (M, ...) into (world * M, ...): a plain tensor in its dtype, a Float8Tensor
    as FP8 bytes with its scales (see the module docstring for per-tensor scales and `one_scale`). With
    `with_transpose`, the gathered Float8Tensor also holds its FP8 transpose (for a backward GEMM)."""
    if not isinstance(x, Float8Tensor):
        return _gather(x, group)
    s = x._scale_inv
    if s.dim() == 0 and not one_scale and torch.compiler.is_compiling():
        return _gather(x.dequantize(), group)
    bits = _gather(x._data.view(torch.uint8), group).view(x.fp8_dtype)
    if s.dim() == 0:
        scales = _gather(s.reshape(1), group)
        if one_scale:
            # No host sync: a mismatch turns the scale NaN, so that nothing computed from it is finite.
            scale_inv = torch.where((scales == scales[0]).all(), scales[0], torch.full_like(scales[0], float("nan")))
        else:
            if not bool((scales == scales[0]).all()):
                raise ValueError(
                    f"all-gather of per-tensor scaled FP8 rows: the ranks' scales differ ({scales.tolist()}), and "
                    "one tensor holds one scale. Quantize with a quantizer whose amax_group is this group, or "
                    "gather high precision"
                )
            scale_inv = scales[0].clone()
    else:
        if x.shape[0] % s.shape[0]:
            raise ValueError(
                f"all-gather of FP8 rows: a scale block spans {x.shape[0]} rows unevenly ({tuple(s.shape)})"
            )
        scale_inv = _gather(s, group)
    transpose = None
    if with_transpose and torch.is_grad_enabled() and bits.dim() == 2:
        transpose = bits.t().contiguous()
    return Float8Tensor(bits, scale_inv, x.dtype, transpose=transpose, quantizer_id=x._quantizer_id)


def _plain(x: torch.Tensor) -> torch.Tensor:
    return x.dequantize() if isinstance(x, Float8Tensor) else x


def reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum x (world * M, ...) over the group, in high precision, and keep this rank's block of M rows."""
    x = _plain(x)
    world = group.size()
    if x.shape[0] % world:
        raise ValueError(
            f"reduce-scatter of rows: {x.shape[0]} rows do not split evenly over {world} ranks; sequence-parallel "
            f"activations need a token count divisible by the group size"
        )
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(x.contiguous(), "sum", 0, group)
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    _reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """x summed over the group, in high precision (a new tensor; x is left as it is)."""
    if torch.compiler.is_compiling():
        return funcol.all_reduce(_plain(x).contiguous(), "sum", group)
    out = _plain(x).clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


__all__ = [
    "all_reduce_sum",
    "check_group",
    "check_same_shape",
    "gather_rows",
    "nan_unless",
    "reduce_scatter_rows",
    "shapes_agree",
]
