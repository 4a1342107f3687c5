"""Lean saved outputs: a converted model's Linear outputs that its activation code saves, kept as E4M3.

A model written in plain torch.nn saves what its own elementwise code needs for backward: in a Llama MLP,
`F.silu(g) * u` keeps the gate and up projections' outputs g and u in bf16 (2 x 448 MiB per block of
16384 tokens x 14336 features), although they are outputs of Linears that `ops.convert` replaced. Under
`Recipe(lean_activations=True)`, `ops.convert` attaches a `SavedOutputs` to the model it converts. During a
training forward of that model, a tensor that `F.silu`, `F.gelu` or a product (`*`, `torch.mul`) saves and
that is (a view of) the output of a lean converted Linear, or of `F.gelu` / `F.silu` of one, is kept as an
E4M3 Float8Tensor (current scaling, one scale per row, one kernel) and widened back when the backward reads
it. The high-precision output is then freed after the forward. Only those functions: their backward reads
the saved tensor elementwise, so E4M3 rounding stays local (ops.SwiGLU under lean activations keeps its
input in E4M3 too). `F.gelu` or `F.silu` of a lean output runs as `_LeanActivation`: torch's forward, the
input kept as the same per-row E4M3 copy, which the backward kernel (float8::act_bwd) reads as it is, so
that no widened bf16 copy exists in the backward (the seed #1119 layer's lean step peak, H100: 6327 ->
5303 MiB, bf16 6198; docs/memory.md). SwiGLU's `F.silu(g) * u` then runs as `_LeanSiluProduct`, whose
backward recomputes silu(g) from g's copy: silu(g) is not kept at all. A norm or attention saves statistics
of its exact input with it, and a rounded input would not match them; they and everything else are saved
as they are.

Saved-tensor hooks turn off autograd's check that a saved tensor was not written in place before the
backward; the check is made here instead, with autograd's message, for every tensor saved as it is. A
compressed copy is made when the tensor is saved, so a later write cannot reach the backward (which reads
the values the function used).

Not applied: under no_grad/inference, when the model is compiled (the compiler decides what a graph saves;
the model's code under a compiled block is left to it too), and inside a `saved_tensors_hooks` context of
the caller (activation offloading, for example), whose hooks keep precedence; likewise inside the model,
within hooks of its own code (activation checkpointing), an activation is not fused. Nor to the outputs of
Linears whose GEMMs run in the activation dtype (ops.high_precision, the small-layer policy): they stay
exact.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from float8 import Float8Tensor, RowwiseScaling
from float8.kernels.activation import act_bwd
from float8.kernels.common import forward_ad_or_functorch_active
from float8.kernels.dequantize import dequantize
from float8.ops.model_hooks import ModelHooks
from float8.ops.sequential import linears_outside_sequentials

__all__ = ["SavedOutputs", "detach_all", "saved_outputs_of"]

# Smaller saved outputs stay as they are: a quantize and a dequantize launch each cost more than they save.
MIN_NUMEL = 1 << 16
# The functions whose saves may be kept in E4M3: their backward reads the saved tensor elementwise.
ELEMENTWISE = frozenset({F.silu, F.gelu, torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__})


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)


class _Packed:
    """What autograd holds instead of a kept output: its E4M3 copy and the dtype to widen it back to."""

    __slots__ = ("fp8", "dtype")

    def __init__(self, fp8: Float8Tensor, dtype: torch.dtype):
        self.fp8, self.dtype = fp8, dtype


class _Saved:
    """A tensor saved as it is, with its version at the save (autograd's own check is off under hooks)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.version = tensor, tensor._version


def _activation_kind(func, args: tuple, kwargs: dict) -> Optional[str]:
    """The act_bwd kind of an `F.gelu` / `F.silu` call on one tensor, out of place; else None."""
    if len(args) != 1:
        return None
    if func is F.silu:
        return "silu" if set(kwargs) <= {"inplace"} and not kwargs.get("inplace", False) else None
    if func is F.gelu and set(kwargs) <= {"approximate"}:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(kwargs.get("approximate", "none"))
    return None


def _refuse_double_backward() -> None:
    """In a backward with create_graph=True (a gradient penalty): refused by name. (once_differentiable would
    refuse only where dy needs a gradient, and let the terms through the saved copies drop without a word:
    a penalty on dL/dh.)"""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "float8 lean activations: F.gelu / F.silu of a lean converted Linear's output (and SwiGLU's product "
            "after it) keep their inputs as E4M3 copies and have no second derivative; a backward with "
            "create_graph=True through them (a gradient penalty) is refused. Convert with "
            "Recipe(lean_activations=False) for that."
        )


