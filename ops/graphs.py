"""CUDA graphs for inference forwards: `graphed_inference(model)` gives a callable that captures the model's
forward once per input signature and replays it, with tens of microseconds of host time per call.

Why: a decode-size forward is host-bound. torch.compile(mode="reduce-overhead") replays a graph too, but
first runs dynamo's guards, which for an FP8 model check every Float8Tensor parameter (0.21 ms of host per
call on the H100 machine against bf16's 0.11; docs/inference.md). A plain torch.cuda.CUDAGraph of the eager
forward replays our kernels and cuBLAS's with no guards at all.

What a replay assumes, and how each assumption is checked so that a replay never reads stale state:
- the same input signature: the pytree structure of (args, kwargs), each tensor's shape, dtype and device,
  each other argument's value (None, bool, int, float, str, dtypes, devices and enums only: an object such
  as a KV cache would be mutated by the warm-up calls and never by a replay), the autocast state and the
  global matmul and attention settings. Another signature captures another graph, kept until `reset()`.
- the same module tree (`ModuleSnapshot`): every module's submodules, parameters, buffers and forward
  hooks are the objects they were at capture, its training flag, attribute count and (an ops.Linear's)
  high_precision are unchanged, and each tensor keeps its storage, shape, strides and version counter (a
  write from outside the graph bumps it; the graph's own writes do not). A change drops every graph and
  the next call captures again (`captures` counts them). Other attribute values (an eps) are baked in at
  capture: call `reset()` after changing one.
- a forward that only writes state in place: one that rebinds module state, writes into its inputs, or
  returns anything but tensors and plain values raises at capture, naming it. Buffers the forward updates
  in place (a delayed-scaling history) are restored after the warm-up calls, so that each call, the
  capturing one included, updates them once, as an eager call does.
- no autograd: forwards run under torch.inference_mode(); an input that requires grad while grad mode is on
  raises ValueError (a graph of the forward alone would drop its backward).
Outputs are copies (a replay writes into the same static buffers). One graphed callable serves one stream at
a time; each signature keeps its graph's memory until `reset()`.
"""

from __future__ import annotations

import enum
import itertools
import operator
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from float8.kernels.launch import runtime_settings
from float8.ops.linear import Linear


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    static_inputs: List[torch.Tensor]
    out_leaves: List[Any]
    out_spec: pytree.TreeSpec


_VERSION = operator.attrgetter("_version")
# What a module's forward depends on, besides its Python attributes: these dicts' contents, its training
# flag, and on an ops.Linear the high_precision flag (ops.high_precision sets it for a while).
_MODULE_DICTS = ("_modules", "_parameters", "_buffers", "_forward_hooks", "_forward_pre_hooks")
_FLAGS = operator.attrgetter("high_precision")
# Non-tensor arguments and outputs a graph can stand for: values that cannot change behind its back.
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout, enum.Enum)


_TRAINING = operator.attrgetter("training")


def _values(dicts: List[dict]) -> List[Any]:
    return list(itertools.chain.from_iterable(map(dict.values, dicts)))


def _shapes(tensors: List[torch.Tensor]) -> tuple:
    return list(map(torch.Tensor.size, tensors)), list(map(torch.Tensor.stride, tensors))


