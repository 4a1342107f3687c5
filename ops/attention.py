"""Attention over a packed QKV activation, in high precision through F.scaled_dot_product_attention
(FlashAttention on Hopper for bf16/fp16): causal or no mask, grouped KV heads.

Input (tokens, (heads + 2 * kv_heads) * head_dim), laid out [q | k | v]; output (tokens, heads * head_dim).
The token dims (batch, sequence) come from the Sequential's input shape (..., batch, seq, features).
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from float8.kernels.pack_heads import pack_heads, pack_heads_fp8
from float8.ops.base import BasicOp, OpContext, QuantRequest, RunState, plain, take
from float8.ops.context import keeps_graph


class Attention(BasicOp):
    """Scaled dot-product attention over a packed [q | k | v] activation (high precision, SDPA).

    Input (..., batch, seq, (num_heads + 2 * num_kv_heads) * head_dim), output (..., batch, seq,
    num_heads * head_dim), in the input's dtype. Options, keyword-only: num_kv_heads (grouped KV heads,
    default num_heads), causal (default True), sequence_first (token dims (..., seq, batch), the layout of
    sequence-parallel activations; default False).
    """

    splits_compiled_run, saves = True, ("saved",)

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        *,
        num_kv_heads: int = None,
        causal: bool = True,
        sequence_first: bool = False,
    ):
        super().__init__()
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim), ("num_kv_heads", num_kv_heads)):
            if value is None and name == "num_kv_heads":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Attention: {name} must be a positive int, got {value!r}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.head_dim, self.num_kv_heads, self.causal = num_heads, head_dim, num_kv_heads, causal
        self.sequence_first = sequence_first

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, causal={self.causal}"

    def _split(self, qkv, lead):
        """q, k, v: head-major (B, heads, S, D) views of the packed qkv (tokens, features)."""
        if len(lead) < 2:
            raise ValueError(f"Attention needs input (..., batch, seq, features), got token dims {tuple(lead)}")
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        expected = (h + 2 * hk) * d
        if qkv.shape[-1] != expected:
            raise ValueError(
                f"Attention(heads={h}, kv_heads={hk}, head_dim={d}) needs {expected} features, got {qkv.shape[-1]}"
            )
        if self.sequence_first:  # (S, B): the rows are position-major
            if len(lead) != 2:
                raise ValueError(
                    f"Attention(sequence_first=True) needs input (seq, batch, features), got token dims {tuple(lead)}"
                )
            s, b = lead[-2], lead[-1]
            x = qkv.reshape(s, b, h + 2 * hk, d).permute(1, 2, 0, 3)  # (B, heads, S, D)
        else:
            b, s = math.prod(lead[:-1]), lead[-1]
            x = qkv.reshape(b, s, h + 2 * hk, d).transpose(1, 2)  # (B, heads, S, D)
        return x.split([h, hk, hk], dim=1)

    def _attend(self, q, k, v):
        """SDPA of head-major q, k, v, back to (tokens, heads * head_dim) in the input's token order."""
        # Grouped KV heads go to SDPA as they are (enable_gqa): no repeated K/V copies, which at 32 heads
        # over 8 KV heads would be 4x the K/V bytes, kept for the backward.
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=k.shape[1] != q.shape[1])
        b, h, s, d = o.shape
        if self.sequence_first:
            return o.permute(2, 0, 1, 3).reshape(s * b, h * d)
        return o.transpose(1, 2).reshape(b * s, h * d)

    def _sdpa(self, qkv, lead):
        return self._attend(*self._split(qkv, lead))

    has_torch_forward = True

    def torch_forward(self, x: torch.Tensor, run: RunState) -> torch.Tensor:
        """SDPA under ordinary autograd on x (tokens, features), the token dims in `run.lead`."""
        return self._sdpa(plain(x), tuple(run.lead))

    def torch_forward_nd(self, x: torch.Tensor) -> torch.Tensor:
        """SDPA under ordinary autograd on x (..., batch, seq, features): how a Sequential runs this op
        inside torch.compile (ops/runner.py), whose tracer cannot follow op_backward's autograd.grad."""
        lead = tuple(x.shape[:-1])
        y = self._sdpa(plain(x).reshape(-1, x.shape[-1]), lead)
        return y.reshape(*lead, y.shape[-1])

    def op_forward(self, ctx: OpContext, x: torch.Tensor, out_request: Optional[QuantRequest] = None) -> torch.Tensor:
        if not ctx.run.grad:
            return self._sdpa(plain(x), tuple(ctx.run.lead))
        # Grad mode is off inside the Sequential's autograd Function: record SDPA's own small graph on
        # detached q, k, v leaves (views of x, no copy), and differentiate it in op_backward. Leaves per
        # part, not one for x: their gradients are SDPA's own outputs, which pack_heads reads in place.
        q, k, v = (t.detach().requires_grad_(True) for t in self._split(plain(x), tuple(ctx.run.lead)))
        with torch.enable_grad():
            out = self._attend(q, k, v)
        ctx.saved = (q, k, v, out)
        return out.detach()

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        q, k, v, out = take(ctx, "saved")
        dy = plain(dy)
        # SDPA's recorded graph stays too when the backward keeps the graph (retain_graph=True).
        grads = list(torch.autograd.grad(out, (q, k, v), dy, retain_graph=keeps_graph()))
        r = dx_request
        if r is not None and r.fuses:
            # Straight into the QKV Linear's FP8 gradient: no packed high-precision copy (kernels/pack_heads.py).
            data, data_t, scale_inv, amax = pack_heads_fp8(
                grads, self.sequence_first, r.fp8_dtype, r.kernel_scale(), r.margin, r.power_of_2, r.with_transpose
            )
            return r.finish(data, data_t, scale_inv, amax, dy.dtype), []
        dx = pack_heads(grads, self.sequence_first)
        return (r._quantize(dx) if r is not None else dx), []
