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
the last dim of one ops.Linear output h of at least MIN_NUMEL elements, runs as `_SwiGLUProduct`:
- forward: torch's own product of the same two tensors (the same bits as the unconverted model);
- saved: h alone (g and u are views of it: no new memory), so silu(g) is not kept;
- backward: dh (..., 2F) in one pass of kernels/activation.py's act_bwd (float32 math, one rounding of each
  gradient element where torch rounds twice), written whole: no cat.

The calls are seen by a TorchFunctionMode, which costs host time on every torch call it sees; it is on only
from the end of a Linear with a large output to the start of the next Linear (`SwiGLUFusion`), so at small
token counts nothing runs through it.

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
from float8.kernels.silu_product import silu_and_product, takes_kernel
from float8.ops.model_hooks import ModelHooks
from float8.ops.sequential import linears_outside_sequentials

__all__ = ["SwiGLUFusion", "swiglu_fusion_of"]

_MUL = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__})
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class _SiluOfHalf(torch.autograd.Function):
    """F.silu(g) whose value was computed ahead (kernels/silu_product.py, with the product); torch's silu
    backward."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, computed: list) -> torch.Tensor:
        ctx.save_for_backward(g)
        return computed.pop()

    @staticmethod
    def backward(ctx, ds: torch.Tensor):
        (g,) = ctx.saved_tensors
        return torch.ops.aten.silu_backward(ds, g), None


class _SwiGLUProduct(torch.autograd.Function):
    """silu(g) * u (either order) in the forward: computed ahead with the silu where `computed` holds it,
    else torch's product; the backward writes the gradient of h = [g | u] whole from h alone."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, silu_g: torch.Tensor, u: torch.Tensor, func, silu_first: bool, computed: list):
        ctx.save_for_backward(h)
        if computed:
            return computed.pop()
        return func(silu_g, u) if silu_first else func(u, silu_g)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (h,) = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph=True (a gradient penalty): torch's differentiable formula, not the kernel.
            dh = _swiglu_grad_differentiable(dy, h)
        else:
            dh = act_bwd(dy.contiguous(), h, "swiglu")
        return dh, None, None, None, None, None


