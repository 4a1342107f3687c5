"""LayerNorm and RMSNorm. Followed by a Linear, the norm kernel writes FP8 (and the transpose the Linear's
backward needs) directly, when the Linear's input quantizer `fuses` (per-tensor scaling): the normalized
activations never exist in high precision."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from float8.kernels.norm import norm_bwd, norm_fp8, norm_fwd
from float8.ops.base import BasicOp, OpContext, QuantRequest, RunState, plain, sequence_parallel, take


def _check_size(normalized_shape, name: str) -> int:
    if isinstance(normalized_shape, bool) or not isinstance(normalized_shape, int) or normalized_shape <= 0:
        raise ValueError(
            f"{name} normalizes over the last dim: normalized_shape must be a positive int, got {normalized_shape!r}"
        )
    return normalized_shape


def norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    eps: float,
    rms: bool,
    out_request: Optional[QuantRequest],
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """(y, mean or None, rstd): y high precision, or FP8 as `out_request` asks (in the norm kernel itself
    when its quantizer fuses; else the quantizer casts the high-precision output)."""
    if out_request is not None and out_request.fuses:
        r = out_request
        data, data_t, scale_inv, amax, mean, rstd = norm_fp8(
            x, weight, bias, eps, rms, r.fp8_dtype, r.kernel_scale(), r.margin, r.power_of_2, r.with_transpose
        )
        y = r.finish(data, data_t, scale_inv, amax, x.dtype)
    else:
        y, mean, rstd = norm_fwd(x, weight, bias, eps, rms)
        if out_request is not None:
            y = out_request._quantize(y)
    return y, (None if rms else mean), rstd


class _Norm(BasicOp):
    """What RMSNorm and LayerNorm share: normalize over the last dim, then scale (and shift)."""

    fusion_role, saves = "norm", ("saved",)

    rms: bool = True

    def __init__(
        self, normalized_shape: int, *, eps: float, device=None, dtype=None, recipe=None, sequence_parallel_group=None
    ):
        super().__init__()
        sequence_parallel(self, sequence_parallel_group)
        self.normalized_shape = _check_size(normalized_shape, type(self).__name__)
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(normalized_shape, device=device, dtype=dtype))
        if not self.rms:
            self.bias = torch.nn.Parameter(torch.zeros(normalized_shape, device=device, dtype=dtype))
        self.set_recipe(recipe)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest] = None) -> torch.Tensor:
        x = plain(x)
        if x.shape[-1] != self.normalized_shape:
            raise ValueError(
                f"{type(self).__name__}({self.normalized_shape}) got input of shape {tuple(x.shape)}: the last "
                f"dim must be {self.normalized_shape}"
            )
        b = None if self.rms else self.bias.to(x.dtype)
        y, mean, rstd = norm_forward(x, self.weight.to(x.dtype), b, self.eps, self.rms, out_request)
        ctx.saved = (x, mean, rstd)
        return y

    @property
    def has_torch_forward(self) -> bool:
        return self.grad_sum_group is None  # a sequence-parallel weight's gradient is summed by the runner

    def torch_forward(self, x: torch.Tensor, run: Optional[RunState] = None) -> torch.Tensor:
        w = self.weight.to(x.dtype)
        if self.rms:
            return F.rms_norm(x, (self.normalized_shape,), w, self.eps)
        return F.layer_norm(x, (self.normalized_shape,), w, self.bias.to(x.dtype), self.eps)

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        return self.norm_backward(ctx, dy)

    def norm_backward(
        self, ctx: OpContext, dy: torch.Tensor, dres: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """(dx, [dweight (, dbias)]); dres, a gradient of x's shape and dtype, is added to dx by the
        backward kernel itself (a Residual right before the norm: ops/fusion.py)."""
        x, mean, rstd = take(ctx, "saved")
        dx, dw, db = norm_bwd(plain(dy), x, self.weight.to(x.dtype), mean, rstd, dres)
        grads = [dw.to(self.weight.dtype)] if self.rms else [dw.to(self.weight.dtype), db.to(self.bias.dtype)]
        return dx, grads

    def saved_input_like(self, ctx: OpContext, t: torch.Tensor) -> bool:
        """Whether t has the shape and dtype of the input this run saved (what norm_backward's dres needs)."""
        x = ctx.saved[0]
        return t.shape == x.shape and t.dtype == x.dtype


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x**2, last dim) + eps) * weight.

    x: (..., normalized_shape), float32/bfloat16/float16; y: x's shape and dtype (or FP8 for a Linear after
    it in a Sequential). `weight`: (normalized_shape,), ones at start. Statistics in float32.
    sequence_parallel_group: a process group whose ranks each hold a block of the tokens (sequence
    parallelism): the weight gradient is summed over it.
    """

    rms = True

    def __init__(
        self,
        normalized_shape: int,
        *,
        eps: float = 1e-6,
        device=None,
        dtype=None,
        recipe=None,
        sequence_parallel_group=None,
    ):
        super().__init__(
            normalized_shape,
            eps=eps,
            device=device,
            dtype=dtype,
            recipe=recipe,
            sequence_parallel_group=sequence_parallel_group,
        )


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, over the last dim (biased variance, like torch).

    x: (..., normalized_shape), float32/bfloat16/float16; y: x's shape and dtype (or FP8 for a Linear after
    it in a Sequential). `weight` (ones) and `bias` (zeros): (normalized_shape,). Statistics in float32.
    sequence_parallel_group: as RMSNorm's.
    """

    rms = False

    def __init__(
        self,
        normalized_shape: int,
        *,
        eps: float = 1e-5,
        device=None,
        dtype=None,
        recipe=None,
        sequence_parallel_group=None,
    ):
        super().__init__(
            normalized_shape,
            eps=eps,
            device=device,
            dtype=dtype,
            recipe=recipe,
            sequence_parallel_group=sequence_parallel_group,
        )