@dataclass
class ModuleSnapshot:
    """What a capture relied on (`of(module)`), and whether it still holds (`unchanged()`, or
    `state_unchanged()` without the version counters): every module's submodule, parameter, buffer and
    forward-hook dicts (and the global hook dicts), their sizes and their values, held and compared by
    identity (a held value's id cannot be reused by a new object); each module's training flag and number
    of attributes, and an ops.Linear's high_precision; each tensor's version counter (bumped by writes from
    outside the graph); each plain tensor's storage address, shape and strides, and the identity and address
    of each inner tensor of a wrapper subclass (Float8Tensor's bits and scale), which a `.data = ...`
    re-points. Not the values of other attributes (an eps rebound): `GraphedInference.reset()` after
    changing one. Flat lists compared with C-level maps: about 45 us per check on a CI-class CPU for the
    benchmark's 2B-parameter model (60 modules, 51 parameters), 250 us with a Python loop per tensor."""

    dicts: List[dict]
    sizes: List[int]
    filled: List[dict]  # the dicts with values: a value added to an empty one shows in `sizes`
    values: List[Any]
    modules: List[torch.nn.Module]
    training: List[bool]
    attr_counts: List[int]
    flagged: List[torch.nn.Module]
    flags: List[bool]
    versioned: List[torch.Tensor]
    versions: List[int]
    plain: List[torch.Tensor]
    shapes: tuple
    stored: List[torch.Tensor]
    pointers: List[int]
    owners: List[torch.Tensor]
    attrs: List[str]
    inner: List[torch.Tensor]

    @staticmethod
    def of(module: torch.nn.Module) -> "ModuleSnapshot":
        """The snapshot of `module`'s tree as it is now."""
        modules = list(module.modules())
        dicts = [getattr(m, a) for m in modules for a in _MODULE_DICTS]
        hooks = torch.nn.modules.module
        dicts += [
            getattr(hooks, a) for a in ("_global_forward_hooks", "_global_forward_pre_hooks") if hasattr(hooks, a)
        ]
        filled = [d for d in dicts if d]
        tensors = [t for m in modules for d in (m._parameters, m._buffers) for t in d.values() if t is not None]
        # An inference tensor has no version counter (reading it raises); its rebinding still shows.
        versioned = [t for t in tensors if not t.is_inference()]
        plain = [t for t in tensors if not is_traceable_wrapper_subclass(t)]
        owners, attrs = [], []
        for t in tensors:
            if is_traceable_wrapper_subclass(t):
                names = t.__tensor_flatten__()[0]
                owners += [t] * len(names)
                attrs += names
        inner = list(map(getattr, owners, attrs))
        flagged = [m for m in modules if isinstance(m, Linear)]
        return ModuleSnapshot(
            dicts,
            list(map(len, dicts)),
            filled,
            _values(filled),
            modules,
            list(map(_TRAINING, modules)),
            list(map(len, map(vars, modules))),
            flagged,
            list(map(_FLAGS, flagged)),
            versioned,
            list(map(_VERSION, versioned)),
            plain,
            _shapes(plain),
            plain + inner,
            list(map(torch.Tensor.data_ptr, plain + inner)),
            owners,
            attrs,
            inner,
        )

    def state_unchanged(self) -> bool:
        """Whether every dict value, flag and storage is still what the snapshot saw (versions aside)."""
        return (
            list(map(len, self.dicts)) == self.sizes
            and all(map(operator.is_, itertools.chain.from_iterable(map(dict.values, self.filled)), self.values))
            and list(map(_TRAINING, self.modules)) == self.training
            and list(map(len, map(vars, self.modules))) == self.attr_counts
            and list(map(_FLAGS, self.flagged)) == self.flags
            and all(map(operator.is_, map(getattr, self.owners, self.attrs), self.inner))
            and list(map(torch.Tensor.data_ptr, self.stored)) == self.pointers
            and _shapes(self.plain) == self.shapes
        )

    def unchanged(self) -> bool:
        """state_unchanged(), and no tensor written since (its version counter)."""
        return self.state_unchanged() and list(map(_VERSION, self.versioned)) == self.versions


