"""convert(model): swap a model's nn.Linear layers for float8.ops.Linear, in place.

    model = float8.ops.convert(model)                                   # FP8 GEMMs, same parameters
    model = float8.ops.convert(model, fp8_weights=True)                 # inference: 1-byte weights

What is converted: every module whose type is exactly `torch.nn.Linear` (subclasses are skipped: their
forward may do more than F.linear, and some, like nn.MultiheadAttention's out_proj, are never called as
modules) for which `filter_fn(module, fqn)` is true, when FP8 can serve it:
- in_features and out_features are multiples of 16 (the FP8 GEMMs' alignment; a padded GEMM would cost
  more than it saves at such sizes);
- the weight is float32, bfloat16 or float16 and not a sharded DTensor (convert before fully_shard);
- with fp8_weights=True: the weight is on a real device (not meta) and not shared with another module
  (tied embeddings: an FP8 copy would untie them and keep the high-precision one alive).
Layers that fail a rule stay nn.Linear and are listed, each with its reason, in one ConversionWarning.
A float8.ops.Linear (converted before) with a high-precision weight gets an FP8-only weight under
fp8_weights=True, by the same rules.

The new op takes the same Parameter objects (an optimizer built before conversion keeps working, tied
weights stay tied), the same training flag, and the forward hooks of the old module are not carried over.
fp8_weights=True replaces each converted weight by an FP8-only Float8Tensor parameter (1 byte per element
plus a 4-byte scale, no transpose, requires_grad=False): for inference and for frozen, LoRA-style bases. The
high-precision weight is freed once nothing else refers to it. On a Hugging Face model, fp8_weights=True
also makes `model.save_pretrained(directory)` write the hub's FP8 layout (float8/checkpoint.py
enable_save_pretrained: it sets `model.hf_quantizer` and `config.quantization_config`, as transformers'
own quantized models have them), which `float8.load_checkpoint` and transformers read.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from float8 import DelayedScaling, Float8Tensor, Recipe, TensorwiseScaling
from float8.checkpoint import enable_save_pretrained
from float8.kernels.scratch import Scratch
from float8.ops.base import is_dtensor
from float8.ops.known_amax import KnownAmaxes
from float8.ops.linear import Linear
from float8.ops.linear_train import SharedInputCopy, TrainPlans
from float8.ops.saved_outputs import SavedOutputs, detach_all
from float8.ops.sequential import linears_outside_sequentials
from float8.ops.swiglu_fusion import SwiGLUFusion
from float8.quantizer import quantizer_for

__all__ = ["ConversionWarning", "convert", "skip_reason"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ConversionWarning(UserWarning):
    """Some layers were left as they were by float8.ops.convert; the message lists them and why."""


def skip_reason(linear: torch.nn.Linear, *, fp8_weights: bool = False, tied_to: Optional[str] = None) -> Optional[str]:
    """Why `convert` leaves this layer as it is, or None when FP8 can serve it (the rules above)."""
    if type(linear) is not torch.nn.Linear:
        return f"{type(linear).__name__} is a subclass of nn.Linear (its forward may differ)"
    k, n = linear.in_features, linear.out_features
    if k % 16 or n % 16:
        return f"in_features={k}, out_features={n}: FP8 GEMMs need multiples of 16"
    w = linear.weight
    if is_dtensor(w):
        return "the weight is a sharded DTensor: convert before fully_shard / parallelize_module"
    if w.dtype not in _DTYPES:
        return f"weight dtype {w.dtype} (float32, bfloat16 or float16 needed)"
    if fp8_weights and w.device.type == "meta":
        return "fp8_weights=True needs the weights' values (this one is on the meta device)"
    if fp8_weights and tied_to is not None:
        return f"fp8_weights=True: the weight is shared with {tied_to} (an FP8 copy would untie them)"
    return None


def convert(
    model: torch.nn.Module,
    *,
    recipe: Optional[Recipe] = None,
    filter_fn: Optional[Callable[[torch.nn.Module, str], bool]] = None,
    fp8_weights: bool = False,
    fuse_swiglu: bool = True,
) -> torch.nn.Module:
    """Replace model's nn.Linear layers by float8.ops.Linear in place and return the model.

    recipe: the converted layers' Recipe (default Recipe()). filter_fn(module, fqn) -> bool picks the
    layers (default: all). fp8_weights: make the weights FP8-only (see the module docstring). fuse_swiglu:
    the model's own `F.silu(g) * u` of converted Linears' outputs (the halves of one, or a gate and an up
    projection) keeps no silu(g) for its backward and runs the backward as one kernel
    (ops/swiglu_fusion.py; lean activations have their own). When model is itself an nn.Linear, the
    returned op stands in for it. Converting again with a recipe gives the picked ops.Linear layers that
    recipe (new quantizers: delayed histories and calibrated input scales start over); without one, they
    keep theirs.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert takes an nn.Module, got {type(model).__name__}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a float8.Recipe, got {type(recipe).__name__}")
    owners: dict = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{fqn}.{name}" if fqn else name)
    skipped, swaps, fp8_only = [], [], []
    for fqn, module in model.named_modules():
        if isinstance(module, Linear):
            picked = filter_fn is None or filter_fn(module, fqn)
            if picked and recipe is not None and module._recipe != recipe:
                module.set_recipe(recipe, overwrite=True)  # converted before, with another recipe: this one now
            if fp8_weights and not isinstance(module.weight, Float8Tensor) and picked:
                fp8_only.append((fqn, module))  # converted before: its weight becomes FP8-only now
            continue
        if not isinstance(module, torch.nn.Linear):
            continue
        if filter_fn is not None and not filter_fn(module, fqn):
            continue
        reason = skip_reason(
            module, fp8_weights=fp8_weights, tied_to=", ".join(_shared_with(owners, module, fqn)) or None
        )
        if reason is not None:
            skipped.append(f"{fqn or '<root>'}: {reason}")
        else:
            swaps.append((fqn, module))
    for fqn, op in fp8_only:
        others = _shared_with(owners, op, fqn)
        if others or op.weight.device.type == "meta":
            why = f"shared with {', '.join(others)}" if others else "on the meta device"
            skipped.append(f"{fqn or '<root>'}: fp8_weights=True, but the weight is {why}")
            continue
        op.weight = torch.nn.Parameter(_quantize_frozen(op.weight, op), requires_grad=False)
    if skipped:
        warnings.warn(
            f"float8.ops.convert left {len(skipped)} layer(s) as they were:\n  " + "\n  ".join(skipped),
            ConversionWarning,
            stacklevel=2,
        )
    for fqn, module in swaps:
        op = _float8_linear(module, recipe, fp8_weights)
        if not fqn:
            return op
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, op)
    if not isinstance(model, Linear):
        _attach_activation_hooks(model, fuse_swiglu)
    _share_workspace(model)
    if fp8_weights and any(isinstance(p, Float8Tensor) for p in model.parameters()):
        enable_save_pretrained(model)  # a Hugging Face model's save_pretrained writes the hub FP8 layout
    return model


