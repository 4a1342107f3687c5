"""The eager training step of a lone ops.Linear under per-tensor current scaling, without the op runner.

A converted model's Linears each run alone (ops.convert makes one op per nn.Linear), and in eager training
every one of them went through the general machinery of ops/runner.py: the run plan, the fusion match,
the per-op contexts, Float8Tensor and Operand objects, the GEMM's operand checks. On the H100 machine's
host that cost a 16x64x64 Linear forced onto FP8 1867 us per forward+backward against 258 us for nn.Linear
(benchmarks/results/profile_lone_linear.txt, 2026-11-27; 618-784 us on this path in later runs there).

`train_forward` takes the common case (a high-precision weight being trained, or frozen with the input's
gradient wanted, as in fine-tuning adapters; per-tensor current scaling for input, weight and gradient, no
amax group, no tensor parallelism, eager, shapes that need no padding)
and runs the same kernels with the same arguments as the general path (ops/linear_engine.py `linear_fwd`
and `linear_bwd` for that case), so the bits are the same (tests/ops/test_linear_train.py compares them
with the runner's on every output and gradient). Everything else returns None and takes the general path.

What it keeps from the forward to the backward is what the general path keeps: the input's FP8 transpose
(the layout the weight-gradient GEMM reads) and its scale, one copy for the Linears of a converted model that
read the same tensor (`SharedInputCopy`); the weight itself, which the backward quantizes
again (the same bits: current scaling of an unchanged tensor); nothing in high precision. One exception: a
weight one program quantizes (at most 16384 elements) has its FP8 transpose written by the forward's launch
and kept (at most 16 KiB), one quantization fewer where host time is all the step waits for. A write
through `weight.data` between the forward and the backward (which moves no version counter, so neither
path refuses it) then leaves the input gradient with the forward's weight, where the general path reads
the new one.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Optional

import torch

from float8 import Float8Tensor
from float8.gemm import Operand
from float8.kernels import quantize_tensorwise
from float8.kernels.activation import dact_fp8
from float8.kernels.common import SMALL_DIM, SMALL_NUMEL, forward_ad_or_functorch_active
from float8.kernels.prepared_quantize import prepare_quantize, small_layout
from float8.kernels.quantize import quantize_tensorwise_from_amax
from float8.kernels.transpose import transpose_fp8
from float8.ops.context import take
from float8.ops.known_amax import KnownAmaxes, tensor_state
from float8.ops.linear_engine import LinearSaved, fp8_pays_off, linear_bwd, stateless_per_tensor
from float8.ops.weight_cache import Plans
from float8.quantizer import LinearQuantizers, ScaleLayout, TensorwiseQuantizer

_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


class TrainPlan:
    """One input layout's quantizations in a Linear's training step, prepared on first use
    (kernels/prepared_quantize.py): the input (with its transpose), the weight (without), the output gradient
    (with) and the weight again for the input gradient (its transpose). Each is None until first used,
    False where it cannot be prepared (then quantized the checked way on every call), else the prepared
    call. Made for one set of quantizers (`quantizers`, by identity)."""

    __slots__ = ("quantizers", "small_weight", "x", "w", "dy", "w_t", "x_rows", "dy_rows")

    def __init__(self, quantizers: tuple, weight_shape: torch.Size):
        self.quantizers = quantizers
        n, k = weight_shape
        # A weight that one program quantizes (kernels/common.py SMALL_NUMEL): the forward writes its transpose
        # too, in the same launch, and keeps it (at most 16 KiB) for the input gradient, one quantization fewer
        # per step where host time is all a step waits for.
        self.small_weight = n <= SMALL_DIM and k <= SMALL_DIM and n * k <= SMALL_NUMEL
        self.x = self.w = self.dy = self.w_t = None
        self.x_rows = self.dy_rows = None  # a frozen weight's step: no transposes of x and dy

    def quantize(
        self,
        role: str,
        t: torch.Tensor,
        q: TensorwiseQuantizer,
        with_transpose: bool,
        amax: Optional[torch.Tensor] = None,
    ) -> tuple:
        """(data, data_t or None, scale_inv, amax): t quantized by q at current scaling, through the prepared
        call of `role` where there is one that fits t. amax: max|t|, where t's producer computed it
        (ops/known_amax.py): the cast alone, with the same bits."""
        if amax is not None:
            return quantize_tensorwise_from_amax(t, amax, q.fp8_dtype, q.margin, q.power_of_2, with_transpose)
        prepared = getattr(self, role)
        if prepared:
            out = prepared(t)
            if out is not None:
                return out
        elif prepared is None:
            out, prepared = prepare_quantize(t, q.fp8_dtype, q.margin, q.power_of_2, with_transpose)
            if prepared is not None:
                setattr(self, role, prepared)
            elif not small_layout(t, with_transpose):
                setattr(self, role, False)  # never preparable; a first call that did not fit (alignment) retries
            return out
        data, data_t, scale_inv, amax = quantize_tensorwise(
            t, q.fp8_dtype, None, q.margin, q.power_of_2, with_transpose
        )
        return data, data_t, scale_inv, amax


class _InputCopySlot:
    """One thread's entry of a SharedInputCopy: the input read last (weakly), its key and its FP8 copy."""

    __slots__ = ("ref", "key", "copy", "__weakref__")

    def __init__(self):
        self.ref = self.key = self.copy = None

    def drop(self, key: Optional[tuple]) -> None:
        """Let the entry go if it is still the one made under `key` (compared by identity)."""
        if self.key is key:
            self.ref = self.key = self.copy = None


