"""A Triton launch with less host time: the compiled kernel called directly once its specialization is known.

`kernel[grid](*args)` binds every argument, computes Triton's specialization key and looks the compiled
kernel up on every call: 14.8 us of host time per launch on the H100 machine (torch 2.11, triton 3.6,
.scratch micro-benchmark of 2026-11-25), where the compiled kernel's own launcher takes 5.3 us. Small
layers wait for exactly that host time (a bf16 F.linear costs 22 us there), so the launchers of the
kernels that decode-size calls run (kernels/weight_only.py) go through `FastLauncher`.

Correctness rests on the key: it must tell apart every pair of calls that Triton would compile apart. Triton
specializes a tensor on its dtype and on whether its address is a multiple of 16, an int on whether it is
1, a multiple of 16, or beyond int32, and a constexpr on its value; the key here holds exactly those, plus
the device and the launch options. A key not seen yet goes through `kernel[grid](...)` (Triton compiles or
finds the kernel, and hands it back), which is stored under the key. Under the Triton interpreter, or where
the compiled kernel does not expose its launcher, every call is an ordinary launch.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: no launch hooks to honour here
    _knobs = None
_HookChain = getattr(_knobs, "HookChain", None)  # Triton's default launch hooks: chains, empty unless added to


def _arg_key(a):
    if type(a) is int:  # the commonest argument first (a bool is not one: its type is bool)
        return ("i", a == 1, a % 16 == 0, -(2**31) <= a < 2**31)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("b", a)
    if isinstance(a, int):
        return ("i", a == 1, a % 16 == 0, -(2**31) <= a < 2**31)
    if isinstance(a, float):
        return "f"
    return (type(a), a)  # None and anything else: by value


def _constexpr_positions(kernel) -> frozenset:
    """Positions of the kernel's tl.constexpr parameters (keyed by value)."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return frozenset(i for i, p in enumerate(params) if p.is_constexpr)
    sig = inspect.signature(getattr(kernel, "fn", kernel))  # interpreted: the Python function's annotations
    return frozenset(i for i, p in enumerate(sig.parameters.values()) if "constexpr" in str(p.annotation))


def _parameters(kernel) -> tuple:
    """(names, defaults) of the kernel's parameters in order; a default is inspect.Parameter.empty if none."""
    sig = inspect.signature(getattr(kernel, "fn", kernel))
    return tuple(sig.parameters), tuple(p.default for p in sig.parameters.values())


# Triton compile options a launch may name besides num_warps and num_stages (the norms turn FMA fusion off
# for bits that match their references): passed through, and part of the key.
_COMPILE_OPTIONS = frozenset({"enable_fp_fusion", "num_ctas", "maxnreg"})


def runtime_settings() -> tuple:
    """Triton's runtime settings that change the compiled kernel (its debug mode, instrumentation): part of
    the key, so that turning one on after a first launch compiles anew, as Triton would."""
    if _knobs is None:
        return ()
    return (
        _knobs.runtime.debug,
        getattr(_knobs.compilation, "instrumentation_mode", None),
        getattr(_knobs.compilation, "fpsan_homomorphic_casts", None),
    )


