"""The SwiGLU of a converted model, fused: `F.silu(g) * u` of Linear outputs, one backward pass, silu(g) not kept.

A Llama MLP written in plain torch.nn computes its activation in one of two ways:

    g, u = self.up(x).chunk(2, dim=-1)            # one gate-and-up projection
    y = F.silu(g) * u
    y = F.silu(self.gate(x)) * self.up(x)         # two projections (Hugging Face's Llama, torchtitan)

Eager torch then saves g, u and silu(g) for the backward (silu(g) is a new (M, F) tensor: 448 MiB of bf16 per
block of 16384 tokens x 14336 features), and its backward runs three or four elementwise passes (over strided
halves, and the chunk's cat, in the first form): about 3 ms a block on the H100 in the first form, the largest
non-GEMM cost of the eager converted step (benchmarks/results/profile_step_converted_eager.txt).

`ops.convert` attaches a `SwiGLUFusion` to the model it converts (not under lean activations, whose own
`_LeanSiluProduct` in ops/saved_outputs.py keeps E4M3 copies instead). During a training forward of that
model, a product (`*`, `torch.mul`) of `F.silu(g)` and u, where g and u are the first and second halves of
the last dim of one ops.Linear output h of at least MIN_NUMEL elements, runs as `_SwiGLUProduct`:
- forward: torch's own product of the same two tensors, or on CUDA the product computed at the silu from h
  read once (kernels/silu_product.py, the same bits; the silu then runs as `_SiluOfHalf`, whose backward is
  torch's silu backward);
- saved: h alone (g and u are views of it: no new memory), so silu(g) is not kept;
- backward: dh (..., 2F) in one pass of kernels/activation.py's act_bwd (float32 math, one rounding of each
  gradient element where torch rounds twice), written whole into h's gradient: no cat.
Where g is one ops.Linear's output whole (of at least MIN_NUMEL elements) and u the output of the next
ops.Linear to run, of g's shape and dtype, taken after the silu (as `F.silu(gate(x)) * up(x)` evaluates), the
product runs as `_SwiGLUPairProduct`: torch's silu and product in the forward (their bits), g and u saved
(which torch's silu and product save too), not silu(g), and one backward pass writing dg and du
(kernels/swiglu_pair.py, act_bwd's math). In a converted model (ops/convert.py gives the fusion the model's
KnownAmaxes, ops/known_amax.py) the product's kernel also computes its amax (kernels/product_amax.py, the
same bits for contiguous factors) and the backward's the amaxes of dg and du, for the Linears that quantize
them next: the down projection's input, the gate's and the up projection's output gradients skip their amax
passes. The one-projection form does the same: its silu computes the product and max|product| ahead (the
kernel on CUDA, torch's own calls elsewhere), its backward max|dh| in the pass that writes dh
(kernels/activation.py act_bwd_with_amax), for the down projection's input and the gate-and-up projection's
output gradient. `up(x) * F.silu(gate(x))`, whose up projection runs first, is not fused.

The calls are seen by a TorchFunctionMode, which costs host time on every torch call it sees; it is on only
from the end of a Linear with a large output to the start of the next Linear or the return of the module that
holds the Linear, whichever comes first (`SwiGLUFusion`), so at small token counts nothing runs through it,
and nothing between two blocks does.

The product's gradient goes to h (or to g and u) directly, past the nodes between them and the two factors.
So it is fused only where those nodes are exactly torch's silu and one chunk, split or slice of h each (not
a custom Function, not a view of a view, not a module's backward hooks, which wrap h), with no tensor hooks
and no retain_grad on g, u or silu(g) when the product is taken, and silu(g) not detached since. Not seen, and not to be used with this fusion (convert
with fuse_swiglu=False): hooks registered on g, u or silu(g) after the product, hooks on their autograd
nodes, gradients asked for at them (`torch.autograd.grad(loss, u)`, `backward(inputs=[u])`), writes through
`.data`. Also checked, else the product runs as torch's: exactly the halves' shape, strides and offsets;
neither h (g) nor silu(g) written in place since the silu (their version counters); same dtypes and shapes; grad
mode on; no forward-mode AD or functorch transform; not compiling (the compiler fuses this itself); when a
window opens, the function modes active are those the forward began with, and those are default devices
only (another mode could change what F.silu or the product compute, and one entered around a Linear would
pop ours); no saved-tensor hooks pushed inside the model since its forward began (activation checkpointing
inside the model recomputes without this mode and must save what the forward saved); not under a
non-reentrant torch.utils.checkpoint around the model (its recompute, with other modes, must save what
the forward saved, in the same order: `_checkpoint_hooks`). Per thread: each
thread's forward has its own state. A recursive call of the model inside its own forward drops the state of
the forward around it (what follows in it is not fused); a forward interrupted by a BaseException such as
KeyboardInterrupt (no module hook runs then) leaves its window on the thread's stack until the model's next
forward, which removes it.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext

from float8.kernels.activation import act_bwd, act_bwd_with_amax
from float8.kernels.common import forward_ad_or_functorch_active
from float8.kernels.product_amax import product_with_amax
from float8.kernels.silu_product import silu_and_product, takes_kernel
from float8.kernels.swiglu_pair import swiglu_pair_bwd
from float8.ops.known_amax import KnownAmaxes
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
        if torch.is_grad_enabled():
            # create_graph=True: aten's silu_backward has no derivative of its own. Torch's own formula for
            # this case, op for op in g's dtype (its infinitely differentiable silu backward), so the
            # gradient and its graph are the bits torch's F.silu gives.
            s = torch.sigmoid(g)
            return ds * s * (1.0 + g * (1.0 - s)), None
        return torch.ops.aten.silu_backward(ds, g), None


class _SwiGLUProduct(torch.autograd.Function):
    """silu(g) * u (either order) in the forward: computed ahead with the silu where `computed` holds it,
    else torch's product; the backward writes the gradient of h = [g | u] whole from h alone.

    amaxes (ops/known_amax.py, or None): the backward computes max|dh| in the pass that writes dh and notes it
    for the Linear that quantizes dh next (the gate-and-up projection's output gradient)."""

    @staticmethod
    def forward(ctx, h, silu_g, u, func, silu_first: bool, computed: list, amaxes):
        ctx.save_for_backward(h)
        ctx.amaxes = amaxes
        if computed:
            return computed.pop()
        return func(silu_g, u) if silu_first else func(u, silu_g)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (h,) = ctx.saved_tensors
        amaxes = ctx.amaxes
        if torch.is_grad_enabled():
            # create_graph=True (a gradient penalty): torch's differentiable formula, not the kernel.
            dh = _swiglu_grad_differentiable(dy, h)
        elif _hands_over(amaxes, dy):
            dh, amax = act_bwd_with_amax(dy.contiguous(), h, "swiglu")
            amaxes.put(dh, amax)
        else:
            dh = act_bwd(dy.contiguous(), h, "swiglu")
        return dh, None, None, None, None, None, None


class _SwiGLUPairProduct(torch.autograd.Function):
    """silu(g) * u (either order) for g and u the outputs of two Linears: torch's product in the forward (its
    bits); saved: g and u, which the silu and the product keep anyway, not silu(g); the backward writes dg and du
    in one pass (kernels/swiglu_pair.py).

    amaxes (ops/known_amax.py, or None): the product is computed with its amax (kernels/product_amax.py: the
    same bits, for contiguous factors) and the backward with dg's and du's, handed to the Linears that
    quantize them next (the down projection's input; the gate's and the up projection's output gradients),
    which then skip their amax passes. `amax_out` receives the product's amax (the caller notes it against
    the product Function.apply returns)."""

    @staticmethod
    def forward(ctx, g, u, silu_g, func, silu_first: bool, amaxes, amax_out: list):
        ctx.save_for_backward(g, u)
        ctx.amaxes = amaxes
        if amaxes is not None and silu_g.is_contiguous() and u.is_contiguous():
            # a * b and b * a are one float32 product rounded once: either order's bits
            product, amax = product_with_amax(silu_g, u)
            amax_out.append(amax)
            return product
        return func(silu_g, u) if silu_first else func(u, silu_g)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        g, u = ctx.saved_tensors
        amaxes = ctx.amaxes
        if torch.is_grad_enabled():  # create_graph=True: torch's differentiable formula, not the kernel
            dg, du = _swiglu_grad_differentiable(dy, torch.cat([g, u], dim=-1)).chunk(2, dim=-1)
        elif _hands_over(amaxes, dy):
            dg, du, amax_g, amax_u = swiglu_pair_bwd(dy, g, u, with_amax=True)
            amaxes.put(dg, amax_g)
            amaxes.put(du, amax_u)
        else:
            dg, du = swiglu_pair_bwd(dy, g, u)
        return dg, du, None, None, None, None, None


def _hands_over(amaxes: Optional[KnownAmaxes], dy: torch.Tensor) -> bool:
    """Whether a fused backward computes its gradients' amaxes for the Linears after it: a converted model's
    table, and a plain dy (under vmap or `is_grads_batched` dy is batched: one amax would mix the samples)."""
    return amaxes is not None and torch._C._has_storage(dy) and not forward_ad_or_functorch_active()


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
        if func in _MUL and not kwargs and len(args) == 2 and self.owner._local.silus and self._may_fuse():
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
_OFF = object()  # a model forward where nothing is fused (no grad, or under a non-reentrant checkpoint)


def _checkpoint_hooks(hooks: Any) -> bool:
    """Whether the saved-tensor hooks on top are those of torch.utils.checkpoint's non-reentrant checkpoint,
    in its forward or in its recompute. Its recompute runs the model again in the backward, with other
    function modes (none), and hands the tensors it saves to the forward's nodes by their order: a product
    fused in one and not in the other would hand the product's node g where it expects silu(g) (same count,
    shapes and dtypes, so unseen), and a product fused in neither would not. So neither fuses."""
    pack = hooks[0] if hooks else None
    return getattr(pack, "__qualname__", "").startswith(("_checkpoint_hook.", "_recomputation_hook."))


# The autograd nodes of one chunk, split or slice: their gradient is the input's, zero elsewhere.
_VIEW_NODES = frozenset({"SplitBackward0", "SplitWithSizesBackward0", "SliceBackward0"})


class _SiluNote:
    """A silu of a noted output's first half, or of a noted output whole (`pair`), as taken: the tensors and
    their versions then, and the product computed with it (kernels/silu_product.py), until a product takes it
    or the window closes. Weak references, but for a pair's g, which the product may take after the window of
    g's Linear has closed (the next Linear, the up projection, runs between)."""

    __slots__ = ("out", "out_version", "h", "h_version", "g", "product", "amax", "pair", "held", "closes_left")

    def __init__(
        self,
        out: torch.Tensor,
        h: torch.Tensor,
        g: torch.Tensor,
        product: Optional[torch.Tensor],
        pair: bool,
        amax: Optional[torch.Tensor] = None,
    ):
        self.out, self.out_version = weakref.ref(out), out._version
        self.h, self.h_version = weakref.ref(h), h._version
        self.g, self.product = weakref.ref(g), product
        self.amax = amax  # max|product|, where the kernel computed it (for the converted model's KnownAmaxes)
        self.pair = pair
        # A pair's g, held until its product fuses or the window after the next Linear's output closes (the
        # silu's node saves g too, but saved-tensor hooks that offload or drop it must be able to free it).
        self.held = g if pair else None
        self.closes_left = 1  # a pair's note outlives the close of g's own window, not the next one


class _State(threading.local):
    """One thread's forward in progress."""

    def __init__(self):
        # per model forward in progress: (the saved-tensor hooks at its start, the modes a window may open over, or
        # None), or _OFF (no grad)
        self.contexts: list = []
        self.window: Optional[_FuseSwiGLU] = None  # the mode, while a window is open
        self.outputs: dict = {}  # id(grad_fn of a Linear output) -> (that grad_fn, the output), while a window is open
        self.silus: dict = {}  # id(silu output) -> its _SiluNote

    def clear(self) -> None:
        self.contexts.clear()
        self.outputs.clear()
        self.silus.clear()


class SwiGLUFusion(ModelHooks):
    """Fuses a converted model's own SwiGLU (see the module docstring).

    `attach(model)` registers a forward pre-hook and an always-called forward hook on the model, and a
    forward pre-hook and a forward hook on each ops.Linear in it that no ops.Sequential runs. `_FuseSwiGLU`
    is on only in windows: from the end of a Linear whose output has at least `min_numel` elements (when the
    only other TorchFunctionModes are the default devices the forward began with) to the start of the next
    Linear, the return of a module holding a Linear (an always-called forward hook on each), or the end of the
    model's forward. The code between (a Llama MLP's chunk, silu and product, or
    the silu of a gate projection and the product after the up projection) is what it sees: the Linears' own
    Python, and the model's code after small outputs, run without it. `detach(model)` removes
    the hooks. `last_forward["fused"]`: how many products the latest eager forward fused."""

    def __init__(self, min_numel: int = MIN_NUMEL):
        self.min_numel = min_numel
        # The converted model's KnownAmaxes (ops/convert.py sets it; None: no amax handed over)
        self.amaxes: Optional[KnownAmaxes] = None
        self._reset()

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "amaxes": self.amaxes}  # one KnownAmaxes with the Linears' (memo)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.amaxes = state.get("amaxes")

    def _reset(self) -> None:
        self.last_forward = {"fused": 0}
        self._local = _State()  # this thread's forward in progress

    def attach(self, model: torch.nn.Module) -> None:
        """Hooks on `model` (the forward whose SwiGLU is fused) and on its ops.Linear modules."""
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._exit, always_call=True)
        linears = linears_outside_sequentials(model)
        for m in linears:
            m.register_forward_pre_hook(self._close_window)
            m.register_forward_hook(self._open_window)
        # A window also closes when the module that holds the Linear returns (`_close_window_at_return`).
        ids = {id(m) for m in linears}
        for parent in model.modules():
            if parent is not model and any(id(c) in ids for c in parent.children()):
                parent.register_forward_hook(self._close_window_at_return, always_call=True)

    # ---- hooks (none does anything while compiled: the compiler fuses the code itself) ---------------
    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        state = self._local
        if state.contexts:  # a recursive call, or a forward a BaseException interrupted: start over
            self._remove_window(state)
            state.clear()
        self.last_forward = {"fused": 0}
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if not torch.is_grad_enabled() or _checkpoint_hooks(hooks):
            state.contexts.append(_OFF)
            return
        # The modes active now may stay under a window only where they change no silu or product (a default
        # device: torch.set_default_device, `with torch.device(...)`); any other keeps every window shut.
        modes = tuple(torch.overrides._get_current_function_mode_stack())
        open_over = modes if all(type(m) is DeviceContext for m in modes) else None
        state.contexts.append((hooks, open_over))

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        state = self._local
        if state.contexts:
            self._remove_window(state)
            state.clear()

    def _open_window(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        state = self._local
        if not state.contexts or state.contexts[-1] is _OFF:
            return
        if not (
            type(output) is torch.Tensor
            and output.requires_grad
            and output.grad_fn is not None
            and output.dtype in _DTYPES
            and output.dim() > 0
            and output.numel() >= self.min_numel
        ):
            return
        if state.window is None:
            hooks, open_over = state.contexts[-1]
            # Only over the modes the forward began with (and those only default devices): a mode entered
            # since, around a Linear, would pop ours when it exits; another kind could change what F.silu or
            # the product compute.
            if open_over is None or tuple(torch.overrides._get_current_function_mode_stack()) != open_over:
                return
            state.window = _FuseSwiGLU(self, hooks)
            state.window.__enter__()
        # The output and its node are kept while the window is open: a C++ node's Python wrapper is made anew
        # once the last one is dropped, so its id alone would not find it again (on the H100, F.linear's
        # MmBackward0 under the small-layer policy was not found and nothing fused), and an output that is a
        # view nobody names (F.linear with a bias of a 3-D input) would be gone by the chunk.
        node = output.grad_fn
        state.outputs[id(node)] = (node, output)

    def _close_window(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        state = self._local
        # Only from the top of the stack: a mode the model's code entered since stays above ours, and ours
        # under it, until that mode exits or the forward ends.
        if state.window is not None and torch.overrides._get_current_function_mode() is state.window:
            state.window.__exit__(None, None, None)
            state.window = None
            state.outputs.clear()  # what the window kept: the outputs are the model's own from here
            for key, note in list(state.silus.items()):
                note.product = note.amax = None  # a product computed ahead that no product asked for: not kept
                if note.pair:
                    if note.closes_left == 0:  # its product would have come in the window closing now
                        del state.silus[key]
                    note.closes_left -= 1

    def _close_window_at_return(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        # The module that holds a Linear (a Llama MLP, a transformer block) returns: its SwiGLU, which reads
        # the Linear's output inside that module's forward, has been seen. Without this a window after the
        # block's last Linear stayed open into the next block: under FSDP2 across its hooks (the next
        # block's all-gather: about 300 torch calls per block through the mode in the eager step of
        # benchmarks/distributed.py's model, 2421 a step), while the eager forward waited on the host.
        self._close_window(module, args)

    @staticmethod
    def _remove_window(state: _State) -> None:
        """The mode off the stack, wherever it is (modes above it, which the model's code entered and did not
        leave, are put back in their order)."""
        window, state.window = state.window, None
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
    @staticmethod
    def _unhooked(*tensors: torch.Tensor) -> bool:
        """No tensor hook and no retain_grad on any of them (their gradients must exist, one by one)."""
        return all(not t._backward_hooks and not t.retains_grad for t in tensors)

    def _output_of(self, half: Any) -> Optional[torch.Tensor]:
        """The noted Linear output that `half` was cut from by one chunk, split or slice, or None."""
        if type(half) is not torch.Tensor or not half.requires_grad or not self._unhooked(half):
            return None
        node = half.grad_fn
        if node is None or type(node).__name__ not in _VIEW_NODES:
            return None
        source = node.next_functions[0][0]
        noted = self._local.outputs.get(id(source))
        h = None if noted is None or noted[0] is not source else noted[1]
        if h is None or h.grad_fn is not source or not h.is_contiguous() or half.dtype != h.dtype:
            return None
        return h

    def _noted(self, t: Any) -> bool:
        """Whether t is itself a Linear output noted in the open window (its hooks and retain_grad do not
        matter: a pair's g and u are the fused product's own inputs, so autograd gives them their gradients)."""
        if type(t) is not torch.Tensor or not t.requires_grad or t.grad_fn is None:
            return False
        noted = self._local.outputs.get(id(t.grad_fn))
        return noted is not None and noted[0] is t.grad_fn and noted[1] is t

    @staticmethod
    def _whole(h: torch.Tensor, half: torch.Tensor, second: bool) -> Optional[torch.Tensor]:
        """h, or a view of it, shaped as half with a doubled last dim, when half is exactly its first (or second)
        half along that dim; else None."""
        if half.dim() == 0:
            return None
        n = half.shape[-1]
        if h.numel() != 2 * half.numel() or n == 0:
            return None
        shape = (*half.shape[:-1], 2 * n)
        whole = h if tuple(h.shape) == shape else h.view(shape)
        if half.stride() != whole.stride() or half.storage_offset() != whole.storage_offset() + (n if second else 0):
            return None
        return whole

    def _silu(self, g: Any, func) -> torch.Tensor:
        """F.silu(g), noted where g is the first half of a noted output. On CUDA the product with the other
        half is computed with it, in one kernel, and kept for `_product` (until the window closes)."""
        h = self._output_of(g)
        whole = None if h is None else self._whole(h, g, second=False)
        if whole is None:
            if not self._noted(g):
                return func(g)
            out = func(g)  # a gate projection's output whole: its product comes after the up projection's
            self._local.silus[id(out)] = _SiluNote(out, g, g, None, pair=True)
            return out
        product = amax = None
        if self._computes_ahead(whole):
            with torch.no_grad():
                if self.amaxes is not None:
                    s, product, amax = silu_and_product(whole, with_amax=True)
                else:
                    s, product = silu_and_product(whole)
            out = _SiluOfHalf.apply(g, [s])
        else:
            out = func(g)
        self._local.silus[id(out)] = _SiluNote(out, h, g, product, pair=False, amax=amax)
        return out

    def _computes_ahead(self, whole: torch.Tensor) -> bool:
        """Whether the silu of whole's first half computes the product with it: with the kernel (CUDA), or,
        where the converted model's Linears take the product's amax (ops/known_amax.py), with torch's own
        silu and product and their amax (the CPU, a dispatch mode): the same bits either way."""
        return takes_kernel(whole) or self.amaxes is not None

    def _product(self, func, args: tuple) -> Optional[torch.Tensor]:
        """func(*args) as `_SwiGLUProduct` where one factor is a noted silu(g) and the other g's second half;
        else None."""
        silus = self._local.silus
        for silu_first in (True, False):
            a, u = args if silu_first else args[::-1]
            note = silus.get(id(a))  # None for nearly every product: nothing more looked at
            if note is None or note.out() is not a or note.out_version != a._version or not self._unhooked(a):
                continue
            if not a.requires_grad or a.grad_fn is None:  # detach_() since the silu: no gradient through it
                continue
            if note.pair:
                fused = self._pair_product(note, a, u, func, silu_first)
                if fused is not None:
                    return fused
                continue
            h, g = note.h(), note.g()
            if (
                h is None
                or (g is not None and not self._unhooked(g))  # a hook on g since the silu
                or h._version != note.h_version
                or self._output_of(u) is not h
                or u.shape != a.shape
                or u.dtype != a.dtype
            ):
                continue
            whole = self._whole(h, u, second=True)
            if whole is None:
                continue
            self.last_forward["fused"] += 1
            computed = [] if note.product is None else [note.product]
            amax = note.amax
            note.product = note.amax = None  # handed out once: a second product is a new tensor
            out = _SwiGLUProduct.apply(whole, a.detach(), u.detach(), func, silu_first, computed, self.amaxes)
            if computed == [] and amax is not None:  # the product computed ahead is the one returned
                self.amaxes.put(out, amax)
            return out
        return None

    def _pair_product(self, note: _SiluNote, a: torch.Tensor, u: Any, func, silu_first: bool) -> Optional[torch.Tensor]:
        """func(a, u) as `_SwiGLUPairProduct` where a = silu(g) of a gate output g (a pair's note) and u is the
        output of the Linear whose window is open, of g's shape and dtype; else None."""
        g = note.held if note.held is not None else note.g()  # after a first fused product: weakly
        if (
            g is None
            or g._version != note.h_version
            or u is g
            or not self._noted(u)
            or u.shape != g.shape
            or u.dtype != g.dtype
            or a.shape != g.shape
        ):
            return None
        self.last_forward["fused"] += 1
        note.held = None
        amax_out = []
        out = _SwiGLUPairProduct.apply(g, u, a.detach(), func, silu_first, self.amaxes, amax_out)
        if amax_out:
            self.amaxes.put(out, amax_out[0])
        return out


def swiglu_fusion_of(model: torch.nn.Module) -> Optional[SwiGLUFusion]:
    """The SwiGLUFusion that `ops.convert` attached to `model`, or None."""
    return SwiGLUFusion.of(model)