def _share_workspace(model: torch.nn.Module) -> None:
    """One kept workspace (kernels/scratch.py) for all of the model's Linears: their launches on a stream run
    in turn, so one buffer the size of the largest call serves them all, where one per layer would hold
    the sum (176 MiB against 8 MiB for benchmarks/inference.py's Llama-style model). And one
    SharedInputCopy (ops/linear_train.py) for their training steps: Linears that read the same tensor (q, k
    and v; gate and up) quantize it once and keep one FP8 copy. And one KnownAmaxes (ops/known_amax.py), which
    the SwiGLU fusion fills and the Linears read: the amaxes of the tensors its kernels write."""
    shared, inputs, amaxes = Scratch(), SharedInputCopy(), KnownAmaxes()
    for m in model.modules():
        if isinstance(m, Linear):
            m._inference_plans.share(shared)
            plans = m.__dict__.setdefault("_train_plans", TrainPlans())  # missing: pickled before plans
            plans.inputs, plans.amaxes = inputs, amaxes
    fusion = SwiGLUFusion.of(model)
    if fusion is not None:
        fusion.amaxes = amaxes  # the amaxes its SwiGLU computes go to the Linears that read its outputs


def _attach_activation_hooks(model: torch.nn.Module, fuse_swiglu: bool) -> None:
    """What runs around the converted model's own activation code, one object on the model:
    - a SavedOutputs while any of its Linears has lean activations (it keeps their outputs that the model's
      activation code saves in E4M3: ops/saved_outputs.py), with its own fused SwiGLU;
    - else, with fuse_swiglu, a SwiGLUFusion while it has any converted Linear (ops/swiglu_fusion.py).
    Earlier ones, on the model or its submodules, are removed first."""
    detach_all(model)
    SwiGLUFusion.detach_all(model)
    linears = linears_outside_sequentials(model)  # an ops.Sequential fuses its own activations
    if any(m.recipe.lean_activations for m in linears):
        SavedOutputs().attach(model)
    elif fuse_swiglu and linears:
        SwiGLUFusion().attach(model)


def _shared_with(owners: dict, module: torch.nn.Module, fqn: str) -> list:
    """The other names under which module's weight is a parameter of the model (tied weights)."""
    own = f"{fqn}.weight" if fqn else "weight"
    return [o for o in owners.get(id(module.weight), []) if o != own]


def _float8_linear(linear: torch.nn.Linear, recipe: Optional[Recipe], fp8_weights: bool) -> Linear:
    w = linear.weight
    # Built on the meta device (nothing allocated), then given the old module's Parameter objects.
    op = Linear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        device="meta",
        dtype=w.dtype,
        recipe=recipe,
    )
    op.weight = w
    op.bias = linear.bias
    op._recipe_changed()  # quantizers (delayed-scaling history) on the weight's device
    op.train(linear.training)
    _take_hooks(op, linear)
    if fp8_weights:
        op.weight = torch.nn.Parameter(_quantize_frozen(w, op), requires_grad=False)
    return op


# The hook tables of nn.Module (forward, pre-forward, backward, state-dict hooks), by attribute name.
_HOOK_TABLES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _take_hooks(op: Linear, linear: torch.nn.Linear) -> None:
    """The replaced layer's hooks become the op's: the same tables, so the handles a user holds still
    remove them. (They were dropped silently before.)"""
    for name in _HOOK_TABLES:
        table = getattr(linear, name, None)
        if table is not None:
            object.__setattr__(op, name, table)
    if getattr(linear, "_is_full_backward_hook", None) is not None:
        object.__setattr__(op, "_is_full_backward_hook", linear._is_full_backward_hook)


def _quantize_frozen(w: torch.Tensor, op: Linear) -> Float8Tensor:
    # Current scaling with the recipe's weight layout: a delayed recipe's history describes activations
    # over steps, and a frozen weight is quantized once.
    q = op.weight_quantizer
    if isinstance(op.recipe.weight, DelayedScaling):
        q = quantizer_for(TensorwiseScaling(), op.recipe.format.forward_dtype, device=w.device)
    with torch.no_grad():
        return q.quantize(w.detach())