class FastLauncher:
    """Launches one @triton.jit kernel: `launcher(grid, *args, num_warps=4, num_stages=3, **named)`, the
    kernel's parameters positionally in its order and/or by name (constexprs too; a parameter left out takes
    its default), as `kernel[grid](...)` takes them. The first parameter is a tensor; the shortcut is taken
    only when it is on a CUDA device."""

    def __init__(self, kernel):
        self.kernel = kernel
        # The interpreter's InterpretedFunction has no compiled kernels. On ROCm, Triton also specializes a
        # pointer on whether its storage spans under 2 GiB, which this key does not hold: no shortcut there.
        self.interpreted = not hasattr(kernel, "device_caches") or torch.version.hip is not None
        self.constexpr = _constexpr_positions(kernel)
        names, self.defaults = _parameters(kernel)
        # Per parameter: keyed by value (a constexpr) or by `_arg_key`. A list comprehension over this mask
        # takes 3.5 us for a 24-parameter kernel where a generator with a set lookup per argument took 6.2.
        self.by_value = tuple(i in self.constexpr for i in range(len(names)))
        self.index = {name: i for i, name in enumerate(names)}
        self.name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
        self.compiled: dict = {}

    def bind(self, args: tuple, named: dict) -> tuple:
        """Every parameter's value in the kernel's order: args, then `named` by name, then the defaults."""
        if not named and len(args) == len(self.defaults):
            return args
        full = list(args) + [inspect.Parameter.empty] * (len(self.defaults) - len(args))
        for name, value in named.items():
            i = self.index.get(name)
            if i is None or i < len(args):
                what = "no parameter" if i is None else "a positional value for"
                raise TypeError(f"{self.name}: has {what} {name!r}")
            full[i] = value
        for i, value in enumerate(full):
            if value is inspect.Parameter.empty:
                full[i] = self.defaults[i]
                if full[i] is inspect.Parameter.empty:
                    raise TypeError(f"{self.name}: no value for parameter {list(self.index)[i]!r}")
        return tuple(full)

    def _key(self, args, options):
        return tuple([a if value else _arg_key(a) for value, a in zip(self.by_value, args)]) + options

    def __call__(self, grid, *args, num_warps: int = 4, num_stages: int = 3, **named):
        options = {"num_warps": num_warps, "num_stages": num_stages}
        if named:
            options.update((k, named.pop(k)) for k in _COMPILE_OPTIONS & named.keys())
        args = self.bind(args, named)
        if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
            # Traced (the body of a triton_op under torch.compile, fake tensors, make_fx): the launch becomes
            # a node of the graph, which inductor launches with its own code.
            return torch.library.wrap_triton(self.kernel)[grid](*args, **options)
        if self.interpreted:
            return self.kernel[grid](*args, **options)
        first = args[0]
        if not (isinstance(first, torch.Tensor) and first.is_cuda):
            # Not a CUDA launch (a CPU build tracing launches, tests/kernels/sm90_lowering.py): Triton's own path.
            return self.kernel[grid](*args, **options)
        device = first.device.index
        if device != torch._C._cuda_getDevice():
            # Triton launches on the current device's stream, whatever device the tensors are on: it refused
            # such a launch ("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)", torch
            # 2.11 on 2 H100s), or, with peer access on, would run it unordered with the tensors' own stream.
            # The launch goes to their device, whose current stream the torch operations around it use too.
            # A compiled kernel is loaded per device: no shortcut.
            with torch.cuda.device(device):
                return self.kernel[grid](*args, **options)
        if getattr(self.kernel, "pre_run_hooks", None):
            return self.kernel[grid](*args, **options)
        key = (device, self._key(args, (*options.items(), *runtime_settings())))
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **options)
            if shortcut_ready(compiled):
                self.compiled[key] = compiled
            return compiled
        run_compiled(compiled, grid, device, args)
        return compiled

    def launch_and_keep(
        self, grid: tuple[int, ...], *args: Any, num_warps: int = 4, num_stages: int = 3, **named: Any
    ) -> Any | None:
        """Launch as `__call__` does and return the compiled kernel when a later call may run it directly
        with `run_compiled` (CUDA, the current device, no pre-run hooks), else None. For a caller that
        fixes every argument but its activation and output tensors (kernels/weight_only.py PreparedMM)."""
        first = args[0] if args else None
        plain = not (self.interpreted or torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack())
        ready = plain and isinstance(first, torch.Tensor) and first.is_cuda
        ready = (
            ready
            and first.device.index == torch._C._cuda_getDevice()
            and not getattr(self.kernel, "pre_run_hooks", None)
        )
        compiled = self(grid, *args, num_warps=num_warps, num_stages=num_stages, **named)
        return compiled if ready and shortcut_ready(compiled) else None

    def prepare(
        self, grid: tuple, slots: tuple, *args: Any, num_warps: int = 4, num_stages: int = 3, **named: Any
    ) -> "PreparedLaunch | None":
        """Launch as `__call__` does, and return a PreparedLaunch for later launches that differ from this one
        only in the tensors at `slots` (positions among the kernel's parameters; those of this call must be
        16-byte aligned), or None where a later call could not skip the checks (`launch_and_keep`)."""
        compiled = self.launch_and_keep(grid, *args, num_warps=num_warps, num_stages=num_stages, **named)
        if compiled is None:
            return None
        full = self.bind(args, {k: v for k, v in named.items() if k not in _COMPILE_OPTIONS})
        if any(full[i].data_ptr() % 16 for i in slots):
            return None
        return PreparedLaunch(compiled, grid, full[slots[0]].device.index, full, slots)


