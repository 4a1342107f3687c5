"""Fused linear + cross-entropy: loss = F.cross_entropy(x @ weight.t() + bias, target), without the logits.

A large-vocabulary LM head (V = 128256, 16384 tokens) writes 4 GiB of bf16 logits, and the usual
`.float()` before the loss makes it 12 GiB more. Here the tokens are taken in chunks: for each chunk the
logits GEMM writes (chunk, V) in the activation dtype, one kernel (kernels/cross_entropy.py) runs an
online softmax over each row in float32 and writes the gradient of the logits over them in place, and
two GEMMs turn that gradient into the chunk's input gradient and into the weight gradient. Three GEMMs in
all, as in the unfused layer. The weight gradient is summed over the chunks either in a float32 (V, H)
buffer (the default without FP8; none for a float32 weight, whose gradient it is) or, with
dw_accumulation="weight_dtype" (the default with FP8), in the gradient itself by each GEMM's epilogue: then
the largest temporary is one logits chunk, sized like x (twice that with FP8).

- reduction "mean" or "sum": the gradients are computed in the forward (the loss is a scalar: its
  gradient only scales them) and scaled by the incoming gradient in backward.
- reduction "none": the forward keeps the per-row log-sum-exp; the backward recomputes the logits chunk by
  chunk with each row's incoming gradient (a fourth GEMM, as the rows' weights are not known before).
- FP8 GEMMs (recipe given, or an FP8-only weight): the weight is quantized once per call (with its
  transpose when the input gradient is needed), each chunk of x and of the logits' gradient per tensor
  (the recipe's forward and gradient formats), and the logits and input-gradient GEMMs run in FP8. The
  weight gradient's GEMM runs in x's dtype on the unquantized logits' gradient, adding into the gradient
  in its epilogue (dw_accumulation="weight_dtype", the default here), or in FP8 into a float32 sum.
The loss is float32 (what the naive `F.cross_entropy(logits.float(), t)` returns).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from float8 import DelayedScaling, Float8Tensor, Recipe
from float8.gemm import column_major_only, operand
from float8.gemm import fp8_mm_or_dequantized as _mm
from float8.kernels.common import refuse_redefinition
from float8.kernels.cross_entropy import ce_rows
from float8.kernels.grad_scale import scale_grad
from float8.ops.base import second_backward_error
from float8.ops.context import keeps_graph

# Before any definition: run a second time (another name, a reload), this module redefines nothing.
refuse_redefinition("float8::addmm_float32_", __name__)

__all__ = ["LinearCrossEntropy", "check_cross_entropy_args", "default_chunk_tokens", "linear_cross_entropy"]

_REDUCTIONS = ("mean", "sum", "none")


_ACCUMULATIONS = ("float32", "weight_dtype")
FP8_DW_SLAB = 8192  # vocabulary rows per FP8 weight-gradient product: a float32 temporary of 8192 x H


def default_chunk_tokens(
    tokens: int, hidden: int, vocab: int = 0, dw_accumulation: str = "float32", fp8: bool = False
) -> int:
    """Tokens per chunk, a multiple of 16 (for the FP8 GEMMs) and never more than the input has.

    float32 accumulation: as many as the hidden size (a logits chunk then holds as many elements as the
    weight, next to a float32 accumulator of twice its bytes; few chunks, so the accumulator is read and
    written few times). weight_dtype accumulation: a logits chunk about as large as x itself (tokens * H /
    V tokens, at least 256), the smallest that keeps the GEMMs efficient; each chunk reads and writes the
    whole weight gradient once, which is what this costs in time. With FP8 GEMMs (fp8) twice that: the
    FP8 logits and input-gradient GEMMs leave the weight gradient's read and write a larger share (H100,
    2026-11-27, V=128256, H=4096, 16384 tokens, one run: 76.0 ms at 512-token chunks, 67.6 at 1024, 65.4 at
    2048; V=32768: 17.1 ms at 2048, 16.2 at 4096 at 688 MiB, against the float32 sum's 16.9 ms at 1056 MiB;
    docs/performance.md)."""
    cap = tokens + (-tokens) % 16
    if dw_accumulation == "weight_dtype" and vocab:
        want = max(256, (2 if fp8 else 1) * tokens * hidden // vocab)
        return max(16, min(cap, want - want % 16))
    return max(16, min(hidden - hidden % 16, cap))


def check_cross_entropy_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    reduction: str,
    label_smoothing: float,
    name: str,
) -> None:
    """TypeError/ValueError naming both sides for inputs of the wrong kind, dtype or shape."""
    if not all(isinstance(t, torch.Tensor) for t in (x, weight, target)):
        raise TypeError(
            f"{name} takes tensors x, weight, target; got {type(x).__name__}, {type(weight).__name__}, {type(target).__name__}"
        )
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if x.dtype not in floats or isinstance(x, Float8Tensor):
        raise TypeError(f"{name}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if weight.dtype not in floats:
        raise TypeError(
            f"{name}: weight must be float32, bfloat16 or float16 (or an FP8-only Float8Tensor), got {weight.dtype}"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: target must hold class indices (int64), got {target.dtype}")
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{name}: x (..., H) and weight (V, H) must agree on H, got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{name}: target must have x's leading shape {tuple(x.shape[:-1])}, got {tuple(target.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(
            f"{name}: bias must be ({weight.shape[0]},) for weight {tuple(weight.shape)}, got {getattr(bias, 'shape', bias)}"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{name}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if x.device != weight.device or x.device != target.device:
        raise ValueError(
            f"{name}: x, weight and target must be on one device, got {x.device}, {weight.device}, {target.device}"
        )


def _check_labels(target: torch.Tensor, vocab: int, ignore_index: int, name: str) -> Optional[Callable[[], None]]:
    """Refuse a label outside [0, V) that is not ignore_index. On the CPU at once; on CUDA the answer comes back
    without a host sync before the GEMMs: returned is the check to call once they are queued, which waits only
    for the few kernels that found the answer (the kernels in between read no memory for such a label:
    kernels/cross_entropy.py). A sync here idled the GPU for the host's launches after it: 0.5-0.6 ms of gaps
    in a V=128256, 16384-token call on the H100 (2026-11-27). Traced: checked on the device, where a bad label
    stops the program."""
    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if torch.compiler.is_compiling():
        # No host sync inside a graph: checked on the device, where a bad label stops the program.
        torch._assert_async(
            ~bad.any(), f"{name}: a label is outside the vocabulary [0, {vocab}) and is not ignore_index"
        )
        return None

    def refuse() -> None:
        first = target[bad][0].item()
        raise ValueError(
            f"{name}: label {first} is outside the vocabulary [0, {vocab}) and is not ignore_index={ignore_index}"
        )

    if not target.is_cuda:
        if bool(bad.any()):
            refuse()
        return None
    found = torch.empty((), dtype=torch.bool, pin_memory=True)
    found.copy_(bad.any(), non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(target.device))

    def check() -> None:
        done.synchronize()
        if bool(found):
            refuse()

    return check


class _Plan:
    """What one call computes, decided once in the forward."""

    def __init__(self, x2, weight, bias, needs, ignore_index, smoothing, reduction, recipe, chunk, dw_accumulation):
        self.need_dx, self.need_dw, self.need_db = needs
        self.ignore_index, self.smoothing, self.reduction = ignore_index, smoothing, reduction
        self.chunk = chunk
        # The weight gradient's running sum: float32, or the gradient's own dtype (float32 weights: the same).
        self.dw_dtype = torch.float32 if dw_accumulation == "float32" else weight.dtype
        self.dtype = x2.dtype
        self.fp8 = recipe is not None or isinstance(weight, Float8Tensor)
        # The weight gradient's GEMM in FP8 only with a float32 running sum: _scaled_mm cannot add into its
        # output, so its product goes through a float32 temporary. Summed in the weight's dtype, that GEMM
        # runs in x's dtype on the logits' gradient before quantization and adds in its epilogue instead.
        self.fp8_dw = self.fp8 and dw_accumulation == "float32"
        self.quantizers = (recipe or Recipe()).quantizers() if self.fp8 else None
        self.w_dtype = weight.dtype
        self.b_dtype = None if bias is None else bias.dtype


def _weight_operand(weight, plan: _Plan):
    """The weight as all its GEMMs read it: in x's dtype, or FP8 (with its transpose for the input gradient)."""
    if not plan.fp8:
        return weight.detach().to(plan.dtype)
    if isinstance(weight, Float8Tensor):
        return weight
    return plan.quantizers.weight._quantize(weight.detach(), plan.need_dx)


