"""Collective ops for tensor and sequence parallelism (Megatron-style), on a given process group.

Activations between ops are 2-D (tokens, features); these ops move rows (tokens). With sequence
parallelism each rank holds an equal block of the tokens, in rank order: feed activations sequence-first,
(S, B, features) sharded along S (or batch-first with batch 1, or 2-D (tokens, features) sharded along
tokens), so that a rank's block is contiguous; ops.Attention(sequence_first=True) reads (S, B) token dims. Each op's backward is its forward's conjugate:

    AllGather        forward: all-gather rows        backward: reduce-scatter (sum) in high precision
    ReduceScatter    forward: reduce-scatter (sum)   backward: all-gather rows
    AllReduce        forward: all-reduce (sum)       backward: identity
    AllReduce(in_backward=True)  forward: identity   backward: all-reduce (sum)

A sequence-parallel Linear's input is gathered as FP8 (half the bytes of a bf16 all-gather) under one
per-tensor scale across the group, because that Linear's input quantizer reduces its amax over the group
(ops/linear.py sets this up). Under current scaling AllGather quantizes its input itself (the amax
all-reduced, then the cast) and gathers the bytes alone: every rank derived the same scale. Under delayed
scaling it passes the request on to the op before, whose kernel (a norm's) writes the FP8 with the
history's scale, and the gathered scales are compared on the device (float8/row_collectives.py says what
a mismatch does). `Linear(..., parallel=..., tp_group=...)` places these ops itself (its `expand`); they
are public for layers built by hand.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from float8 import Float8Tensor
from float8.ops.base import BasicOp, OpContext, QuantRequest, plain
from float8.quantizer import ScaleLayout, TensorwiseQuantizer
from float8.row_collectives import (
    all_reduce_sum,
    check_group,
    check_same_shape,
    gather_rows,
    nan_unless,
    reduce_scatter_rows,
    shapes_agree,
)


class _RowCollective(BasicOp):
    def __init__(self, group):
        super().__init__()
        self.group = check_group(group, type(self).__name__)
        self.shape_checked_group = self.group

    def extra_repr(self) -> str:
        return f"group size={self.group.size()}"

    def _agree(self, ctx: OpContext, x) -> Optional[torch.Tensor]:
        """Once per run and group: every rank runs the same ops, so the first collective of a run checks the
        shapes and the rest follow from them. The shape compared is the activation's with its token dims
        (`ctx.run.lead`), not only its row count: ranks holding (128, 2) and (64, 4) tokens gather the same
        number of rows but split them into sequences differently. Eagerly on the host (a ValueError on every
        rank; one host sync per run, not per collective). Under torch.compile, whose traced code cannot sync
        the host, on the device: the bool returned goes to `nan_unless` on this collective's result (NaN on
        a mismatch; a different row count also makes the collective itself mismatch, which the backend
        ends: row_collectives.shapes_agree)."""
        # Keyed by the group's name: dynamo of torch 2.11 cannot trace id() of a ProcessGroup.
        if self.group.group_name in ctx.run.shapes_agreed:
            return None
        ctx.run.shapes_agreed.add(self.group.group_name)
        lead = tuple(ctx.run.lead)
        shape = (*lead, *x.shape[1:]) if lead and math.prod(lead) == x.shape[0] else tuple(x.shape)
        if torch.compiler.is_compiling():
            return shapes_agree(x, self.group, shape, ctx.run.grad)
        check_same_shape(x, self.group, type(self).__name__, shape, ctx.run.grad)
        return None

    def _set_lead(self, ctx: OpContext, rows_before: int, rows_after: int) -> None:
        # The token dims restored on the Sequential's output. Rows are the token dims flattened, so
        # concatenating (or splitting) rank blocks of rows scales the first dim larger than 1: the sequence
        # of a sequence-first (S, B) activation, or of a batch-first one with batch 1.
        lead = list(ctx.run.lead)
        if not lead or rows_before == rows_after:
            return
        i = next((i for i, n in enumerate(lead) if n > 1), len(lead) - 1)
        if (lead[i] * rows_after) % rows_before:
            raise ValueError(
                f"{type(self).__name__}: token dims {tuple(lead)} cannot be split over {self.group.size()} ranks along "
                f"dim {i}; sequence-parallel activations are sequence-first (S, B, features), S divisible by the group"
            )
        lead[i] = lead[i] * rows_after // rows_before
        ctx.run.lead = tuple(lead)


class AllGather(_RowCollective):
    """All-gather the rows of the activation over `group` (sequence parallel -> full sequence). An FP8 input
    moves as FP8 bytes; the gradient is reduce-scattered (summed) in high precision."""

    relays_request = True

    def _one_scale(self, request: Optional[QuantRequest]) -> bool:
        # The quantizer makes one per-tensor scale across the group: its amax is reduced over this group.
        return (
            request is not None
            and request.quantizer.layout is ScaleLayout.TENSOR
            and request.quantizer.amax_group is self.group
        )

    def _casts_itself(self, request: Optional[QuantRequest]) -> bool:
        # Current scaling over this group: the amax is all-reduced right before the cast, so every rank derives
        # the same scale and none need be gathered or compared. The op before could not fuse that cast (its
        # kernel cannot reduce over the group), so this op casts, and knows where its FP8 came from. Delayed
        # scaling takes the scale from a history each rank keeps (a rank can let it drift): the op before
        # writes that FP8 in its kernel and the gathered scales are compared.
        return self._one_scale(request) and type(request.quantizer) is TensorwiseQuantizer

    def relay(self, request: Optional[QuantRequest]) -> Optional[QuantRequest]:
        """The request this op passes to the op before it, given the request of the op after it: the same
        quantizer, without the transpose (that of the local rows is of no use: it is made after the
        gather), when that quantizer's scale is one across the group and comes from a kept state (delayed
        or static scaling); a request for high precision when this op casts itself (current scaling over
        the group); else None (the op before writes high precision, which is gathered, then quantized)."""
        if self._casts_itself(request):
            return _HighPrecisionRequest(request.quantizer, False)
        if self._one_scale(request):
            return QuantRequest(request.quantizer, False)
        return None

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest] = None) -> torch.Tensor:
        ok = self._agree(ctx, x)
        rows = x.shape[0]
        if isinstance(x, Float8Tensor):
            # Written for the relayed request by the op before: one scale by construction (checked on the
            # device). An FP8 input from outside the run: its scales are compared on the host (traced, it is
            # gathered dequantized instead, and quantized below like a high-precision input).
            relayed = not ctx.first and self._one_scale(out_request) and not self._casts_itself(out_request)
            transpose = relayed and out_request.with_transpose and ctx.run.grad
            y = gather_rows(x, self.group, with_transpose=transpose, one_scale=relayed)
        elif self._casts_itself(out_request):
            # Quantized here with the amax reduced over the group (one all-reduce) and gathered as FP8 bytes
            # alone: two collectives, not three. The scale is this rank's, which every rank derived from the
            # same amax; the Linear makes the transpose it needs from the gathered bits.
            x8 = out_request.quantizer._quantize(x, False)
            bits = gather_rows(x8._data.view(torch.uint8), self.group)
            y = Float8Tensor(bits.view(x8.fp8_dtype), x8._scale_inv, x8.dtype, quantizer_id=x8._quantizer_id)
        else:
            y = gather_rows(x, self.group)
        if not isinstance(y, Float8Tensor):
            if ok is not None:
                y, ok = nan_unless(ok, y), None
            if out_request is not None:
                y = out_request._quantize(y)
        if ok is not None:
            y = nan_unless(ok, y)
        self._set_lead(ctx, rows, y.shape[0])
        return y

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        return reduce_scatter_rows(plain(dy), self.group), []


class _HighPrecisionRequest(QuantRequest):
    """What an AllGather that quantizes its input itself asks of the op before it: high precision. A producer
    that could fuse the cast sees `fuses` False and writes high precision; one that quantizes whatever is
    requested (ops.Quantize) gets its input back unchanged from `_quantize`, instead of quantizing with a
    scale of its rank's own, which the gather could not serve."""

    @property
    def fuses(self) -> bool:
        """No: the consumer casts, after the producer."""
        return False

    def _quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x as it is: high precision, which the AllGather quantizes over its group."""
        return x


class ReduceScatter(_RowCollective):
    """Sum the activation over `group` and keep this rank's block of rows (the end of a row-parallel
    Linear under sequence parallelism); the gradient is all-gathered."""

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest] = None) -> torch.Tensor:
        ok = self._agree(ctx, x)
        rows = x.shape[0]
        y = reduce_scatter_rows(plain(x), self.group)
        if ok is not None:
            y = nan_unless(ok, y)
        self._set_lead(ctx, rows, y.shape[0])
        return y

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        dx = gather_rows(plain(dy), self.group)
        return (dx_request._quantize(dx) if dx_request is not None else dx), []


class AllReduce(_RowCollective):
    """Sum the activation over `group` (the end of a row-parallel Linear without sequence parallelism);
    the backward is the identity. With in_backward=True it is the conjugate: the identity forward and the
    sum of the gradient over the group backward (the start of a column-parallel Linear)."""

    def __init__(self, group, *, in_backward: bool = False):
        super().__init__(group)
        self.in_backward = in_backward

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, in_backward={self.in_backward}"

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest] = None) -> torch.Tensor:
        ok = self._agree(ctx, x)
        y = x if self.in_backward else all_reduce_sum(x, self.group)
        return y if ok is None else nan_unless(ok, y)

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        if not self.in_backward:
            return dy, []
        return all_reduce_sum(dy, self.group), []


__all__ = ["AllGather", "AllReduce", "ReduceScatter"]


# ---- a tensor-parallel Linear's checks and expansion (ops/linear.py) ------------------------------


def check_parallel(
    parallel: Optional[str],
    tp_group: Optional[torch.distributed.ProcessGroup],
    sequence_parallel: bool,
    in_features: int,
    out_features: int,
) -> Tuple[Optional[str], Optional[torch.distributed.ProcessGroup], bool]:
    """(parallel, tp_group, sequence_parallel) of a Linear, checked: a known mode, a process group, and the
    split dim divisible by the group's size."""
    if parallel is None:
        if tp_group is not None or sequence_parallel:
            raise ValueError("Linear: tp_group and sequence_parallel need parallel='column' or parallel='row'")
        return None, None, False
    if parallel not in ("column", "row"):
        raise ValueError(f"Linear: parallel must be None, 'column' or 'row', got {parallel!r}")
    check_group(tp_group, f"Linear(parallel={parallel!r}) tp_group")
    world = tp_group.size()
    dim, name = (out_features, "out_features") if parallel == "column" else (in_features, "in_features")
    if dim % world:
        raise ValueError(
            f"Linear(parallel={parallel!r}): {name}={dim} does not split evenly over {world} ranks of tp_group"
        )
    return parallel, tp_group, bool(sequence_parallel)


def parallel_expansion(linear: BasicOp, bias: Optional[BasicOp]) -> tuple:
    """The basic ops around a Linear, (before, after): its Bias, and the tensor-parallel collectives."""
    tail = [bias] if bias is not None else []
    g = linear.tp_group
    if linear.parallel is None:
        return [], tail
    if linear.parallel == "column":
        head = AllGather(g) if linear.sequence_parallel else AllReduce(g, in_backward=True)
        return [head], tail
    reduce = ReduceScatter(g) if linear.sequence_parallel else AllReduce(g)
    return [], [reduce] + tail
