"""Linear: y = x @ W.t() (+ bias), fprop, dgrad and wgrad as FP8 GEMMs.

The op is `linear_fwd` / `linear_bwd` (the engine of the stateless primitive, ops/linear_engine.py) plus what
must live longer than one call: three quantizers built by its recipe (input, weight, output gradient;
delayed ones are submodules whose history is in the state dict from construction) and the FP8 copy of
its weight.
- The input is saved for backward as FP8, never as a high-precision copy, and only in the layout the
  weight-gradient GEMM reads: 1 byte per element.
- The weight's FP8 copy lives only as long as something reads it. In training (the weight's gradient is
  computed) it is made in the forward, the forward GEMM reads it, and the backward keeps only the layout
  the input-gradient GEMM reads (the transpose, 1 byte per parameter, freed after backward); nothing of
  it is kept between steps, and gradient-accumulation micro-batches each quantize again (one
  cast-transpose per weight, ~2 ms per step for 1.7B parameters on an H100, against 2 bytes per
  parameter held). A copy already cached for this weight version (by an inference forward) is taken
  out of the cache by the training forward that reads it. For inference and frozen
  weights the copy is cached until the weight changes, keyed by the weight's version counter (every
  in-place optimizer update moves it), its place in its storage and the storage itself (a weak
  reference: replacing `weight.data` is seen even when the new storage reuses the old address, and the
  stale copy is freed at the next call; replacing `weight` frees it at once). Writes into the
  weight's storage that move no counter of the weight (through `weight.data`, or through another tensor
  over the same storage) need `refresh_fp8_weight()` after them (load_state_dict and .to() refresh by
  themselves). Under CUDA-graph capture or torch.compile the weight is quantized inside the graph on
  every call (a replay cannot check a version counter). Under no_grad/inference_mode no transpose is
  made. An FP8-only weight (a Float8Tensor parameter, which must not require grad) is used as it is: 1
  byte per parameter.
- Per-tensor recipes use the same FP8 bits transposed in the backward pass; per-row recipes quantize the
  transposed operands along their own rows; block recipes run the GEMMs on the dequantized operands
  (their numerics, not yet their speed). Mixed layouts that cannot meet in one FP8 GEMM do the same.
- With bias=True, inside a Sequential this op is Linear + Bias, and the fusion list folds the bias into the
  GEMM epilogue (forward) and into the gradient's cast-transpose kernel (backward).
"""

from __future__ import annotations

import math
import warnings
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from float8 import DelayedScalingState, Float8Tensor
from float8.kernels import block_gemm, fp8_block_mm, quantize_blockwise, rowwise_input_mm, weight_only
from float8.kernels.common import forward_ad_or_functorch_active
from float8.ops.base import BasicOp, OpContext, RunState, check_gathered, is_dtensor, take
from float8.ops.bias import Bias, add_bias
from float8.ops.input_scale import fix_input_scale
from float8.ops.linear_engine import (
    check_fp8_weight_grad,
    fp8_pays_off,
    grad_request,
    linear_bwd,
    linear_fwd,
    linear_fwd_high_precision,
    quantize_weight,
    rebuilds_weight,
    requantizes_input,
)
from float8.ops.linear_train import TrainPlans, train_forward
from float8.ops.parallel import check_parallel, parallel_expansion
from float8.ops.weight_cache import InferencePlans, WeightCache
from float8.quantizer import (
    LinearQuantizers,
    QuantRequest,
    ScaleLayout,
    StaticScalingState,
    check_amax_group,
    check_dense,
    dequantized_gemms,
)

# Where a calibrated Linear's static input scale sits in its state dict (ops/calibrate.py).
STATIC_SCALE_KEY = "input_quantizer.static_scale"


def _check_features(n, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"Linear: {name} must be a positive int, got {n!r} (a GEMM with an empty dim has no FP8 form)")
    return n


