"""Re-quantize every FP8 weight of a model right after the optimizer step, in one fused pass.

    opt.step()
    ops.requantize_weights(model)   # or once: opt.register_step_post_hook(lambda *_: ops.requantize_weights(model))

Without it, each Linear quantizes its weight lazily in its next forward: an amax pass and a
cast-transpose, 2-3 launches per Linear, each on the forward's critical path. `requantize_weights` writes
the same FP8 copies (bit for bit) for all per-tensor current-scaling weights of the model in two launches
(kernels/multi_quantize.py) and leaves each in its Linear's weight cache, where the next forward finds it
(keyed by the weight's version, so a copy of an older weight is never read). A training forward takes the
copy out of the cache (ops/linear.py), so no FP8 weight outlives the step that reads it.

What it costs: between `requantize_weights` and the next forward each weight holds its FP8 copy (1 byte per
parameter), and a trained weight whose backward reads the forward's transpose holds that too (delayed,
row-wise or block scaling, an amax group, an input not per tensor; under per-tensor current scaling the
backward quantizes the weight again, ops/linear_engine.py `rebuilds_weight`); float8.memory_footprint
counts them. With gradient accumulation only the first micro-batch reads the copies; the others quantize as
before. Weights that are not per-tensor current scaling (delayed, row-wise, block, an amax group) are
quantized one by one through their own quantizer (the same copies, not fused). FP8-only weights, sharded
(DTensor) weights (FSDP2's FP8 all-gather quantizes those: float8/fsdp.py) and weights on the meta device are
left alone. Under torch.compile or CUDA-graph capture a Linear never reads this cache (it quantizes inside
the graph), so there the call only costs memory: do not use it with a compiled forward.
"""

from __future__ import annotations

import torch

from float8.kernels.multi_quantize import quantize_tensorwise_multi
from float8.ops.base import is_dtensor
from float8.ops.linear import Linear
from float8.ops.linear_engine import rebuilds_weight, stateless_per_tensor
from float8.tensor import Float8Tensor

__all__ = ["requantize_weights"]


def _skipped(w: torch.Tensor) -> bool:
    return isinstance(w, Float8Tensor) or is_dtensor(w) or w.device.type == "meta"


def requantize_weights(model: torch.nn.Module) -> int:
    """Quantize the weight of every float8.ops.Linear in `model` for its next forward; returns how many.

    Call it after `optimizer.step()` (or from an optimizer step post-hook). A weight that requires grad also
    gets its transpose where the input-gradient GEMM reads the forward's (not where the backward quantizes
    the weight again); a frozen one does not. Per-tensor current-scaling
    weights of one device, dtype and format are quantized together in two kernel launches; others one by one.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"requantize_weights takes an nn.Module, got {type(model).__name__}")
    fused, single = {}, []
    for op in model.modules():
        if not isinstance(op, Linear) or _skipped(op.weight):
            continue
        w, q = op.weight, op.weight_quantizer
        # The old copies go first, so that old and new FP8 weights are never alive together.
        op.refresh_fp8_weight()
        with_t = w.requires_grad and not rebuilds_weight(w, op.quantizers)
        if stateless_per_tensor(q) and w.is_contiguous():
            key = (w.device, w.dtype, q.fp8_dtype, q.margin, q.power_of_2, with_t)
            fused.setdefault(key, []).append(op)
        else:
            single.append(op)
    with torch.no_grad():
        for (_, _, fp8_dtype, margin, power_of_2, with_t), group in fused.items():
            weights = [op.weight.detach() for op in group]
            outs = quantize_tensorwise_multi(weights, fp8_dtype, margin, power_of_2, with_t)
            for op, w, data, data_t, scale_inv, amax in zip(group, weights, *outs):
                w8 = op.weight_quantizer.finish(data, data_t, scale_inv, amax, w.dtype, with_t)
                op._weight_cache.store(op.weight, w8, w8 if with_t else None)
        for op in single:  # quantizes and caches, as inference does
            op.quantized_weight(for_backward=op.weight.requires_grad and not rebuilds_weight(op.weight, op.quantizers))
    return sum(len(g) for g in fused.values()) + len(single)