def _swiglu_grad_differentiable(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """d(silu(g) * u)/dh for h = [g | u], in float32, from torch ops (so a second derivative exists)."""
    g, u = h.float().chunk(2, dim=-1)
    s = torch.sigmoid(g)
    dy = dy.float()
    return torch.cat([dy * u * s * (1 + g * (1 - s)), dy * g * s], dim=-1).to(h.dtype)


class _FuseSwiGLU(TorchFunctionMode):
    """Notes `F.silu` of a Linear output's first half and runs its product with the second half fused."""

    def __init__(self, owner: "SwiGLUFusion", hooks_at_enter: Any):
        # hooks_at_enter: the saved-tensor hooks when the model's forward began
        super().__init__()
        self.owner = owner
        self.hooks_at_enter = hooks_at_enter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.silu:
            if self._may_fuse() and len(args) == 1 and not kwargs.get("inplace", False) and set(kwargs) <= {"inplace"}:
                return self.owner._silu(args[0], func)
            return func(*args, **kwargs)
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


# A Linear output smaller than this opens no window (below). At 1024 tokens a step of 8 converted Llama blocks
# with the mode on for the whole forward took 66.3-66.5 ms against 57.2-60.9 unfused (h: 29M elements), at
# 16384 tokens 258.1 against 273.5 (h: 470M elements; H100, 2026-11-27, area step_llama_swiglu): the mode's
# host time per torch call is paid by every call it sees, the backward pass saved scales with h.
MIN_NUMEL = 1 << 24
_OFF = object()  # a model forward where nothing is fused (no grad)


class SwiGLUFusion(ModelHooks):
    """Fuses a converted model's own SwiGLU (see the module docstring).

    `attach(model)` registers a forward pre-hook and an always-called forward hook on the model, and a
    forward pre-hook and a forward hook on each ops.Linear in it that no ops.Sequential runs. `_FuseSwiGLU`
    is on only in windows: from the end of a Linear whose output has at least `min_numel` elements and an
    even last dim to the start of the next Linear (or the end of the model's forward). The code between
    (a Llama MLP's chunk, silu and product) is what it sees: the Linears' own Python, and the model's code
    after small outputs, run without it. `detach(model)` removes the hooks. `last_forward["fused"]`: how many
    products the latest eager forward fused."""

    def __init__(self, min_numel: int = MIN_NUMEL):
        self.min_numel = min_numel
        self._reset()

    def _reset(self) -> None:
        self.last_forward = {"fused": 0}
        self._contexts: list = []  # per model forward in progress: the saved-tensor hooks at its start, or _OFF
        self._window: Optional[_FuseSwiGLU] = None  # the mode, while a window is open
        self._outputs: dict = {}  # id(root tensor) -> weakref to it: the Linear outputs of this forward
        self._silus: dict = {}  # id(silu output) -> (weakref to it, its version, weakref to h's root, its version)

    def attach(self, model: torch.nn.Module) -> None:
        """Hooks on `model` (the forward whose SwiGLU is fused) and on its ops.Linear modules."""
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._exit, always_call=True)
        for m in linears_outside_sequentials(model):
            m.register_forward_pre_hook(self._close_window)
            m.register_forward_hook(self._open_window)

    # ---- hooks (none does anything while compiled: the compiler fuses the code itself) ---------------
    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        if not self._contexts:
            self.last_forward = {"fused": 0}
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False) if torch.is_grad_enabled() else _OFF
        self._contexts.append(hooks)

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not self._contexts:
            return
        self._contexts.pop()
        if not self._contexts:
            self._remove_window()
            self._outputs.clear()
            self._silus.clear()

    def _open_window(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not self._contexts or self._contexts[-1] is _OFF:
            return
        if (
            type(output) is torch.Tensor
            and output.requires_grad
            and output.dtype in _DTYPES
            and output.dim() > 0
            and output.shape[-1] % 2 == 0
            and output.numel() >= self.min_numel
        ):
            root = output if output._base is None else output._base
            self._outputs[id(root)] = weakref.ref(root)
            if self._window is None:
                self._window = _FuseSwiGLU(self, self._contexts[-1])
                self._window.__enter__()

    def _close_window(self, module: torch.nn.Module, args: Any) -> None:
        # Only from the top of the stack: a mode the model's code entered since stays where it is (and ours
        # under it, until the forward ends).
        if self._window is not None and torch.overrides._get_current_function_mode() is self._window:
            self._window.__exit__(None, None, None)
            self._window = None
            for entry in self._silus.values():
                entry[4] = None  # a product computed ahead that no product asked for: not kept

    def _remove_window(self) -> None:
        """At the end of the model's forward: the mode off the stack, wherever it is (modes above it, which
        the model's code entered and did not leave, are put back in their order)."""
        window, self._window = self._window, None
        if window is None:
            return
        above = []
        while torch.overrides._get_current_function_mode() not in (window, None):
            above.append(torch.overrides._pop_mode())
        if torch.overrides._get_current_function_mode() is window:
            torch.overrides._pop_mode()
        for mode in reversed(above):
            torch.overrides._push_mode(mode)

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

    def _silu(self, g: Any, func) -> torch.Tensor:
        """F.silu(g), noted where g is the first half of a noted output. On CUDA the product with the other
        half is computed with it, in one kernel, and kept for `_product` (until the window closes)."""
        root = self._root_of(g)
        h = None if root is None else self._whole(root, g, second=False)
        if h is None:
            return func(g)
        product = None
        if takes_kernel(h):
            with torch.no_grad():
                s, product = silu_and_product(h)
            out = _SiluOfHalf.apply(g, [s])
        else:
            out = func(g)
        self._silus[id(out)] = [weakref.ref(out), out._version, weakref.ref(root), root._version, product]
        return out

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
            computed = [] if entry[4] is None else [entry[4]]
            entry[4] = None  # handed out once: a second product is a new tensor
            return _SwiGLUProduct.apply(h, a.detach(), u.detach(), func, silu_first, computed)
        return None


def swiglu_fusion_of(model: torch.nn.Module) -> Optional[SwiGLUFusion]:
    """The SwiGLUFusion that `ops.convert` attached to `model`, or None."""
    return SwiGLUFusion.of(model)