def _logits(xc, w, bias, plan: _Plan, write_grad: bool):
    if not plan.fp8:
        return torch.nn.functional.linear(xc, w, bias), None
    xc8 = plan.quantizers.input._quantize(xc, write_grad and plan.need_dw and plan.fp8_dw)
    return _mm(xc8, operand(w, transposed=True), bias=bias, out_dtype=plan.dtype, pad=True, fast_accum=True), xc8


@torch.library.custom_op("float8::addmm_float32_", mutates_args=("acc",))
def _addmm_float32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float) -> None:
    """acc = beta * acc + a @ b for a float32 acc and bf16/fp16 a, b (beta 0: acc's contents are not read):
    on CUDA one GEMM sums in float32 and adds into acc (no temporary); elsewhere the operands are upcast
    first. The traced form of _accumulate_dw's addmm: torch 2.11's fake addmm raises on out_dtype with out=
    (GPU tier, 2026-11-27), an op it does not trace."""
    if acc.device.type == "cuda":
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)


@_addmm_float32_.register_fake
def _(acc, a, b, beta) -> None:
    return None


def _accumulate_dw(acc, dz, xc, xc8, plan: _Plan, first: bool):
    """acc (V, H) += dz.t() @ xc, or = where `first`: acc is then uninitialized memory, which the first GEMM
    writes without reading (no zero fill of the whole gradient, 0.3 ms for a bf16 (128256, 4096) one on the
    H100, and no read by that GEMM; the opaque float32 op takes beta 0, which its eager GEMM honours). acc
    is float32 or the weight's dtype (plan.dw_dtype). Each chunk's product is summed in float32 inside its
    GEMM; a weight-dtype acc rounds once per chunk. dz is FP8 where plan.fp8_dw (then xc8 is x's chunk in
    FP8 with its transpose; acc starts zeroed), else in x's dtype."""
    if plan.fp8_dw:
        # _scaled_mm cannot add into its output: the product goes through a float32 temporary, one slab of
        # vocabulary rows at a time (FP8_DW_SLAB x H x 4 bytes), not the whole (V, H) at once.
        dzt, xb = operand(dz, transposed=True), column_major_only(xc8)
        for v0 in range(0, acc.shape[0], FP8_DW_SLAB):
            rows = dzt._replace(data=dzt.data[v0 : v0 + FP8_DW_SLAB], transpose=None)
            acc[v0 : v0 + FP8_DW_SLAB] += _mm(rows, xb, out_dtype=torch.float32, pad=True)
    elif (
        acc.dtype == torch.float32
        and dz.dtype in (torch.bfloat16, torch.float16)
        and (acc.device.type == "cuda" or torch.compiler.is_compiling())
    ):
        _addmm_float32_(
            acc, dz.t(), xc, 0.0 if first else 1.0
        )  # bf16 operands, float32 sum: no temporary on CUDA (the one
        # mixed case CUDA's addmm takes: out_dtype float32 for half-precision operands, or the operands' dtype)
    elif first:
        # mm into acc, not addmm with beta 0: inductor's addmm template and its one-column decomposition
        # compute acc * beta, which turns NaN or inf in the uninitialized memory into NaN (0 * inf).
        torch.mm(dz.t().to(acc.dtype), xc.to(acc.dtype), out=acc)  # .to: no copy where the dtype is acc's
    else:
        acc.addmm_(dz.t().to(acc.dtype), xc.to(acc.dtype))  # the GEMM's epilogue adds into acc (beta = 1)


