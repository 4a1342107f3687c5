"""The SwiGLU of a converted model, fused: `F.silu(g) * u` over the halves of a Linear's output, one backward pass.

A Llama MLP written in plain torch.nn computes its activation as

    g, u = self.up(x).chunk(2, dim=-1)
    y = F.silu(g) * u

Eager torch then saves g, u and silu(g) for the backward (silu(g) is a new (M, F) tensor: 448 MiB of bf16 per
block of 16384 tokens x 14336 features), and its backward runs four elementwise passes, three of them over
strided halves, and the chunk's cat: about 3 ms a block on the H100, the largest non-GEMM cost of the eager
converted step (benchmarks/results/profile_step_converted_eager.txt).

`ops.convert` attaches a `SwiGLUFusion` to the model it converts (not under lean activations, whose own
`_LeanSiluProduct` in ops/saved_outputs.py keeps E4M3 copies instead). During a training forward of that
model, a product (`*`, `torch.mul`) of `F.silu(g)` and u, where g and u are the first and second halves of
the last dim of one ops.Linear output h, runs as `_SwiGLUProduct`:
- forward: torch's own product of the same two tensors (the same bits as the unconverted model);
- saved: h alone (g and u are views of it: no new memory), so silu(g) is not kept;
- backward: dh (..., 2F) in one pass of kernels/activation.py's act_bwd (float32 math, one rounding of each
  gradient element where torch rounds twice), written whole: no cat.

The silu's own output and autograd node are left as they are: if the model uses silu(g) elsewhere too, that
use's gradient still flows through torch's silu backward, and the two add up in h's gradient as before.

Checked before fusing, else the product runs as torch's: g and u are differentiable views of the same
Linear output, with exactly the halves' shape, strides and offsets; neither h nor silu(g) was written in
place since the silu (their version counters); same dtypes and shapes (no broadcasting); grad mode on; no
forward-mode AD or functorch transform; not compiling (the compiler fuses this itself); no saved-tensor hooks
pushed inside the model since its forward began (activation checkpointing inside the model recomputes
without this mode and must save what the forward saved).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from float8.kernels.activation import act_bwd
from float8.kernels.common import forward_ad_or_functorch_active
from float8.ops.sequential import linears_outside_sequentials

__all__ = ["SwiGLUFusion", "swiglu_fusion_of"]

_MUL = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__})
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class _SwiGLUProduct(torch.autograd.Function):
    """silu(g) * u (either order) in the forward, from torch's silu output and torch's product; the backward
    writes the gradient of h = [g | u] whole from h alone."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, silu_g: torch.Tensor, u: torch.Tensor, func, silu_first: bool) -> torch.Tensor:
        ctx.save_for_backward(h)
        return func(silu_g, u) if silu_first else func(u, silu_g)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (h,) = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (a gradient penalty): torch's differentiable formula, not the kernel.
            dh = _swiglu_grad_differentiable(dy, h)
        else:
            dh = act_bwd(dy.contiguous(), h, "swiglu")
        return dh, None, None, None, None


def _swiglu_grad_differentiable(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """d(silu(g) * u)/dh for h = [g | u], in float32, from torch ops (so a second derivative exists)."""
    g, u = h.float().chunk(2, dim=-1)
    s = torch.sigmoid(g)
    dy = dy.float()
    return torch.cat([dy * u * s * (1 + g * (1 - s)), dy * g * s], dim=-1).to(h.dtype)


class _FuseSwiGLU(TorchFunctionMode):
    """Notes `F.silu` of a Linear output's first half and runs its product with the second half fused."""

    def __init__(self, owner: "SwiGLUFusion", hooks_at_enter: Any):
        super().__init__()
        self.owner = owner
        self.hooks_at_enter = hooks_at_enter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.silu:
            out = func(*args, **kwargs)
            if self._may_fuse() and len(args) == 1 and not kwargs.get("inplace", False) and set(kwargs) <= {"inplace"}:
                self.owner._note_silu(args[0], out)
            return out
        if func in _MUL and not kwargs and len(args) == 2 and self.owner._silus and self._may_fuse():
            fused = self.owner._product(func, args)
            if fused is not None:
                return fused
        return func(*args, **kwargs)

    def _may_fuse(self) -> bool:
        return (
            torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and not forward_ad_or_functorch_active()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) == self.hooks_at_enter
        )