class Linear(BasicOp):
    """y = x @ weight.t() + bias, with FP8 GEMMs.

    x: (..., in_features) float32/bfloat16/float16 (or a Float8Tensor from the op before); y: (...,
    out_features) in x's dtype. `weight`: (out_features, in_features) and `bias`: (out_features,) like
    nn.Linear (same initialisation). Options, keyword-only: bias, device, dtype, recipe (a float8.Recipe;
    a Sequential's recipe otherwise, else Recipe()), amax_group (a process group over which per-tensor
    amaxes are reduced, so that all ranks quantize with one scale; a Sequential's otherwise).

    Tensor parallelism (Megatron-style), over the process group `tp_group`:
    - parallel="column": this rank holds rows [r*n, (r+1)*n) of the weight and bias (n = out_features /
      world): the output is this rank's block of features. The input's gradient is summed over the group.
    - parallel="row": this rank holds columns [r*k, (r+1)*k) of the weight (k = in_features / world) and
      takes that block of the input's features; the outputs are summed over the group, then the (whole)
      bias is added.
    - sequence_parallel=True: outside the Linear, activations are sharded along tokens (sequence-first:
      (S, B, features), each rank an equal block of S). A column-parallel Linear all-gathers its input as
      FP8 (its input quantizer reduces its amax over the group, so the scale is one; ops/parallel.py says
      who casts), and a row-parallel one reduce-scatters its output (in high precision). Norms and
      biases in the sharded region then see only local tokens: give them `sequence_parallel_group`.
    in_features/out_features are the whole layer's; `weight` is this rank's shard (`local_in_features`,
    `local_out_features`), initialised as the whole layer's would be. The ops of ops/parallel.py
    that do the communication are part of this op's `expand()`.
    """

    fusion_role, gemm, saves = "linear", True, ("saved", "lead")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        device=None,
        dtype=None,
        recipe=None,
        amax_group=None,
        parallel: Optional[str] = None,
        tp_group=None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.in_features = _check_features(in_features, "in_features")
        self.out_features = _check_features(out_features, "out_features")
        self.parallel, self.tp_group, self.sequence_parallel = check_parallel(
            parallel, tp_group, sequence_parallel, in_features, out_features
        )
        world = tp_group.size() if tp_group is not None else 1
        self.local_in_features = in_features // world if parallel == "row" else in_features
        self.local_out_features = out_features // world if parallel == "column" else out_features
        factory = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty(self.local_out_features, self.local_in_features, **factory))
        self.bias = (
            torch.nn.Parameter(
                torch.empty(self.local_out_features if parallel == "column" else out_features, **factory)
            )
            if bias
            else None
        )
        self._weight_cache = WeightCache()
        self._inference_plans = InferencePlans()
        self._train_plans = TrainPlans()
        self._expansion: Optional[list] = None
        self._amax_group = check_amax_group(amax_group)
        self.set_recipe(recipe)
        self.reset_parameters()
        self.expand()  # built here, not at the first call, which may be inside torch.compile

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation (kaiming-uniform weight, uniform bias; FP8-only weights are kept),
        and fresh delayed-scaling states (also after `to_empty` of a model built on the meta device)."""
        for q in self._modules.values():
            if isinstance(q, DelayedScalingState):
                q.reset_parameters()
        self.refresh_fp8_weight()
        if isinstance(self.weight, Float8Tensor):
            return
        # nn.Linear's kaiming_uniform_(a=sqrt(5)), written out with the whole layer's fan_in, so that a
        # tensor-parallel shard is drawn from the distribution of the unsharded layer (same arithmetic as
        # torch's, so an unsharded Linear matches nn.Linear bit for bit under one seed).
        gain = torch.nn.init.calculate_gain("leaky_relu", math.sqrt(5))
        weight_bound = math.sqrt(3.0) * (gain / math.sqrt(self.in_features))
        torch.nn.init.uniform_(self.weight, -weight_bound, weight_bound)
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        s = f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        if self.parallel is not None:
            s += f", parallel={self.parallel!r}, tp={self.tp_group.size()}, sequence_parallel={self.sequence_parallel}"
        return s

    # ---- quantizers, built by the recipe ---------------------------------------------------------
    def _recipe_changed(self) -> None:
        built = self.recipe.quantizers(device=self.weight.device, amax_group=self.amax_group)
        if self.sequence_parallel and self.parallel == "column" and self.amax_group is None:
            # The input is all-gathered as FP8 under one per-tensor scale: its amax is reduced over the group.
            built = built._replace(
                input=self.recipe.quantizers(device=self.weight.device, amax_group=self.tp_group).input
            )
        for role, quantizer in zip(LinearQuantizers._fields, built):
            name = f"{role}_quantizer"
            self._modules.pop(name, None)
            setattr(self, name, quantizer)  # a DelayedScalingState registers as a submodule (its history)
        self.refresh_fp8_weight()

    @property
    def quantizers(self) -> LinearQuantizers:
        """(input, weight, grad) quantizers of this op."""
        return LinearQuantizers(self.input_quantizer, self.weight_quantizer, self.grad_quantizer)

    def expand(self) -> List[BasicOp]:
        # Kept as the ops before and after this one, never with the op itself: a list holding `self` would
        # be a reference cycle, and a deleted model would wait for the garbage collector to free its memory.
        if self._expansion is None or self._expansion_bias_of(self._expansion[1]) is not self.bias:
            parts = parallel_expansion(self, self._expansion_bias())
            if torch.compiler.is_compiling():
                return [
                    *parts[0],
                    self,
                    *parts[1],
                ]  # a module written while dynamo traces breaks its graph: built at __init__
            self._expansion = parts
        head, tail = self._expansion
        return [*head, self, *tail]

    def _expansion_bias(self):
        if self.bias is None:
            return None
        sp = self.tp_group if (self.parallel == "row" and self.sequence_parallel) else None
        return Bias(self.bias.shape[0], parameter=self.bias, sequence_parallel_group=sp)

    @staticmethod
    def _expansion_bias_of(expansion):
        return next((op.bias for op in expansion if isinstance(op, Bias)), None)

    has_torch_forward = True

    def op_params(self) -> List[torch.nn.Parameter]:
        return check_gathered(self, [self.weight])  # the bias belongs to the Bias op of the expansion

    # ---- what this op asks of its neighbours -----------------------------------------------------
    def input_request(self, grad: bool, tokens: int) -> Optional[QuantRequest]:
        q = self.input_quantizer
        if q.layout is not ScaleLayout.TENSOR or not self.runs_in_fp8(tokens, self.weight.device):
            return None  # per-row/block inputs are quantized here, from high precision, in both directions
        # Lean activations: rows only, the layout the forward GEMM reads (the backward makes the other).
        return QuantRequest(q, grad and self.weight.requires_grad and not self.recipe.lean_activations)

    def grad_request(self, ctx: Optional[OpContext] = None) -> Optional[QuantRequest]:
        return grad_request(
            getattr(ctx, "saved", None), self.quantizers, self.weight.requires_grad, self.recipe.lean_activations
        )

    # ---- the small-layer policy ------------------------------------------------------------------
    # Set on an instance for a while by ops.high_precision(model): GEMMs in the activation dtype.
    high_precision = False

    def runs_in_fp8(self, tokens: int, device: torch.device) -> bool:
        """FP8 unless, on CUDA, the GEMMs are too small for FP8 to win (Recipe.min_fp8_gemm_flops), or
        inside ops.high_precision(model).

        An FP8-only weight otherwise always runs in FP8; the CPU path always does (it exists to be exact)."""
        if self.high_precision:
            return False
        if isinstance(self.weight, Float8Tensor):
            return True
        return fp8_pays_off(self.recipe, tokens, self.local_in_features, self.local_out_features, device)

    def runs_as_torch(self, tokens: int, device: torch.device) -> bool:
        """Whether this Linear may run as F.linear (its `torch_forward`): a high-precision weight of a layer
        that is not tensor-parallel, on GEMMs too small for FP8 (the small-layer policy)."""
        return self.parallel is None and not self.runs_in_fp8(tokens, device) and not is_dtensor(self.weight)

    def torch_forward(
        self, x: torch.Tensor, run: Optional[RunState] = None, bias: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """F.linear(x, weight, bias) in x's dtype: the same kernels and autograd as nn.Linear (a bias in
        another dtype, a float32 master, is added after the GEMM in its own precision: ops/bias.py)."""
        self._check_input(x)
        w = self.weight
        if self._weight_cache.w8 is not None and w.requires_grad and torch.is_grad_enabled():
            self._weight_cache.clear()  # a copy from ops.requantize_weights that this step does not read
        if isinstance(w, Float8Tensor):
            w = w.dequantize(x.dtype)  # an FP8-only weight under ops.high_precision
        if w.dtype != x.dtype:
            w = w.to(x.dtype)
        if bias is not None and bias.dtype != x.dtype:
            return add_bias(F.linear(x, w), bias)
        return F.linear(x, w, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            check_dense(x, "Linear")
        # Not while dynamo traces: the fast path's checks would each add a guard to the compiled call.
        if type(x) is torch.Tensor and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            y = train_forward(self, x)  # the common eager training step, without the op runner
            if y is not None:
                return y
        tracing = torch.compiler.is_compiling()
        if type(x) is torch.Tensor and not tracing:  # dynamo never reads the plans
            prepared = self._inference_plans.get((x.shape, x.dtype))
            if prepared is not None:
                y = self._prepared_forward(prepared, x)
                if y is not None:
                    return y
        # Alone and below the policy's size: exactly nn.Linear (native autograd, the same kernels), with as
        # little Python before it as nn.Linear has: at M = 1024 a bf16 Linear's fwd+bwd is about as long on
        # the GPU (0.15 ms) as on the H100 machine's host, so each microsecond here shows in the ratio.
        if torch.is_autocast_enabled(x.device.type) and x.is_floating_point():
            # As nn.Linear under autocast: the product runs in (and returns) the autocast dtype. Our GEMMs are
            # not ops autocast knows, so the input is cast here (its gradient flows back in its own dtype).
            dtype = torch.get_autocast_dtype(x.device.type)
            if x.dtype != dtype:
                x = x.to(dtype)
        if type(x) is torch.Tensor and x.dim() >= 1 and x.shape[-1] == self.in_features:
            w = self.weight
            # Eagerly type() first: a plain Parameter (the common case) skips isinstance (55 against 170 ns on a
            # dev CPU). Traced, isinstance alone: each type() read of a weight added a Python guard that every
            # compiled call checks (`type(w_i) is type(w_0)`, one per converted Linear after the first).
            if (
                (tracing or type(w) is not torch.nn.Parameter)
                and isinstance(w, Float8Tensor)
                and not self.high_precision
            ):
                y = self._inference_forward(x)
                if y is not None:
                    return y
            if self.runs_as_torch(x.numel() // self.in_features, x.device):
                return self.torch_forward(x, bias=self.bias)
        return super().forward(x)

    def _prepared_forward(self, prepared, x: torch.Tensor) -> Optional[torch.Tensor]:
        """A repeated decode-size inference call: what `_inference_forward` checked and planned for this input
        shape and dtype, re-checked only where it can change between calls (grad mode, autocast, tracing,
        the device, contiguity, the weight and bias tensors), then the prepared launch. None: the full path.
        On the H100 machine's host this path is what keeps an eager FP8 Linear's host time near nn.Linear's
        (docs/inference.md gives the measured numbers)."""
        params = self._parameters
        w, b = params["weight"], params.get("bias")
        data, scale_inv = getattr(w, "_data", None), getattr(w, "_scale_inv", None)
        if (
            self.high_precision
            or not prepared.matches(data, scale_inv, b)
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)))
            or torch._C._is_any_autocast_enabled()
            or torch._C._len_torch_dispatch_stack()
            or forward_ad_or_functorch_active()
            or x.get_device() != prepared.device_index
            or not x.is_contiguous()
            or (b is not None and (b.dtype != x.dtype or not b.is_contiguous()))
        ):
            return None
        return prepared(x, data, scale_inv, b)  # x's rows as they are, y in x's leading dims: no views

    def _inference_forward(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """An FP8-only weight's inference forward (no backward to record) without the op runner: the layer's
        GEMM called directly. None where it does not apply (then the general path runs): a backward to
        record, a tensor-parallel layer, an amax group, operands the kernels do not take.

        - At <= weight_only.MAX_TOKENS tokens: one kernel reads the weight's FP8 bytes and multiplies them
          with x as it is (kernels/weight_only.py): no activation quantization, one launch. Its numerics are
          the product with the dequantized weight in float32, rounded once. The same for a weight the FP8
          x FP8 kernel below does not take (E5M2, 128x128 block scales).
        - Unless the recipe asks for FP8 inputs from fewer tokens (`Recipe.inference_fp8_input_from`): from
          there on x is quantized per row to E4M3 and an FP8 x FP8 kernel runs (kernels/rowwise_input_mm.py):
          one launch when prepared, half the MMA work.
        - Above: `linear_fwd`, the general path's own forward (the same bits): x quantized by the input
          quantizer (one cast with a calibrated scale), then the FP8 GEMM.

        Where the line is drawn, and why: kernels/weight_only.py MAX_TOKENS. Above it the runner's host time
        is what this path saves (at 16 tokens it cost 191 us per call on the H100 machine's host against 27 us
        for a bf16 nn.Linear, .scratch micro-benchmark, 2026-11-25)."""
        tokens = x.numel() // self.in_features
        if tokens == 0 or self.parallel is not None or self.input_quantizer.amax_group is not None:
            # An amax group: the general path reduces the input's amax over the group; skipping it on ranks
            # with few tokens would leave the others waiting in (or pairing with the wrong) collective.
            return None
        if forward_ad_or_functorch_active():
            return None  # a dual or functorch-wrapped input: the general path differentiates or refuses
        bias = self.bias
        if torch.is_grad_enabled() and (
            x.requires_grad or self.weight.requires_grad or (bias is not None and bias.requires_grad)
        ):
            return None
        w = self.weight
        if w.device != x.device or (
            bias is not None and (bias.device != x.device or type(bias) is not torch.nn.Parameter)
        ):
            return None
        x2 = x.reshape(tokens, self.in_features)
        if tokens <= weight_only.MAX_TOKENS:
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()  # a transposed input: the same kernel and bits as its contiguous copy
            # The fields, not the fp8_data / scale_inv properties: traced, each property read added an identity
            # guard (`w._data is w.fp8_data`) that every compiled call checks in Python (guard check of 4
            # converted Linears: 10.6 -> 9.2 us on a dev CPU, torch 2.13, 2026-11-27).
            data, scale_inv = w._data, w._scale_inv
            if not weight_only.supports(x2, data, scale_inv) or data.shape[1] != self.in_features:
                return None
            if bias is not None and (bias.dtype != x.dtype or bias.stride(0) != 1):
                return None
            kernel = weight_only
            fp8_input = tokens >= self.recipe.inference_fp8_input_from
            if fp8_input and rowwise_input_mm.supports(x2, data, scale_inv):
                kernel = rowwise_input_mm
            if self._plannable(x, x2, bias):
                plans = self._inference_plans
                out_shape = (*x.shape[:-1], self.out_features)
                y, prepared = kernel.prepare(x2, data, scale_inv, bias, out_shape=out_shape, scratch=plans.scratch)
                if prepared is not None:
                    plans.add((x.shape, x.dtype), prepared)
            elif kernel is rowwise_input_mm:
                y = rowwise_input_mm.fp8_rowwise_input_mm_prechecked(x2, data, scale_inv, bias)
            else:
                y = weight_only.fp8_weight_mm_prechecked(x2, data, scale_inv, bias)
        else:
            if x.dtype not in (torch.bfloat16, torch.float16):
                return None
            if weight_only.scale_mode(w.fp8_data, w.scale_inv)[0] == 2:
                y = self._block_forward(x2, w, bias)
                return None if y is None else y.reshape(*x.shape[:-1], self.out_features)
            if dequantized_gemms(self.input_quantizer.layout):
                return None
            # The bias joins the GEMM's epilogue in x's dtype, as the runner's Linear + Bias fusion adds it.
            y, _ = linear_fwd(
                x2,
                w,
                None,
                None if bias is None else bias.to(x.dtype),
                self.quantizers,
                need_wgrad=False,
                need_dgrad=False,
                fast_accum=self.recipe.fprop_fast_accum,
            )
        return y.reshape(*x.shape[:-1], self.out_features)

    def _plannable(self, x, x2, bias) -> bool:
        """Whether this checked weight-only call may be prepared for repeats (`_prepared_forward`): a plain
        eager call on a CUDA device, with a contiguous input (its 2-D view has the strides the plan fixes)."""
        traced = torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
        return (
            not traced
            and x.is_cuda
            and x.is_contiguous()
            and x2.is_contiguous()
            and weight_only.use_triton(x2)
            and not torch._C._is_any_autocast_enabled()
            and (bias is None or bias.is_contiguous())
        )

    def _block_forward(self, x2: torch.Tensor, w: Float8Tensor, bias) -> Optional[torch.Tensor]:
        """A block-scaled FP8-only weight (a hub checkpoint's 128x128 blocks) above the weight-only kernel's
        token limit: x quantized in 1 x C blocks (C: the weight's block width), then the block-scaled FP8 GEMM
        (kernels/block_gemm.py, DeepSeek's scheme), at current scaling with no margin: the input quantizer's
        settings (a margin, a calibrated static scale) serve per-tensor weights, not this path. None where its
        operands do not fit (the general path then multiplies the dequantized weight)."""
        cols = self.in_features // w.scale_inv.shape[1]
        if not x2.is_contiguous() or not block_gemm.supported_width(cols):
            return None
        data, scale_inv = quantize_blockwise(x2, 1, cols, self.recipe.format.forward_dtype)
        if not block_gemm.supports(data, scale_inv, w.fp8_data, w.scale_inv):
            return None
        b = None if bias is None else bias.to(x2.dtype).contiguous()
        return fp8_block_mm(data, scale_inv, w.fp8_data, w.scale_inv, b, x2.dtype)

    # ---- the weight's FP8 copy ------------------------------------------------------------------------
    def __setattr__(self, name, value):
        # Replacing the weight (`op.weight = Parameter(...)`) drops the FP8 copy of the old one at once.
        if name in ("weight", "bias") and "_weight_cache" in self.__dict__:
            self._weight_cache.clear()
            self._inference_plans.clear()
        super().__setattr__(name, value)

    def cached_fp8_tensors(self) -> list:
        """What this op holds between calls (counted by float8.memory_footprint): its FP8 weight copies and
        the workspace its prepared inference calls keep (kernels/scratch.py)."""
        return self._weight_cache.tensors() + self._inference_plans.scratch.tensors()

    def refresh_fp8_weight(self) -> None:
        """Forget the cached FP8 weight. Needed only after writing the weight through `.data` in place
        (such writes move no version counter); loads, moves and replacing `.data` are seen by themselves."""
        self._weight_cache.clear()
        self._inference_plans.clear()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        self.refresh_fp8_weight()
        key = prefix + STATIC_SCALE_KEY
        if key in state_dict and not isinstance(self.input_quantizer, StaticScalingState):
            # A checkpoint of a calibrated model (ops.calibrate) into one that is not: a static input
            # quantizer to load the scale into (its load, right after this one, validates the value).
            try:
                fix_input_scale(self, scale=state_dict[key])
            except (ValueError, TypeError) as e:
                # Not taken: torch then reports the key as unexpected under strict=True and drops it under
                # strict=False (it passes strict=True to every module, so the choice is made there); the
                # warning says why.
                warnings.warn(
                    f"{key}: a calibrated static input scale, which this Linear cannot take: {e}", stacklevel=2
                )
        return super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs
        )

    def _apply(self, fn, *args, **kwargs):
        self.refresh_fp8_weight()
        return super()._apply(fn, *args, **kwargs)

    def quantized_weight(
        self, for_backward: bool, training: bool = False, in_torch_ops: bool = False
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(forward operand, dgrad operand or None): FP8 copies of the weight.

        training: this forward computes the weight's gradient, so the weight changes at the next optimizer
        step. Its FP8 copy is then made for this step only and not kept (a copy already cached for this
        weight version is taken and dropped from the cache): keeping it would hold 2 bytes
        per parameter between steps that no later step reads. Otherwise (inference, a frozen weight) the copy
        is cached until the weight changes. in_torch_ops: under torch.compile, quantized in torch operations
        (ops/linear_engine.py `quantize_fusable`)."""
        w = self.weight
        if isinstance(w, Float8Tensor):
            return w, (w if for_backward else None)
        q = self.weight_quantizer
        if torch.compiler.is_compiling() or (w.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            # Inside a CUDA graph (torch.cuda.graph, make_graphed_callables) the quantization is recorded
            # and re-run by every replay, so it reads the weight of that step; a cached copy would be frozen
            # into the graph. Never use the cache here, and never fill it with a tensor of the graph's pool.
            # (Not asked while torch.compile traces: dynamo would break its graph on the query.)
            return quantize_weight(w, q, for_backward, in_torch_ops)
        cache = self._weight_cache
        hit = cache.lookup(w, for_backward)
        if training:
            cache.clear()
            return hit if hit is not None else quantize_weight(w, q, for_backward)
        if hit is not None:
            return hit
        # Drop the stale copy first, so that old and new FP8 weights are not alive together (at
        # 14336x4096 with its transpose that is 112 MiB of peak memory saved per Linear).
        cache.clear()
        w8, wd = quantize_weight(w, q, for_backward)
        cache.store(w, w8, wd)
        return w8, wd

    # ---- forward / backward --------------------------------------------------------------------
    def _check_input(self, x) -> None:
        if x.dim() < 1 or x.shape[-1] != self.local_in_features:
            raise ValueError(f"Linear expects input (..., {self.local_in_features}), got shape {tuple(x.shape)}")

    def op_forward(
        self,
        ctx: OpContext,
        x: torch.Tensor,
        out_request: Optional[QuantRequest] = None,
        bias: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        self._check_input(x)
        if ctx.run.grad:
            check_fp8_weight_grad(self.weight)
        need_wgrad = ctx.run.grad and self.weight.requires_grad
        need_dgrad = ctx.run.grad and ctx.input_requires_grad
        lead = x.shape[:-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, self.local_in_features)
        ctx.lead = lead
        if not isinstance(x2, Float8Tensor) and not self.runs_in_fp8(x2.shape[0], x2.device):
            if need_wgrad:
                self._weight_cache.clear()  # nothing FP8 of a trained weight outlives the step
            y, ctx.saved = linear_fwd_high_precision(
                x2, self.weight, bias, need_wgrad=need_wgrad, need_dgrad=need_dgrad
            )
        else:
            lean = self.recipe.lean_activations
            # The backward quantizes a trained weight again (same bits) instead of keeping its FP8 transpose
            # from the forward: 1 byte per parameter less held through the step (1.6 GiB in the 8-block
            # Llama-style model), for 3 bytes of traffic per parameter (~1% of its step; docs/memory.md). A
            # frozen weight's copies are cached across steps anyway: the cache serves both.
            rebuild = need_dgrad and need_wgrad and rebuilds_weight(self.weight, self.quantizers)
            # Compiled, with a high-precision input: among torch code (ops/linear_engine.py `quantize_fusable`)
            among_torch = torch.compiler.is_compiling() and not isinstance(x2, Float8Tensor)
            w8, wd = self.quantized_weight(
                for_backward=need_dgrad and not rebuild, training=need_wgrad, in_torch_ops=among_torch
            )
            y, ctx.saved = linear_fwd(
                x2,
                w8,
                wd,
                bias,
                self.quantizers,
                need_wgrad=need_wgrad,
                need_dgrad=need_dgrad,
                fast_accum=self.recipe.fprop_fast_accum,
                rows_only=lean,
                rebuild_weight=self.weight if rebuild else None,
                requantize_input=torch.compiler.is_compiling() and requantizes_input(self.quantizers),
            )
        return y.reshape(*lead, self.local_out_features)

    def op_backward(
        self, ctx: OpContext, dy: torch.Tensor, dx_request: Optional[QuantRequest] = None
    ) -> Tuple[Optional[torch.Tensor], List[Optional[torch.Tensor]]]:
        saved = take(ctx, "saved")
        dy2 = dy if dy.dim() == 2 else dy.reshape(-1, self.local_out_features)
        dx, dw = linear_bwd(dy2, saved, self.quantizers, self.weight.dtype)
        if dx is not None:
            dx = dx.reshape(*ctx.lead, self.local_in_features)
        w = self.weight
        trainable = not isinstance(w, Float8Tensor) or w._gathered_master  # FSDP2's FP8 copy of a master
        return dx, [dw if trainable else None]