def _chunks(n: int, chunk: int):
    for c0 in range(0, n, chunk):
        yield c0, min(n, c0 + chunk)


def _pass(x2, weight, bias, target, scale, plan: _Plan, write_grad: bool):
    """One sweep over the token chunks: per-row loss and lse; with write_grad also dx, dw (float32), db
    (float32) of sum_i scale_i * loss_i."""
    n, h = x2.shape
    v = weight.shape[0]
    w = _weight_operand(weight, plan)
    b = None if bias is None else bias.detach().to(plan.dtype)
    loss = torch.empty(n, dtype=torch.float32, device=x2.device)
    lse = torch.empty(n, dtype=torch.float32, device=x2.device)
    dx = torch.empty_like(x2) if write_grad and plan.need_dx else None
    dw = None
    if write_grad and plan.need_dw:
        # Written whole by the first chunk's GEMM where there is one (_accumulate_dw's `first`).
        alloc = torch.zeros if plan.fp8_dw or n == 0 else torch.empty
        dw = alloc(v, h, dtype=plan.dw_dtype, device=x2.device)
    db = torch.zeros(v, dtype=torch.float32, device=x2.device) if write_grad and plan.need_db else None
    for c0, c1 in _chunks(n, plan.chunk):
        xc = x2[c0:c1]
        z, xc8 = _logits(xc, w, b, plan, write_grad)
        sc = scale if scale.dim() == 0 else scale[c0:c1]
        loss[c0:c1], lse[c0:c1] = ce_rows(z, target[c0:c1], sc, plan.ignore_index, plan.smoothing, write_grad)
        if not write_grad:
            continue
        if db is not None:
            db += z.sum(0, dtype=torch.float32)
        fp8_dz = plan.fp8 and (dx is not None or (plan.fp8_dw and dw is not None))  # else no FP8 GEMM reads it
        dz = plan.quantizers.grad._quantize(z, plan.need_dw and plan.fp8_dw) if fp8_dz else z
        # The weight gradient's GEMM reads the logits' gradient as it is unless that GEMM is FP8: then only
        # the FP8 copy stays alive through the input gradient's GEMM.
        dz_hp = z if dw is not None and not plan.fp8_dw else None
        del z
        if dx is not None:
            if plan.fp8:
                dx[c0:c1] = _mm(dz, w, out_dtype=plan.dtype, pad=True)
            else:
                torch.mm(dz, w, out=dx[c0:c1])  # into dx's rows: no chunk-sized temporary
        if dw is not None:
            _accumulate_dw(dw, dz if dz_hp is None else dz_hp, xc, xc8, plan, first=c0 == 0)
        # Freed before the next chunk's logits are written: two chunks alive at once were the largest
        # temporary (measured on the H100: 250 MiB above the gradients at 512-token chunks, not 125).
        del dz, dz_hp, xc8
    return loss, lse, dx, dw, db


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, target, plan: _Plan):
        n_valid = (target != plan.ignore_index).sum()
        ones = torch.ones((), dtype=torch.float32, device=x2.device)
        scale = 1.0 / n_valid.float() if plan.reduction == "mean" else ones
        eager = plan.reduction != "none" and (plan.need_dx or plan.need_dw or plan.need_db)
        loss_rows, lse, dx, dw, db = _pass(x2, weight, bias, target, scale, plan, write_grad=eager)
        ctx.plan = plan
        if eager:
            ctx.grads = (dx, dw, db)
        elif plan.reduction == "none":
            ctx.save_for_backward(x2, weight if not isinstance(weight, Float8Tensor) else None, bias, target)
            ctx.fp8_weight = weight if isinstance(weight, Float8Tensor) else None
        if plan.reduction == "none":
            return loss_rows
        total = loss_rows.sum()
        return total * scale if plan.reduction == "mean" else total

    @staticmethod
    def backward(ctx, g):
        plan = ctx.plan
        if plan.reduction == "none":
            x2, weight, bias, target = ctx.saved_tensors
            weight = weight if ctx.fp8_weight is None else ctx.fp8_weight
            _, _, dx, dw, db = _pass(x2, weight, bias, target, g.float().contiguous(), plan, write_grad=True)
        else:
            if ctx.grads is None:
                raise second_backward_error("linear_cross_entropy")
            (dx, dw, db), g32 = ctx.grads, g.float()
            # Scaled by g where the gradients lie (no pass at all for a plain loss.backward(), whose g is 1)
            # and cast to the parameters' dtypes in the same pass (kernels/grad_scale.py). A later backward
            # that reads the forward's gradients again (keeps_graph) gets them scaled into new tensors.
            copy = keeps_graph()
            if not copy:
                ctx.grads = None
            dx = None if dx is None else scale_grad(dx, g32, dx.dtype, copy)
            dw = None if dw is None else scale_grad(dw, g32, plan.w_dtype, copy)
            db = None if db is None else scale_grad(db, g32, plan.b_dtype, copy)
            return dx, dw, db, None, None
        dw = None if dw is None else dw.to(plan.w_dtype)
        db = None if db is None else db.to(plan.b_dtype)
        return dx, dw, db, None, None


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    *,
    recipe: Optional[Recipe] = None,
    chunk_tokens: Optional[int] = None,
    dw_accumulation: Optional[str] = None,
) -> torch.Tensor:
    """F.cross_entropy(F.linear(x, weight, bias).float(), target, ...) without materializing the logits.

    x: (..., H) float32/bfloat16/float16; weight: (V, H) high precision, or an FP8-only Float8Tensor
    (frozen); target: x's leading shape, int64 class indices in [0, V) or ignore_index; bias: (V,) or None.
    reduction "mean" (over non-ignored rows), "sum" or "none" (x's leading shape). Returns float32.
    recipe: run the three GEMMs in FP8 with this Recipe's per-tensor formats (None: in x's dtype, unless the
    weight is FP8). chunk_tokens: tokens per chunk (default `default_chunk_tokens`).
    dw_accumulation: where the weight gradient is summed over the chunks. "float32" (the default without
    FP8): in a float32 (V, H) buffer (2 GiB at V=128256, H=4096; none for a float32 weight), rounded to the
    weight's dtype once at the end; with FP8 GEMMs the weight gradient's GEMM is FP8 too (its product goes
    through a float32 slab, FP8_DW_SLAB rows at a time). "weight_dtype" (the default with FP8): in the
    gradient itself, added by each chunk's GEMM epilogue, so nothing beyond one logits chunk is held, at
    the cost of one rounding to the weight's dtype per chunk (what Liger-Kernel does) and of smaller chunks
    (see `default_chunk_tokens`); with FP8 GEMMs that GEMM runs in x's dtype on the logits' gradient before
    quantization (the logits and input-gradient GEMMs stay FP8). None (default): "weight_dtype" with FP8
    GEMMs, a weight that takes a gradient and bf16/fp16 x; "float32" otherwise. H100, V=128256, H=4096,
    16384 tokens, FP8: float32 60.4 ms at 3.95 GiB above the gradients, weight-gradient SQNR 31.5 dB
    (against the float32 sum of bf16 products); weight_dtype (1040-token chunks) 65.6 ms at 1.36 GiB, 51.8
    dB (2026-11-27, area memory_lce). At the benchmark model's head (V=32768): docs/performance.md.
    """
    name = "linear_cross_entropy"
    check_cross_entropy_args(x, weight, target, bias, reduction, label_smoothing, name)
    if recipe is not None:
        if not isinstance(recipe, Recipe):
            raise TypeError(f"{name}: recipe must be a float8.Recipe, got {type(recipe).__name__}")
        if any(isinstance(getattr(recipe, r), DelayedScaling) for r in ("input", "weight", "grad")):
            raise ValueError(f"{name}: a functional call keeps no amax history: use current (per-tensor) scaling")
    if isinstance(weight, Float8Tensor) and weight.requires_grad and not weight._gathered_master:
        raise ValueError(
            f"{name}: the weight is an FP8-only Float8Tensor that requires grad, with no master weight to update"
        )
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    t = target.reshape(-1).to(torch.int64)
    labels_checked = _check_labels(t, weight.shape[0], ignore_index, name)
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 16 or chunk_tokens % 16):
        raise ValueError(f"{name}: chunk_tokens must be a positive multiple of 16, got {chunk_tokens!r}")
    grad = torch.is_grad_enabled()
    needs = (grad and x.requires_grad, grad and weight.requires_grad, grad and bias is not None and bias.requires_grad)
    fp8 = recipe is not None or isinstance(weight, Float8Tensor)
    if dw_accumulation is None:
        # weight_dtype where its GEMM runs in half precision; else float32 (nothing to sum without a weight
        # gradient, and a float32 GEMM would be the slower one).
        half = x2.dtype in (torch.bfloat16, torch.float16)
        dw_accumulation = "weight_dtype" if fp8 and needs[1] and half else "float32"
    if dw_accumulation not in _ACCUMULATIONS:
        raise ValueError(f"{name}: dw_accumulation must be one of {_ACCUMULATIONS}, got {dw_accumulation!r}")
    chunk = chunk_tokens or default_chunk_tokens(x2.shape[0], x2.shape[1], weight.shape[0], dw_accumulation, fp8)
    plan = _Plan(
        x2, weight, bias, needs, int(ignore_index), float(label_smoothing), reduction, recipe, chunk, dw_accumulation
    )
    loss = _LinearCrossEntropyFunction.apply(x2, weight, bias, t, plan)
    if labels_checked is not None:
        try:
            labels_checked()
        except ValueError:
            del loss  # not kept alive by the traceback: its graph holds the forward's gradients
            raise
    return loss.reshape(target.shape) if reduction == "none" else loss