class GraphedInference:
    """A callable that runs `module`'s forward as CUDA graph replays (see the module docstring for what it
    checks). `graphed(*args, **kwargs)` returns what `module(*args, **kwargs)` returns under
    torch.inference_mode(), tensors copied out of the graph's buffers.

    warmup_calls: eager forwards on the capture stream before each capture (Triton compiles, FP8 Linears
    prepare their calls, cuBLAS picks its workspace), all of them before the graph records anything."""

    def __init__(self, module: torch.nn.Module, *, warmup_calls: int = 2) -> None:
        if warmup_calls < 1:
            raise ValueError(f"graphed_inference: warmup_calls must be >= 1, got {warmup_calls}")
        self.module = module
        self.warmup_calls = warmup_calls
        self.captures = 0
        self._graphs: Dict[Hashable, _Captured] = {}
        self._state: ModuleSnapshot | None = None
        self._stream: torch.cuda.Stream | None = None

    def reset(self) -> None:
        """Drop every captured graph and its memory; the next call captures again."""
        self._graphs.clear()
        self._state = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        key = self._signature(leaves, spec, (args, kwargs))
        if self._state is not None and not self._state.unchanged():
            self.reset()
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._capture(leaves, spec)
            self._graphs[key] = captured
            self._state = ModuleSnapshot.of(self.module)
        for static, leaf in zip(captured.static_inputs, (x for x in leaves if isinstance(x, torch.Tensor))):
            static.copy_(leaf)
        captured.graph.replay()
        out = [x.clone() if isinstance(x, torch.Tensor) else x for x in captured.out_leaves]
        return pytree.tree_unflatten(out, captured.out_spec)

    def _signature(self, leaves: List[Any], spec: pytree.TreeSpec, tree: Any) -> Hashable:
        parts: List[Hashable] = [spec, torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")]
        parts.append(_global_settings())
        grad = torch.is_grad_enabled()
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                if grad and x.requires_grad:
                    raise ValueError(
                        f"graphed_inference: argument {_path(tree, i)} requires grad; a graphed forward records "
                        "no backward (call it under torch.no_grad() or torch.inference_mode(), or detach it)"
                    )
                if x.device.type != "cuda":
                    raise ValueError(
                        f"graphed_inference: argument {_path(tree, i)} is on {x.device}; a CUDA graph reads "
                        "CUDA tensors only (move it to the GPU)"
                    )
                parts.append((tuple(x.shape), x.dtype, x.device))
            elif isinstance(x, _PLAIN):
                parts.append((type(x), "nan") if x != x else (type(x), x))  # NaN != NaN: one key for all NaNs
            else:
                raise TypeError(
                    f"graphed_inference: argument {_path(tree, i)} is a {type(x).__name__}; a graph can stand "
                    "for tensors and plain values (None, bool, int, float, str, dtypes, devices, enums) only. "
                    "An object the forward mutates (a KV cache) would change in the warm-up calls and never "
                    "in a replay (for a Hugging Face model, pass use_cache=False)"
                )
        return tuple(parts)

    def _capture(self, leaves: List[Any], spec: pytree.TreeSpec) -> _Captured:
        device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), None)
        if device is None:
            raise ValueError("graphed_inference: the call has no tensor argument to take the device from")
        with torch.inference_mode(False):  # normal tensors: later calls copy into them in any mode
            static = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = pytree.tree_unflatten(static, spec)
        static_inputs = [x for x in static if isinstance(x, torch.Tensor)]
        input_versions = [x._version for x in static_inputs]
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(device))
        before = ModuleSnapshot.of(self.module)
        buffers = {id(b) for b in self.module.buffers()}
        with torch.inference_mode(False):  # the buffers as they were, to put back after the warm-up calls
            kept = [(t, t._version, t.detach().clone()) for t in before.versioned if id(t) in buffers]
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.stream(stream):
            self.module(*args, **kwargs)
            settled = ModuleSnapshot.of(self.module)  # lazy state a first call makes (plans, caches) included
            for _ in range(self.warmup_calls - 1):
                self.module(*args, **kwargs)
            with torch.cuda.graph(graph, stream=stream):
                out = self.module(*args, **kwargs)
        torch.cuda.current_stream(device).wait_stream(stream)
        with torch.no_grad():
            for t, version, value in kept:
                if t._version != version:  # written by the warm-up calls: as it was before them
                    t.copy_(value)
        at = [j for j, x in enumerate(static) if isinstance(x, torch.Tensor)]
        written = [_path((args, kwargs), at[i]) for i, x in enumerate(static_inputs) if x._version != input_versions[i]]
        if written:
            raise RuntimeError(
                f"graphed_inference: the forward writes into its tensor argument(s) {', '.join(written)} in place; "
                "a graph reads copies of its inputs, so the write would never reach the caller's tensor. Run this "
                "model eagerly"
            )
        if not before.state_unchanged():
            # This signature's first call rebound state (a cache grown for a longer input, a buffer made
            # lazily): graphs captured before it may read what was replaced, so they go.
            self._graphs.clear()
        if not settled.state_unchanged():
            raise RuntimeError(
                "graphed_inference: the forward rebinds module state from call to call (a submodule, "
                "parameter, buffer, hook or attribute is another object after each call); a graph would "
                "replay the first binding only. Write such state in place, or run the model eagerly"
            )
        out_leaves, out_spec = pytree.tree_flatten(out)
        for i, x in enumerate(out_leaves):
            if not isinstance(x, (torch.Tensor, *_PLAIN)):
                raise TypeError(
                    f"graphed_inference: the forward returns a {type(x).__name__} ({_path(out, i, call=False)}); a "
                    "graph returns tensors and plain values only (for a Hugging Face model, pass use_cache=False)"
                )
        self.captures += 1
        return _Captured(graph, static_inputs, out_leaves, out_spec)


def _global_settings() -> tuple:
    """Process-wide settings that change which kernels a forward runs (TF32, deterministic algorithms,
    the SDPA backends allowed, Triton's runtime settings)."""
    b = torch.backends
    return (
        b.cuda.matmul.allow_tf32,
        b.cudnn.allow_tf32,
        torch.are_deterministic_algorithms_enabled(),
        b.cuda.flash_sdp_enabled(),
        b.cuda.mem_efficient_sdp_enabled(),
        b.cuda.math_sdp_enabled(),
        b.cuda.cudnn_sdp_enabled(),
        runtime_settings(),
    )


def _path(tree: Any, i: int, call: bool = True) -> str:
    """The i-th flattened leaf of a call's (args, kwargs), or of an output, named as the caller wrote it:
    args[0], kwargs['input_ids'], output.logits."""
    path = pytree.tree_flatten_with_path(tree)[0][i][0]
    if not call:
        return "output" + pytree.keystr(path)
    return ("args" if path[0].idx == 0 else "kwargs") + pytree.keystr(path[1:])


def graphed_inference(module: torch.nn.Module, *, warmup_calls: int = 2) -> GraphedInference:
    """`module`'s inference forward as CUDA graph replays: one capture per input signature, a replay per call
    (ops/graphs.py says what is checked before each replay). For decode-size batches of a converted model:

        model = ops.convert(model, fp8_weights=True).eval()
        fast = ops.graphed_inference(model)
        logits = fast(tokens)          # the first call of a shape captures; later ones replay
    """
    return GraphedInference(module, warmup_calls=warmup_calls)