def _expire(slot_ref: weakref.ref, key: tuple, dead: weakref.ref) -> None:
    # Called when the input dies; the slot is reached weakly, so the slot and its input's reference make no
    # cycle (a deleted model frees its memory without the garbage collector).
    slot = slot_ref()
    if slot is not None:
        slot.drop(key)


class SharedInputCopy(threading.local):
    """The FP8 copy of the input that the last Linear of a converted model quantized, for the Linears that read
    the same tensor next: q, k and v of a Hugging Face attention, gate and up of its MLP each read the norm's
    output. Each used to quantize it anew (an amax pass and a cast-transpose pass over the bf16 input) and keep
    its own transpose until the backward: at 16384 tokens and d=4096, 64 MiB per extra Linear per block
    (docs/memory.md). Under stateless per-tensor current scaling the same tensor gives the same bits, so
    sharing changes no output.

    One per converted model (ops/convert.py), shared by its Linears; per thread. It holds one entry: the input
    weakly, its key (version counter, data pointer, layout, CUDA stream, quantizer settings) and (data, data_t
    or None, scale_inv); a tensor made under inference_mode (no version counter) is not shared. The entry goes
    when the next Linear quantizes another input, when the input dies (in a transformer block, when the
    attention or MLP that read it returns) or when the first of its readers' backwards runs; until then the
    rows copy (1 byte per element of a 2-byte input) lives beside it. A write through `.data` of the same
    storage moves no version counter and is not seen, as everywhere in torch. Derived and never saved: a
    pickled or copied model gets a new, empty one (one per shared object). Tested against unshared Linears:
    tests/ops/test_shared_input_copy.py."""

    def __init__(self):
        self.slot = _InputCopySlot()

    def __reduce__(self):
        return (type(self), ())

    def __deepcopy__(self, memo):
        return type(self)()

    @staticmethod
    def _key(x: torch.Tensor, q: TensorwiseQuantizer) -> Optional[tuple]:
        # None for a tensor made under inference_mode (no version counter: a write would not be seen). The
        # stream: a copy written on one stream is read only on that one (another would need a wait).
        if x.is_inference():
            return None
        return (*tensor_state(x), q.fp8_dtype, q.margin, q.power_of_2)

    def lookup(self, x: torch.Tensor, q: TensorwiseQuantizer, with_transpose: bool) -> Optional[tuple]:
        """(data, data_t or None, scale_inv) of x quantized by q's settings, if the entry holds it (with the
        transpose where asked), else None."""
        slot = self.slot
        ref = slot.ref
        if ref is None or ref() is not x or slot.key is None or slot.key != self._key(x, q):
            return None
        if with_transpose and slot.copy[1] is None:
            return None
        return slot.copy

    def store(self, x: torch.Tensor, q: TensorwiseQuantizer, copy: tuple) -> None:
        """Keep (data, data_t or None, scale_inv) of x for the next Linear, in place of the entry before."""
        slot, key = self.slot, self._key(x, q)
        if key is None:  # not shared (SharedInputCopy._key); the entry before goes all the same
            slot.ref = slot.key = slot.copy = None
            return
        slot.ref = weakref.ref(x, lambda dead, s=weakref.ref(slot), k=key: _expire(s, k, dead))
        slot.key, slot.copy = key, copy

    def entry(self) -> tuple:
        """(this thread's slot, the key of its entry): what a backward lets go (`_InputCopySlot.drop`), from
        whichever thread it runs on."""
        slot = self.slot
        return slot, slot.key