class PreparedLaunch:
    """One compiled kernel's launch with every argument fixed but the tensors at `slots` (positions among the
    kernel's parameters), which each call passes and which go to the kernel by address (Triton's launcher asks
    the driver about each tensor argument's address; an int it passes as it is). Made by
    `FastLauncher.prepare`. The caller guarantees that each tensor is on the prepared device with the dtype
    (and, where the kernel was given its shape or strides, the shape and strides) of the prepared call: that
    is what Triton's specialization key would otherwise check."""

    __slots__ = ("compiled", "grid", "device", "args", "slots", "settings")

    def __init__(self, compiled: Any, grid: tuple, device: int, args: tuple, slots: tuple):
        self.compiled, self.grid, self.device, self.slots = compiled, grid, device, slots
        # The prepared call's own tensors are not kept (a first input would stay alive with the plan).
        self.args = tuple(0 if i in slots else a for i, a in enumerate(args))
        self.settings = runtime_settings()

    def __call__(self, *tensors: torch.Tensor) -> bool:
        """Launch with `tensors` at the slots, in order; False, and nothing launched, where the prepared launch
        does not fit this call: another current device, Triton's runtime settings changed since, an address
        off a 16-byte boundary (the kernel was compiled for aligned pointers)."""
        device = self.device
        if torch._C._cuda_getDevice() != device or runtime_settings() != self.settings:
            return False
        args = list(self.args)
        for i, t in zip(self.slots, tensors):
            ptr = t.data_ptr()
            if ptr % 16 or not ptr:
                return False
            args[i] = ptr
        run_compiled(self.compiled, self.grid, device, args)
        return True


def on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context for a direct `kernel[grid](...)` launch on t's device: Triton launches on the current
    device's stream, so a tensor of another device (a model spread over GPUs in one process) makes its
    device current for the launch. Nothing to do when it already is, off CUDA, or while tracing (the
    compiled graph sets its devices itself)."""
    # Tracing first: dynamo cannot trace torch._C._cuda_getDevice (a fullgraph compile of the fused
    # cross-entropy head, which reaches here, would break on it), and fake tensors need no device.
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or not t.is_cuda:
        return contextlib.nullcontext()
    if t.get_device() != torch._C._cuda_getDevice():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def shortcut_ready(compiled: object) -> bool:
    """Whether a compiled Triton kernel exposes what `run_compiled` calls."""
    return all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))


def live_hook(hook: Any) -> Any:
    """A Triton launch hook worth calling, or None. Triton's default hooks are empty HookChains, which its
    launcher calls on every launch, after `launch_metadata` has built them a dict: 2 us a launch on a dev
    CPU (triton 3.9: 0.7 us for the dict, 0.4 us per empty chain), for nothing. None skips both (the
    launchers call a hook only when it is not None); a chain with hooks in it is passed as it is."""
    if hook is None or (_HookChain is not None and type(hook) is _HookChain and not hook.calls):
        return None
    return hook  # a chain with hooks in it, or a hook of another kind (older Tritons took functions)


def run_compiled(compiled: Any, grid: tuple[int, ...], device: int, args: tuple) -> None:
    """Launch a compiled kernel on `device`'s current stream, honouring Triton's launch hooks (those that
    hold any: `live_hook`). The caller guarantees that Triton would pick this very compiled kernel for
    `args` (its specialization key)."""
    g0, g1, g2 = (*grid, 1, 1)[:3]
    stream = torch._C._cuda_getCurrentRawStream(device)
    enter = live_hook(_knobs.runtime.launch_enter_hook) if _knobs is not None else None
    exit_ = live_hook(_knobs.runtime.launch_exit_hook) if _knobs is not None else None
    meta = compiled.launch_metadata(grid, stream, *args) if enter is not None or exit_ is not None else None
    compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, meta, enter, exit_, *args)