class SwiGLUFusion:
    """Fuses a converted model's own SwiGLU (see the module docstring).

    `attach(model)` registers a forward pre-hook and an always-called forward hook on the model (its training
    forward runs under `_FuseSwiGLU`) and hooks on each ops.Linear in it that no ops.Sequential runs (its
    output is noted; the mode steps aside while it runs);
    `detach(model)` removes them. `last_forward["fused"]`: how many products the latest forward fused."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.last_forward = {"fused": 0}
        self._modes: list = []  # per model forward in progress: the entered mode, or None where not applied
        self._asides: list = []  # per ops.Linear forward in progress: the mode taken off the stack, or None
        self._outputs: dict = {}  # id(root tensor) -> weakref to it: the Linear outputs of this forward
        self._silus: dict = {}  # id(silu output) -> (weakref to it, its version, weakref to h's root, its version)

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._reset()

    def attach(self, model: torch.nn.Module) -> None:
        """Hooks on `model` (the forward whose SwiGLU is fused) and on each ops.Linear in it."""
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._exit, always_call=True)
        for m in linears_outside_sequentials(model):
            m.register_forward_pre_hook(self._step_aside)
            m.register_forward_hook(self._step_back, always_call=True)
            m.register_forward_hook(self._note)

    def detach(self, model: torch.nn.Module) -> None:
        """Remove this object's hooks from every module of `model`."""
        for m in model.modules():
            for table in (m._forward_pre_hooks, m._forward_hooks):
                for hook_id in [k for k, h in table.items() if getattr(h, "__self__", None) is self]:
                    del table[hook_id]
                    m._forward_hooks_always_called.pop(hook_id, None)

    # ---- hooks -------------------------------------------------------------------------------------
    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if not self._modes:
            self.last_forward = {"fused": 0}
        mode = None
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            mode = _FuseSwiGLU(self, torch._C._autograd._top_saved_tensors_default_hooks(False))
            mode.__enter__()
        self._modes.append(mode)

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._modes:
            return
        mode = self._modes.pop()
        if mode is not None:
            mode.__exit__(None, None, None)
        if not self._modes:
            self._outputs.clear()
            self._silus.clear()
            self._asides.clear()

    def _step_aside(self, module: torch.nn.Module, args: Any) -> None:
        """Take the mode off the torch-function stack while an ops.Linear runs, when it is on top: the
        Linear's own Python makes a hundred torch calls and tensor attribute reads, each of which would
        pass through the mode. (With the mode on throughout, a whole AdamW step of 8 converted Llama blocks
        at 128 tokens took 64.0 ms against 49.7 unfused, H100, 2026-11-27.)"""
        mode = self._modes[-1] if self._modes and not torch.compiler.is_compiling() else None
        if mode is not None and torch.overrides._get_current_function_mode() is mode:
            torch.overrides._pop_mode()
        else:
            mode = None
        self._asides.append(mode)

    def _step_back(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._asides:
            mode = self._asides.pop()
            if mode is not None:
                torch.overrides._push_mode(mode)

    def _note(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._modes or self._modes[-1] is None or torch.compiler.is_compiling():
            return
        if type(output) is torch.Tensor and output.requires_grad and output.dtype in _DTYPES and output.dim() > 0:
            root = output if output._base is None else output._base
            self._outputs[id(root)] = weakref.ref(root)

    # ---- the pattern -------------------------------------------------------------------------------
    def _root_of(self, half: Any) -> Optional[torch.Tensor]:
        """The noted Linear output (its root tensor) that `half` is a differentiable view of, or None."""
        if type(half) is not torch.Tensor or not half.requires_grad or half._base is None:
            return None
        root = half._base
        ref = self._outputs.get(id(root))
        if ref is None or ref() is not root or not root.is_contiguous() or half.dtype != root.dtype:
            return None
        return root

    @staticmethod
    def _whole(root: torch.Tensor, half: torch.Tensor, second: bool) -> Optional[torch.Tensor]:
        """root viewed as half's shape with a doubled last dim, when half is exactly its first (or second)
        half along that dim; else None."""
        if half.dim() == 0:
            return None
        n = half.shape[-1]
        if root.numel() != 2 * half.numel() or root.shape[-1] % 2 or n == 0:
            return None
        h = root.view(*half.shape[:-1], 2 * n)
        if half.stride() != h.stride() or half.storage_offset() != h.storage_offset() + (n if second else 0):
            return None
        return h

    def _note_silu(self, g: Any, out: torch.Tensor) -> None:
        root = self._root_of(g)
        if root is None or self._whole(root, g, second=False) is None or type(out) is not torch.Tensor:
            return
        self._silus[id(out)] = (weakref.ref(out), out._version, weakref.ref(root), root._version)

    def _product(self, func, args: tuple) -> Optional[torch.Tensor]:
        """func(*args) as `_SwiGLUProduct` where one factor is a noted silu(g) and the other g's second half;
        else None."""
        for silu_first in (True, False):
            a, u = args if silu_first else args[::-1]
            entry = self._silus.get(id(a))  # None for nearly every product: nothing more looked at
            if entry is None or entry[0]() is not a or entry[1] != a._version:
                continue
            root = entry[2]()
            if (
                root is None
                or root._version != entry[3]
                or self._root_of(u) is not root
                or u.shape != a.shape
                or u.dtype != a.dtype
            ):
                continue
            h = self._whole(root, u, second=True)
            if h is None:
                continue
            self.last_forward["fused"] += 1
            return _SwiGLUProduct.apply(h, a.detach(), u.detach(), func, silu_first)
        return None


def swiglu_fusion_of(model: torch.nn.Module) -> Optional[SwiGLUFusion]:
    """The SwiGLUFusion that `ops.convert` attached to `model`, or None."""
    for hook in model._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, SwiGLUFusion):
            return owner
    return None