class TrainPlans(Plans):
    """A Linear's TrainPlans by (input shape, input dtype, weight dtype, device) (derived and bounded: Plans),
    and the SharedInputCopy and KnownAmaxes of its model (`inputs`, `amaxes`: its own until ops.convert
    shares one of each)."""

    def __init__(self):
        super().__init__()
        self.inputs = SharedInputCopy()
        self.amaxes = KnownAmaxes()

    def __reduce__(self):
        return (type(self), (), {"inputs": self.inputs, "amaxes": self.amaxes})

    def __setstate__(self, state: dict) -> None:
        self.inputs = state["inputs"]
        amaxes = state.get("amaxes")
        self.amaxes = KnownAmaxes() if amaxes is None else amaxes  # None: pickled before it existed

    def __deepcopy__(self, memo):
        new = type(self)()
        new.inputs = copy.deepcopy(self.inputs, memo)  # one copy per shared object, through the memo
        new.amaxes = copy.deepcopy(self.amaxes, memo)
        return new

    def plan(self, key: tuple, quantizers: tuple, weight_shape: torch.Size) -> TrainPlan:
        """The plan for `key`, made anew where it is missing or was made for other quantizers."""
        plan = self.get(key)
        if plan is None or plan.quantizers != quantizers:
            plan = TrainPlan(quantizers, weight_shape)
            self.add(key, plan)
        return plan