class LinearCrossEntropy(torch.nn.Module):
    """An LM head and its loss in one: loss = cross_entropy(x @ weight.t() + bias, target).

    Holds weight (vocab, in_features) (and bias), initialised as nn.Linear's. `forward(x, target)` returns
    the loss (see `linear_cross_entropy`). It can end an `ops.Sequential`, which then takes
    `seq(x, target=...)`. Options, keyword-only: bias, device, dtype, ignore_index, label_smoothing,
    reduction, recipe (None: GEMMs in the activation dtype; a Recipe: FP8 GEMMs), chunk_tokens,
    dw_accumulation ("float32" or "weight_dtype"; None: the default of `linear_cross_entropy`).
    """

    is_loss = True  # a Sequential ending with it takes the labels (ops/sequential.py)

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        *,
        bias: bool = False,
        device=None,
        dtype=None,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        recipe: Optional[Recipe] = None,
        chunk_tokens: Optional[int] = None,
        dw_accumulation: Optional[str] = None,
    ):
        super().__init__()
        lin = torch.nn.Linear(in_features, vocab_size, bias=bias, device=device, dtype=dtype)
        self.weight, self.bias = lin.weight, lin.bias
        self.in_features, self.vocab_size = in_features, vocab_size
        self.ignore_index, self.label_smoothing, self.reduction = ignore_index, label_smoothing, reduction
        self.recipe, self.chunk_tokens, self.dw_accumulation = recipe, chunk_tokens, dw_accumulation

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, vocab_size={self.vocab_size}, bias={self.bias is not None}, reduction={self.reduction!r}"

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(
            x,
            self.weight,
            target,
            self.bias,
            self.ignore_index,
            self.label_smoothing,
            self.reduction,
            recipe=self.recipe,
            chunk_tokens=self.chunk_tokens,
            dw_accumulation=self.dw_accumulation,
        )