class _LeanActivation(torch.autograd.Function):
    """torch's own F.gelu / F.silu forward (its bits), with the input kept for backward as its E4M3 copy
    with one scale per row (as `_pack` keeps a saved output: a loud row does not coarsen the others) that
    the backward kernel reads directly: no widened bf16 copy of the input exists in the backward, which was
    the lean converted seed #1119 layer's peak (docs/memory.md)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, func, kwargs: dict, kind: str) -> torch.Tensor:
        y = func(x, **kwargs)
        saved = Float8Tensor.quantize(x, scaling=RowwiseScaling())  # as `_pack` keeps it: one pass, views read
        ctx.save_for_backward(saved.fp8_data, saved.scale_inv)
        ctx.kind = kind
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        _refuse_double_backward()
        saved_x, x_scale_inv = ctx.saved_tensors
        return act_bwd(dy.contiguous(), saved_x, ctx.kind, None, x_scale_inv), None, None, None


class _LeanSiluProduct(torch.autograd.Function):
    """silu(g) * u (either order), silu(g) straight from `_LeanActivation`: torch's product in the forward
    (its bits). For u's gradient the backward recomputes silu(g) from that function's E4M3 copy of g, so
    silu(g) itself is not kept (448 MiB of bf16 per Llama block of 16384 tokens, or its E4M3 copy); u is
    kept as its per-row E4M3 copy."""

    @staticmethod
    def forward(ctx, x0, x1, func, a_index: int, g8: torch.Tensor, g_scale_inv: torch.Tensor) -> torch.Tensor:
        y = func(x0, x1)
        u8 = Float8Tensor.quantize(x1 if a_index == 0 else x0, scaling=RowwiseScaling())
        ctx.save_for_backward(g8, g_scale_inv, u8.fp8_data, u8.scale_inv)
        ctx.a_index = a_index
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        _refuse_double_backward()
        g8, g_scale_inv, u8, u_scale_inv = ctx.saved_tensors
        # float8::dequantize: one pass straight to dy's dtype (no float32 copy of the whole tensor)
        da = dy * dequantize(u8, u_scale_inv, dy.dtype)  # what the product's backward computes, from u's copy
        du = dy * F.silu(dequantize(g8, g_scale_inv, dy.dtype))
        grads = (da, du) if ctx.a_index == 0 else (du, da)
        return (*grads, None, None, None, None)


_MUL = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__})


class _NoteElementwise(TorchFunctionMode):
    """Marks the calls of ELEMENTWISE functions, during which their saves may be compressed; runs `F.gelu`
    / `F.silu` of a lean Linear output as `_LeanActivation`, and its silu times another lean output as
    `_LeanSiluProduct`."""

    def __init__(self, owner: "SavedOutputs"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Nothing while traced (a compiled block inside the model: the compiler decides what its graph saves;
        # torch 2.11's dynamo also refuses the counter's update inside an autograd.Function it traces).
        if func not in ELEMENTWISE or torch.compiler.is_compiling():
            return func(*args, **(kwargs or {}))
        kind = _activation_kind(func, args, kwargs or {})
        if kind is not None and self.owner._fuses_activation(args[0]):
            x = args[0]
            self.owner._count(x)
            y = _LeanActivation.apply(x, func, kwargs or {}, kind)
            # Its output is a lean output too: a product that does not fuse (`_silu_product`) saves it for
            # its backward in E4M3 (silu(g) for u's gradient, 448 MiB of bf16 per Llama block of 16384 tokens).
            self.owner._note_output(y)
            if kind == "silu":
                self.owner._silu_outputs[id(y)] = (weakref.ref(y), y._version)
            return y
        if func in _MUL and not kwargs:
            fused = self.owner._silu_product(func, args)
            if fused is not None:
                return fused
        self.owner._in_elementwise += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.owner._in_elementwise -= 1


class SavedOutputs(ModelHooks):
    """Keeps the lean converted Linears' outputs that a model's activation code saves in E4M3.

    `attach(model)` registers a forward pre-hook and an always-called forward hook on the model (its
    training forward runs inside a saved-tensor hooks context) and a forward hook on each ops.Linear in it
    that no ops.Sequential runs (its output is noted when its recipe has lean activations); `detach(model)`
    removes them from every module of the model. The state of a forward in progress is not pickled. `last_forward`: how many
    tensors the latest forward kept in E4M3 and the bytes that saved."""

    def __init__(self, min_numel: int = MIN_NUMEL):
        self.min_numel = min_numel
        self._reset()

    def _reset(self) -> None:
        self.last_forward = {"tensors": 0, "bytes_saved": 0}
        self._contexts: list = []  # per model forward in progress: (hooks, mode), or None where not applied
        self._outputs: dict = {}  # storage address -> weakref to the storage of a lean Linear's output
        self._packed: dict = {}  # _key(saved tensor) -> (weakref to it, _Packed): one copy per tensor
        self._silu_outputs: dict = {}  # id -> (weakref, version at creation) of the fused silus' outputs
        self._in_elementwise = 0

    def attach(self, model: torch.nn.Module) -> None:
        """Hooks on `model` (the forward whose saves are kept lean) and on each ops.Linear in it."""
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._exit, always_call=True)
        for m in linears_outside_sequentials(model):
            m.register_forward_hook(self._note)

    # ---- hooks -------------------------------------------------------------------------------------
    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if not self._contexts:
            self.last_forward = {"tensors": 0, "bytes_saved": 0}
        entered = None
        if (
            torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and torch._C._autograd._saved_tensors_hooks_is_enabled()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        ):
            hooks, mode = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), _NoteElementwise(self)
            hooks.__enter__()
            mode.__enter__()
            entered = (hooks, mode)
        self._contexts.append(entered)

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._contexts:
            return
        entered = self._contexts.pop()
        if entered is not None:
            hooks, mode = entered
            mode.__exit__(None, None, None)
            hooks.__exit__(None, None, None)
        if not self._contexts:  # the copies live on in autograd's graph; these tables only served the forward
            self._outputs.clear()
            self._packed.clear()
            self._silu_outputs.clear()
            self._in_elementwise = 0

    def _note(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not self._contexts or self._contexts[-1] is None:
            return
        if (
            isinstance(output, torch.Tensor)
            and output.dim() > 0
            and module.recipe.lean_activations
            # Its GEMMs ran in FP8: E4M3 copies add rounding of the FP8 backward's own size. A Linear run in
            # the activation dtype (ops.high_precision, the small-layer policy) keeps its outputs exact: a
            # copy cost the up projection's weight gradient 17 dB against float64 (CPU review, 2026-11-27).
            and module.runs_in_fp8(output.numel() // max(1, output.shape[-1]), output.device)
        ):
            self._note_output(output)

    def _note_output(self, output: torch.Tensor) -> None:
        """Mark output's storage as a lean output of this forward: the ELEMENTWISE functions' saves of it
        are kept in E4M3."""
        # The storage's Python object lives exactly as long as the storage (views keep it), unlike the
        # output's own, which a view such as chunk may outlive.
        storage = output.untyped_storage()
        self._outputs[storage.data_ptr()] = weakref.ref(storage)

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._compresses(t):
            return _Saved(t)
        key = _key(t)
        hit = self._packed.get(key)
        if hit is not None and hit[0]() is not None:
            return hit[1]
        with torch.no_grad():
            # Per row: one kernel reads a view such as chunk's halves in place (the per-tensor cast wants
            # contiguous memory, and copying the view first doubled the cost of keeping it).
            fp8 = Float8Tensor.quantize(t, scaling=RowwiseScaling())
        packed = _Packed(fp8, t.dtype)
        self._packed[key] = (weakref.ref(t), packed)
        self._count(t)
        return packed

    def _fuses_activation(self, x: Any) -> bool:
        """Whether an activation's input is (a view of) a lean Linear output that `_LeanActivation` keeps:
        a plain 16-bit tensor with at least one dim that needs a gradient."""
        return (
            torch.is_grad_enabled()
            and not forward_ad_or_functorch_active()  # torch's own function differentiates those
            # Our hooks innermost: not inside activation checkpointing (whose recomputation, without this
            # mode, must save what the forward saved) or other hooks of the model's own code.
            and torch._C._autograd._top_saved_tensors_default_hooks(False) == (self._pack, self._unpack)
            and type(x) is torch.Tensor
            and x.requires_grad
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.dim() > 0
            and self._is_lean_output(x)
        )

    def _silu_product(self, func, args: tuple) -> Optional[torch.Tensor]:
        """func(*args) as `_LeanSiluProduct` where one factor is silu(g) straight from `_LeanActivation` of
        this forward (the same tensor object at the same version: not written in place since, under no_grad
        either; a write through `.data`, which moves no version, is not seen, as autograd does not see it)
        and the other a lean output of the same shape and dtype; else None."""
        if len(args) != 2 or args[0] is args[1]:
            return None
        for a_index in (0, 1):
            a, u = args[a_index], args[1 - a_index]
            entry = self._silu_outputs.get(id(a))  # None for nearly every product: nothing more looked at
            if entry is None:
                continue
            node = a.grad_fn
            if (
                entry[0]() is a
                and entry[1] == a._version
                and isinstance(node, _LeanActivation._backward_cls)
                and isinstance(u, torch.Tensor)
                and u.shape == a.shape
                and u.dtype == a.dtype
                and self._fuses_activation(u)
            ):
                g8, g_scale_inv = node.saved_tensors
                self._count(u)
                return _LeanSiluProduct.apply(args[0], args[1], func, a_index, g8, g_scale_inv)
        return None

    def _count(self, t: torch.Tensor) -> None:
        """Note one tensor kept as its per-row E4M3 copy: a byte per element less, a float32 scale per row more."""
        self.last_forward["tensors"] += 1
        self.last_forward["bytes_saved"] += t.numel() * (t.element_size() - 1) - 4 * (t.numel() // t.shape[-1])

    def _compresses(self, t: torch.Tensor) -> bool:
        return self._in_elementwise > 0 and self._is_lean_output(t)

    def _is_lean_output(self, t: torch.Tensor) -> bool:
        """Whether t is (a view of) a lean Linear's output of this forward, large enough to keep in E4M3."""
        if (
            type(t) is not torch.Tensor
            or not t.is_floating_point()
            or t.element_size() < 2
            or t.numel() < self.min_numel
            or 0 in t.stride()  # an expanded view: its copy would be larger than its memory
        ):
            return False
        storage = t.untyped_storage()
        ref = self._outputs.get(storage.data_ptr())
        return ref is not None and ref() is storage  # an output's storage, not a new one at a freed address

    @staticmethod
    def _unpack(p: Any) -> torch.Tensor:
        if isinstance(p, _Packed):
            with torch.no_grad():
                return p.fp8.dequantize(p.dtype)
        if p.tensor._version != p.version:
            t = p.tensor
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
                f"{p.version} instead (checked by float8's lean saved outputs, ops/saved_outputs.py, which "
                "turn autograd's own check off)"
            )
        return p.tensor


def saved_outputs_of(model: torch.nn.Module) -> Optional[SavedOutputs]:
    """The SavedOutputs that `ops.convert` attached to `model`, or None."""
    return SavedOutputs.of(model)


def detach_all(model: torch.nn.Module) -> None:
    """Remove every SavedOutputs attached to `model` or to any module in it."""
    SavedOutputs.detach_all(model)