def train_forward(op: torch.nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
    """op(x) for a training forward of a lone ops.Linear `op`, or None where this path does not apply (the
    caller then runs the general path). x: a plain tensor, grad mode on (the caller checked both)."""
    params = op._parameters
    w = params["weight"]
    if type(w) is Float8Tensor:
        if not _takes_gathered_weight(w):
            return None  # an FP8-only weight (or a gathered one of another kind): general
    elif type(w) is not torch.nn.Parameter or not (w.requires_grad or x.requires_grad):
        return None  # a DTensor shard; nothing to differentiate: general
    k, n = op.in_features, op.out_features
    if x.dtype not in _ACTIVATION_DTYPES or x.dim() < 2 or x.shape[-1] != k or w.shape != (n, k):
        return None  # float32 activations (the general path warns), a bad shape (it raises)
    m = x.numel() // k
    recipe = op.recipe
    # First the small-layer policy (F.linear follows): a layer under it pays for no more checks here.
    # K, N and the weight gradient's reduction dim (the tokens) multiples of 16: no padding for cuBLASLt.
    d = op.__dict__
    qi, qw, qg = d.get("input_quantizer"), d.get("weight_quantizer"), d.get("grad_quantizer")
    if not fp8_pays_off(recipe, m, k, n, x.device) and not _reads_a_shared_copy(d, recipe, x, qi, w, 2 * m * k * n):
        return None
    if m == 0 or m % 16 or k % 16 or n % 16:
        return None
    if not (stateless_per_tensor(qi) and stateless_per_tensor(qw) and stateless_per_tensor(qg)):
        return None  # delayed, static, per-row, block scaling, an amax group
    if qi.fp8_dtype != torch.float8_e4m3fn or qw.fp8_dtype != torch.float8_e4m3fn:
        return None  # the general path refuses an E5M2 x E5M2 GEMM by name
    if recipe.lean_activations or op.high_precision or op.parallel is not None:
        return None  # lean copies, ops.high_precision, tensor parallelism
    if w.requires_grad and op._weight_cache.w8 is not None:
        return None  # a copy cached by an inference forward, which the general path takes out of the cache
    if (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or forward_ad_or_functorch_active()
        or torch._C._is_any_autocast_enabled()
    ):
        return None
    b = params.get("bias")
    if x.device != w.device or (b is not None and b.device != x.device):
        return None  # the general path says which device is wrong
    plans = d.get("_train_plans")
    if plans is None:  # a Linear unpickled from before the plans existed
        plans = d["_train_plans"] = TrainPlans()
    plan = plans.plan((x.shape, x.dtype, w.dtype, x.device), (qi, qw, qg), w.shape)
    return _TrainLinear.apply(x, w, b, plan, recipe.fprop_fast_accum and x.is_cuda, op, plans.inputs, plans.amaxes)


def _takes_gathered_weight(w: Float8Tensor) -> bool:
    """Whether this path takes w: FSDP2's unsharded FP8 copy of a trained master (float8/fsdp.py), one E4M3
    scale for the whole weight, bits laid out row-major. Its GEMMs read those bits as they are (the general
    path's operands), and its gradient is the master's, in high precision."""
    s = w._scale_inv
    return (
        w._gathered_master
        and w.requires_grad
        and w.fp8_dtype == torch.float8_e4m3fn
        and s.dim() == 0
        and s.dtype == torch.float32
        and s.storage_offset() == 0  # cuBLASLt wants the scale's pointer aligned (float8/gemm.py)
        and w._data.is_contiguous()
        and w._data.storage_offset() == 0
    )


# The small-layer policy's exception: a Linear whose input's FP8 copy another Linear already made (k and v
# after q in Hugging Face's attention) pays for its GEMMs alone, and runs FP8 from this fraction of
# Recipe.min_fp8_gemm_flops up. At 16384 tokens (k and v: 1.4e11 FLOPs each) the eager step with FP8 k and v
# took 250.0 and 252.6 ms against 254.3 and 255.6, and peaked 1.0 GiB lower (the bf16 Linears kept the
# norm's bf16 output for their backward; area step_llama_hf_small_layer_ab); with every small Linear FP8
# at 4096 tokens, where the step waits on the host, it was 17% slower (area step_llama_hf_4096;
# docs/performance.md). The fraction keeps k and v at 8192 tokens and below (6.9e10) in bf16.
SHARED_COPY_FLOPS_FRACTION = 0.4


def _reads_a_shared_copy(d: dict, recipe, x: torch.Tensor, qi, w: torch.Tensor, flops: int) -> bool:
    """Whether the Linear (its __dict__ `d`) reads x's FP8 copy from the Linear before it
    (SharedInputCopy) and its GEMMs are large enough for that to pay (SHARED_COPY_FLOPS_FRACTION)."""
    if not x.is_cuda or flops < SHARED_COPY_FLOPS_FRACTION * recipe.min_fp8_gemm_flops:
        return False
    if (
        torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        or torch._C._current_graph_task_id() != -1
    ):
        # Saved-tensor hooks (a non-reentrant checkpoint, whose recompute must save what the forward saved,
        # finds no shared entry then), or a forward run inside a backward (a reentrant checkpoint's recompute,
        # whose first forward ran without grad, so without this path): the precision follows the layer alone.
        return False
    plans = d.get("_train_plans")
    return plans is not None and stateless_per_tensor(qi) and plans.inputs.lookup(x, qi, w.requires_grad) is not None


class _TrainLinear(torch.autograd.Function):
    """y = x @ w.t() (+ b): FP8 forward GEMM; FP8 weight- and input-gradient GEMMs in the backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan, fast_accum, op, inputs, amaxes):
        qi, qw, _ = plan.quantizers
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        k = x.shape[-1]
        w_t = None
        # The input's FP8 copy made by the Linear before, where it read the same tensor (SharedInputCopy).
        shared = inputs.lookup(x, qi, need_wgrad)
        ctx.amaxes = amaxes
        if shared is None:
            # With its transpose where the weight gradient reads it (a trained weight), else rows only; from
            # max|x| where x's producer computed it (ops/known_amax.py).
            role = "x" if need_wgrad else "x_rows"
            x_data, x_t, x_scale_inv, _ = plan.quantize(role, x.reshape(-1, k), qi, need_wgrad, amaxes.take(x))
            # Without a transpose asked for, quantize_tensorwise hands an empty placeholder in its place.
            x_t = x_t if need_wgrad else None
            inputs.store(x, qi, (x_data, x_t, x_scale_inv))
        else:
            x_data, x_t, x_scale_inv = shared
        # The first backward to run lets the entry go: an input that outlives the forward (a leaf, or one that
        # another op saves) would otherwise keep its FP8 copies past the GEMMs that read them.
        ctx.input_entry = inputs.entry()
        if isinstance(weight, Float8Tensor):
            # FSDP2's gathered FP8 weight (_takes_gathered_weight): its bits and scale as they are. The input
            # gradient's GEMM reads their transpose, made in the backward from the bits FSDP gathers again
            # into the same storage (reshard after forward): nothing of the weight is kept in between.
            w_data, w_scale_inv = weight._data, weight._scale_inv
        elif need_wgrad:
            # The weight without its transpose: the backward quantizes it again for the input gradient rather
            # than keeping it (linear_engine `rebuilds_weight`), except a small one (TrainPlan.small_weight).
            # Quantized again with its own amax pass: a write through weight.data between the forward and the
            # backward moves no version counter, and the forward's amax would then saturate the new values
            # (autograd's saved weight reads them too; the general path quantizes them afresh).
            if need_dgrad and plan.small_weight:
                w_data, w_t, w_scale_inv, _ = plan.quantize("w_t", weight, qw, True)
            else:
                w_data, _, w_scale_inv, _ = plan.quantize("w", weight, qw, False)
        else:
            # A frozen weight: its FP8 copy comes from the op's cache (made once per weight version, with the
            # transpose the input gradient reads), as on the general path.
            x_t = None
            w8, wd = op.quantized_weight(for_backward=True, training=False)
            w_data, w_scale_inv, w_t = w8._data, w8._scale_inv, wd._transpose
        b = None if bias is None else bias.to(x.dtype).contiguous()
        y = torch._scaled_mm(
            x_data, w_data.t(), scale_a=x_scale_inv, scale_b=w_scale_inv, bias=b, out_dtype=x.dtype,
            use_fast_accum=fast_accum,
        )  # fmt: skip
        del x_data
        if not need_wgrad:
            x_scale_inv = None  # nothing of x is kept: no weight gradient to compute
        # The parameters are saved (no copy) so that autograd refuses a backward after an in-place write into
        # one, as the general path does (ops/runner.py _RunFunction).
        ctx.save_for_backward(weight, *(() if bias is None else (bias,)))
        ctx.state = (x_t, x_scale_inv, w_t, w_scale_inv if w_t is not None else None)
        ctx.plan, ctx.need_dgrad, ctx.need_wgrad, ctx.has_bias = plan, need_dgrad, need_wgrad, bias is not None
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        if x.dim() == 2:
            return y
        # A view made inside a Function refuses in-place writes (nn.ReLU(inplace=True) after the Linear): an
        # output of its own over the same memory, as the general path hands out.
        return y.view(*x.shape[:-1], y.shape[-1]).detach()

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors  # raises if a parameter was written in place since the forward, or freed
        weight, bias = saved[0], (saved[1] if ctx.has_bias else None)
        # Unpacked, not held as a tuple: the input's transpose is let go before the input-gradient GEMM, whose
        # output is the backward's largest tensor when K > N (as linear_engine.linear_bwd does).
        x_t, x_scale_inv, w_t, w_scale_inv = take(ctx, "state")
        slot, key = take(ctx, "input_entry")
        slot.drop(key)
        plan = ctx.plan
        _, qw, qg = plan.quantizers
        if isinstance(dy, Float8Tensor):
            dy = dy.dequantize() if bias is not None else dy  # the general path's Linear + Bias dequantizes too
        if isinstance(dy, Float8Tensor):
            # An FP8 gradient from a custom op after the Linear: its own bits are multiplied, by the engine.
            if isinstance(weight, Float8Tensor) and ctx.need_dgrad:
                w_t, w_scale_inv = _gathered_transpose(weight), weight._scale_inv
            dx, dw = _engine_backward(ctx, dy, weight, x_t, x_scale_inv, w_t, w_scale_inv)
            return dx, dw, None, None, None, None, None, None
        dy2 = dy.reshape(-1, dy.shape[-1])
        need_wgrad = ctx.need_wgrad
        dbias = dw = None
        if bias is not None:
            # The bias gradient and dy's cast (and transpose, for the weight gradient) in one kernel, as the
            # general path's Linear + Bias.
            dy_data, dy_t, dy_scale_inv, _, dbias = dact_fp8(
                dy2, dy2, "identity", None, qg.fp8_dtype, None, qg.margin, qg.power_of_2, need_wgrad, True
            )
            dbias = dbias.to(bias.dtype)
        else:
            # max|dy| where the op that wrote dy computed it (ops/known_amax.py)
            role = "dy" if need_wgrad else "dy_rows"
            dy_data, dy_t, dy_scale_inv, _ = plan.quantize(role, dy2, qg, need_wgrad, ctx.amaxes.take(dy))
        if need_wgrad:
            dw = torch._scaled_mm(dy_t, x_t.t(), scale_a=dy_scale_inv, scale_b=x_scale_inv, out_dtype=weight.dtype)
        del x_t, dy_t
        dx = None
        if ctx.need_dgrad:
            if isinstance(weight, Float8Tensor):
                w_t, w_scale_inv = _gathered_transpose(weight), weight._scale_inv
            elif w_t is None:
                _, w_t, w_scale_inv, _ = plan.quantize("w_t", weight.detach(), qw, True)
            dx = torch._scaled_mm(dy_data, w_t.t(), scale_a=dy_scale_inv, scale_b=w_scale_inv, out_dtype=ctx.x_dtype)
            dx = dx.view(ctx.x_shape)
        return dx, dw, (dbias if ctx.needs_input_grad[2] else None), None, None, None, None, None


def _gathered_transpose(weight: Float8Tensor) -> torch.Tensor:
    """The (K, N) transpose of a gathered FP8 weight's bits: its cached one, else the FP8 transpose kernel
    (the copy float8/gemm.py makes for the general path's input-gradient GEMM: the same bits)."""
    cached = weight._transpose
    return cached if cached is not None else transpose_fp8(weight._data)


def _engine_backward(ctx, dy8: Float8Tensor, weight, x_t, x_scale_inv, w_t, w_scale_inv) -> tuple:
    """(dx, dw) of an FP8 output gradient through linear_engine.linear_bwd, the general path's own backward,
    from what this path saved (the same operands the general path would have saved)."""
    tensor = ScaleLayout.TENSOR
    x = None if x_t is None else Operand(x_t.mT, x_scale_inv, None, ctx.x_dtype, tensor)
    w = None if w_t is None else Operand(w_t.mT, w_scale_inv, None, weight.dtype, tensor)
    rebuild = None if w_t is not None or not ctx.need_dgrad else (weight.detach(), None)
    saved = LinearSaved(tensor, x, w, ctx.x_dtype, ctx.need_wgrad, ctx.need_dgrad, rebuild)
    dx, dw = linear_bwd(dy8.reshape(-1, dy8.shape[-1]), saved, LinearQuantizers(*ctx.plan.quantizers), weight.dtype)
    if isinstance(dx, Float8Tensor):
        dx = dx.dequantize()
    return (None if dx is None else dx.reshape(ctx.x_shape)), dw
