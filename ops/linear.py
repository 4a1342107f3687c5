"""Linear: y = x @ W.t() with fprop, dgrad and wgrad as FP8 GEMMs.

- The input is saved for backward as FP8, never as a high-precision copy, and only in the layout the
  weight-gradient GEMM reads (the transpose written by the quantize kernel): 1 byte per element.
- The weight is quantized once per optimizer step: the FP8 copy is cached and re-made only when the
  weight changes (its version counter moves, as every in-place optimizer update does), not once per
  micro-batch. Under CUDA-graph capture it is quantized inside the graph on every call instead (a
  replay cannot check a version counter), so graphed training steps see each step's weight. Writes through `weight.data` do not move the counter: call `refresh_fp8_weight()` after
  them (load_state_dict and .to() refresh by themselves). Under no_grad/inference_mode no transpose is
  made. An FP8-only weight (a Float8Tensor parameter) is used as it is: 1 byte per parameter, no
  high-precision copy at all.
- Per-tensor recipes (current or delayed) use the same FP8 bits transposed in the backward pass. Per-row
  recipes quantize the transposed operands along their own rows (the scale must be constant along the
  GEMM's K). Block recipes compute the GEMM in high precision from the dequantized block-scaled operands:
  their numerics, not (yet) their speed. Where a recipe mixes layouts that cannot meet in one FP8 GEMM
  (per-row gradients against a per-tensor input, for the weight gradient), that GEMM does the same.
- With bias=True, inside a Sequential this op is Linear + Bias, and the fusion list folds the bias into the
  GEMM epilogue (forward) and into the gradient's cast-transpose kernel (backward).
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn.functional as F

from float8 import Float8Tensor, RowwiseScaling
from float8.gemm import column_major_only, fp8_mm_or_dequantized as _mm, operand
from float8.recipe import BlockwiseScaling
from float8.ops.base import BasicOp, OpContext, QuantRequest, per_tensor, plain, scaling_state


def _check_input(x: torch.Tensor, in_features: int) -> None:
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"Linear expects input (..., {in_features}), got shape {tuple(x.shape)}")


class Linear(BasicOp):
    """y = x @ weight.t() (+ bias); `.weight` (out_features, in_features) and `.bias` like nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, recipe=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = torch.nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.reset_parameters()
        self.set_recipe(recipe)
        self.__dict__["_w8_cache"] = None  # (key, fp8 weight(s)); not a buffer: derived, never saved
        self.__dict__["_expansion"] = None

    def reset_parameters(self) -> None:
        if isinstance(self.weight, Float8Tensor):
            return
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def expand(self):
        if self.bias is None:
            return [self]
        if self.__dict__["_expansion"] is None or self.__dict__["_expansion"][1].bias is not self.bias:
            from float8.ops.bias import Bias

            self.__dict__["_expansion"] = [self, Bias.sharing(self.bias, self)]
        return self.__dict__["_expansion"]

    def op_params(self) -> List[torch.nn.Parameter]:
        return [self.weight]  # the bias belongs to the Bias op of the expansion

    # ---- what this op asks of its neighbours -----------------------------------------------------
    def _scaling(self, role: str):
        return scaling_state(getattr(self.recipe, role), None, self, f"{role}_scaler", self.weight.device)

    def input_request(self, grad: bool, tokens: int) -> Optional[QuantRequest]:
        scaling = self._scaling("input")
        if not per_tensor(scaling) or not self.runs_in_fp8(tokens, self.weight.device):
            return None
        wgrad = grad and self.weight.requires_grad
        return QuantRequest(self.recipe.format.forward_dtype, scaling, wgrad)

    def grad_request(self, ctx: Optional[OpContext] = None) -> Optional[QuantRequest]:
        scaling = self._scaling("grad")
        if not per_tensor(scaling):
            return None
        saved = getattr(ctx, "saved", None)
        if saved is not None and saved[2] != "tensor":
            return None  # this run's forward was not per-tensor FP8 (e.g. the small-layer policy)
        return QuantRequest(self.recipe.format.backward_dtype, scaling, self.weight.requires_grad)

    # ---- the small-layer policy ------------------------------------------------------------------
    def runs_in_fp8(self, tokens: int, device: torch.device) -> bool:
        """FP8 unless, on CUDA, the GEMMs are too small for FP8 to win (Recipe.min_fp8_gemm_flops).

        An FP8-only weight always runs in FP8; the CPU path always does (it exists to be exact)."""
        if isinstance(self.weight, Float8Tensor) or device.type != "cuda":
            return True
        return 2 * tokens * self.in_features * self.out_features >= self.recipe.min_fp8_gemm_flops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Alone and below the policy's size: exactly nn.Linear (native autograd, the same kernels), with as
        # little Python before it as nn.Linear has: at M = 1024 a bf16 Linear's fwd+bwd is about as long on
        # the GPU (0.15 ms) as on the H100 machine's host, so each microsecond here shows in the ratio.
        w = self.weight
        if type(x) is torch.Tensor and x.dim() >= 1 and x.shape[-1] == self.in_features:
            if not self.runs_in_fp8(x.numel() // self.in_features, x.device):
                b = self.bias
                if w.dtype != x.dtype:
                    w = w.to(x.dtype)
                if b is not None and b.dtype != x.dtype:
                    b = b.to(x.dtype)
                return F.linear(x, w, b)
        return super().forward(x)

    def refresh_fp8_weight(self) -> None:
        """Forget the cached FP8 weight. Needed only after writing the weight through `.data` (such writes
        do not move the version counter that the cache is keyed by); loads and moves do it themselves."""
        self.__dict__["_w8_cache"] = None

    def _load_from_state_dict(self, *args, **kwargs):
        self.refresh_fp8_weight()
        return super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        self.refresh_fp8_weight()
        return super()._apply(fn, *args, **kwargs)

    # ---- the weight, quantized once per optimizer step ---------------------------------------------
    def quantized_weight(self, for_backward: bool):
        """(forward operand, dgrad operand or None): FP8 copies of the weight, cached by its version."""
        w = self.weight
        if isinstance(w, Float8Tensor):
            return w, (w if for_backward else None)
        scaling = self._scaling("weight")
        fp8 = self.recipe.format.forward_dtype
        if w.device.type == "cuda" and not torch.compiler.is_compiling() and torch.cuda.is_current_stream_capturing():
            # Inside a CUDA graph (torch.cuda.graph, make_graphed_callables) the quantization is
            # recorded and re-run by every replay, so it reads the weight of that step. A cached copy
            # would be frozen into the graph and go stale at the first optimizer step: never use the
            # cache here, and never fill it with a tensor of the graph's memory pool. (Not asked while
            # torch.compile traces: dynamo would break its graph on the query.)
            return self._quantize_weight_now(w, fp8, scaling, for_backward)
        key = (w._version, w.data_ptr(), w.device, w.dtype, self.recipe)
        cached = self.__dict__["_w8_cache"]
        if cached is not None and cached[0] == key and (cached[2] is not None or not for_backward):
            return cached[1], cached[2] if for_backward else None
        # Drop the stale copy first, so that old and new FP8 weights are not alive together (at
        # 14336x4096 with its transpose that is 112 MiB of peak memory saved per Linear).
        self.__dict__["_w8_cache"] = None
        w8, wd = self._quantize_weight_now(w, fp8, scaling, for_backward)
        self.__dict__["_w8_cache"] = (key, w8, wd)
        return w8, wd

    @staticmethod
    def _quantize_weight_now(w, fp8, scaling, for_backward: bool):
        with torch.no_grad():
            if per_tensor(scaling):
                # The transpose is written by the same kernel, and only where a backward will read it.
                w8 = _quantize_weight(w, fp8, scaling, with_transpose=for_backward)
                wd = w8 if for_backward else None
            else:
                w8 = Float8Tensor.quantize(w, fp8, scaling=scaling)
                wd = Float8Tensor.quantize(w.t(), fp8, scaling=scaling).t() if for_backward else None
        return w8, wd

    # ---- forward / backward --------------------------------------------------------------------
    def op_forward(self, ctx: OpContext, x, out_request=None, bias=None):
        _check_input(x, self.in_features)
        need_wgrad = ctx.run.grad and self.weight.requires_grad
        need_dgrad = ctx.run.grad and ctx.input_requires_grad
        lead, out_dtype = x.shape[:-1], x.dtype
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        ctx.x_dtype, ctx.lead, ctx.need_wgrad, ctx.need_dgrad = out_dtype, lead, need_wgrad, need_dgrad
        if not isinstance(x2, Float8Tensor) and not self.runs_in_fp8(x2.shape[0], x2.device):
            # The small-layer policy: this GEMM is too small for FP8 to win. High precision, saved as is.
            w = self.weight.to(out_dtype)
            ctx.saved = (x2 if need_wgrad else None, w if need_dgrad else None, "hp")
            return F.linear(x2, w, bias).reshape(*lead, self.out_features)
        w8, wd = self.quantized_weight(for_backward=need_dgrad)
        scaling = self._scaling("input")
        fp8 = self.recipe.format.forward_dtype
        fast = self.recipe.fprop_fast_accum
        if isinstance(scaling, BlockwiseScaling):
            x8 = x2 if isinstance(x2, Float8Tensor) else Float8Tensor.quantize(x2, fp8, scaling=scaling)
            y = F.linear(x8.dequantize(), w8.dequantize(out_dtype), bias)
            ctx.saved = (x8, w8 if need_dgrad else None, "block")
        elif per_tensor(scaling):
            x8 = x2 if isinstance(x2, Float8Tensor) else Float8Tensor._quantize(x2, fp8, scaling=scaling, with_transpose=need_wgrad)
            y = _mm(x8, operand(w8, transposed=True), bias=bias, out_dtype=out_dtype, pad=True, fast_accum=fast)
            # Saved for the weight gradient: the column-major layout only (half the bytes of both).
            ctx.saved = (column_major_only(x8) if need_wgrad else None, wd, "tensor")
        else:
            xh = plain(x2)
            x8 = Float8Tensor.quantize(xh, fp8, scaling=scaling)
            y = _mm(x8, operand(w8, transposed=True), bias=bias, out_dtype=out_dtype, pad=True, fast_accum=fast)
            xt8 = Float8Tensor.quantize(xh.t(), fp8, scaling=scaling).t() if need_wgrad else None
            ctx.saved = (xt8, wd, "row")
        return y.reshape(*lead, self.out_features)

    def op_backward(self, ctx: OpContext, dy, dx_request=None):
        x8, wd, kind = ctx.saved
        ctx.saved = None
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, self.out_features)
        fp8 = self.recipe.format.backward_dtype
        scaling = self._scaling("grad")
        dx = dw = None
        if kind == "hp":
            dyh = plain(dy2)
            if ctx.need_dgrad:
                dx = dyh @ wd
            if ctx.need_wgrad:
                dw = (dyh.t() @ x8).to(self.weight.dtype)
        elif kind == "block":
            dyh = Float8Tensor.quantize(plain(dy2), fp8, scaling=scaling).dequantize()
            if ctx.need_dgrad:
                dx = dyh @ wd.dequantize(dyh.dtype)
            if ctx.need_wgrad:
                dw = (dyh.t().float() @ x8.dequantize(torch.float32)).to(self.weight.dtype)
        elif kind == "tensor":
            dy8 = dy2 if isinstance(dy2, Float8Tensor) else Float8Tensor._quantize(dy2, fp8, scaling=scaling, with_transpose=ctx.need_wgrad)
            if ctx.need_dgrad:
                dx = _mm(dy8, wd, out_dtype=ctx.x_dtype, pad=True)
            if ctx.need_wgrad:
                dw = _mm(operand(dy8, transposed=True), x8, out_dtype=self.weight.dtype, pad=True)
        else:
            dyh = plain(dy2)
            if ctx.need_dgrad:
                dx = _mm(Float8Tensor.quantize(dyh, fp8, scaling=scaling), wd, out_dtype=ctx.x_dtype, pad=True)
            if ctx.need_wgrad:
                dyt8 = Float8Tensor.quantize(dyh.t(), fp8, scaling=scaling)
                dw = _mm(dyt8, x8, out_dtype=self.weight.dtype, pad=True)
        if dx is not None:
            dx = dx.reshape(*ctx.lead, self.in_features)
        return dx, [dw if not isinstance(self.weight, Float8Tensor) else None]


def _quantize_weight(w, fp8, scaling, with_transpose):
    return Float8Tensor._quantize(w.detach(), fp8, scaling=scaling, with_transpose=with_transpose)
