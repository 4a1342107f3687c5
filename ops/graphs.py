"""CUDA graphs for inference forwards: `graphed_inference(model)` gives a callable that captures the model's
forward once per input signature and replays it, with tens of microseconds of host time per call.

Why: a decode-size forward is host-bound. torch.compile(mode="reduce-overhead") replays a graph too, but
first runs dynamo's guards, which for an FP8 model check every Float8Tensor parameter (0.21 ms of host per
call on the H100 machine against bf16's 0.11; docs/inference.md). A plain torch.cuda.CUDAGraph of the eager
forward replays our kernels and cuBLAS's with no guards at all.

What a replay assumes, and how each assumption is checked so that a replay never reads stale tensors:
- the same input signature: the pytree structure of (args, kwargs), each tensor's shape, dtype and device,
  each other leaf's value, the module's training flag and the autocast state. Another signature captures
  another graph (one per signature, kept until `reset`).
- the same module tree: every submodule, parameter and buffer is the object it was at capture, with the
  same storage and version counter (a write from outside bumps it; the graph's own writes do not, so a buffer
  the forward updates in place, such as a delayed-scaling history, is replayed correctly). A change drops
  every graph, and the next call captures again (`captures` counts them). In-place writes into parameters
  are seen either way; the re-capture is for layers that keep host-side state derived from a weight (the FP8
  weight cache of a bf16 weight re-quantizes on the next eager call).
- no autograd: forwards run under torch.inference_mode(); an input that requires grad while grad mode is on
  raises ValueError (a graph of the forward alone would drop its backward).
Python attributes the forward reads (an eps, a flag) are baked in at capture: call `reset()` after changing
them. Outputs are copies (a replay writes into the same static buffers; returning them would let the next
call overwrite a result the caller still holds).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    static_inputs: List[torch.Tensor]
    out_leaves: List[Any]
    out_spec: pytree.TreeSpec


_VERSION = operator.attrgetter("_version")


def _ids_in(dicts: List[dict]) -> List[int]:
    return list(map(id, itertools.chain.from_iterable(map(dict.values, dicts))))


@dataclass
class ModuleSnapshot:
    """What a capture relied on (`of(module)`), and whether it still holds (`unchanged()`): the values of
    every module's submodule, parameter and buffer dicts (by identity), each tensor's version counter (bumped by writes from outside the graph), and the storage of each plain tensor and of each
    inner tensor of a wrapper subclass (Float8Tensor's bits and scale), which a `.data = ...` re-points.
    Flat lists compared with C-level maps: 36 us per check on a CI-class CPU for the benchmark's 2B-parameter
    model (180 module dicts, 84 storages), against 250 us for a Python loop per tensor."""

    dicts: List[dict]
    sizes: List[int]
    ids: List[int]
    versioned: List[torch.Tensor]
    versions: List[int]
    stored: List[torch.Tensor]
    pointers: List[int]
    owners: List[torch.Tensor]
    attrs: List[str]
    inner_ids: List[int]

    @staticmethod
    def of(module: torch.nn.Module) -> "ModuleSnapshot":
        """The snapshot of `module`'s tree as it is now."""
        dicts = [d for m in module.modules() for d in (m._modules, m._parameters, m._buffers)]
        tensors = [t for d in dicts for t in d.values() if isinstance(t, torch.Tensor)]
        # An inference tensor has no version counter (reading it raises); its rebinding still shows.
        versioned = [t for t in tensors if not t.is_inference()]
        stored, owners, attrs = [], [], []
        for t in tensors:
            if is_traceable_wrapper_subclass(t):
                for a in t.__tensor_flatten__()[0]:
                    owners.append(t)
                    attrs.append(a)
                    stored.append(getattr(t, a))
            else:
                stored.append(t)
        return ModuleSnapshot(
            dicts,
            list(map(len, dicts)),
            _ids_in(dicts),
            versioned,
            list(map(_VERSION, versioned)),
            stored,
            list(map(torch.Tensor.data_ptr, stored)),
            owners,
            attrs,
            list(map(id, map(getattr, owners, attrs))),
        )

    def unchanged(self) -> bool:
        """Whether every dict, tensor, version and storage is still what the snapshot saw."""
        return (
            list(map(len, self.dicts)) == self.sizes
            and _ids_in(self.dicts) == self.ids
            and list(map(_VERSION, self.versioned)) == self.versions
            and list(map(id, map(getattr, self.owners, self.attrs))) == self.inner_ids
            and list(map(torch.Tensor.data_ptr, self.stored)) == self.pointers
        )


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
        key = self._signature(leaves, spec)
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

    def _signature(self, leaves: List[Any], spec: pytree.TreeSpec) -> Hashable:
        parts: List[Hashable] = [spec, self.module.training, torch.is_autocast_enabled("cuda")]
        parts.append(torch.get_autocast_dtype("cuda"))
        grad = torch.is_grad_enabled()
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                if grad and x.requires_grad:
                    raise ValueError(
                        f"graphed_inference: tensor argument {i} requires grad; a graphed forward records no "
                        "backward (call it under torch.no_grad() or torch.inference_mode(), or detach it)"
                    )
                if x.device.type != "cuda":
                    raise ValueError(
                        f"graphed_inference: tensor argument {i} is on {x.device}; a CUDA graph reads CUDA "
                        "tensors only (move it to the GPU)"
                    )
                parts.append((tuple(x.shape), x.dtype, x.device))
            else:
                try:
                    hash(x)
                except TypeError:
                    raise TypeError(
                        f"graphed_inference: argument {i} ({type(x).__name__}) is neither a tensor nor "
                        "hashable, so a call cannot be matched to a captured graph"
                    ) from None
                parts.append((type(x), x))
        return tuple(parts)

    def _capture(self, leaves: List[Any], spec: pytree.TreeSpec) -> _Captured:
        device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), None)
        if device is None:
            raise ValueError("graphed_inference: the call has no tensor argument to take the device from")
        static = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = pytree.tree_unflatten(static, spec)
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(self.warmup_calls):
                self.module(*args, **kwargs)
            with torch.cuda.graph(graph, stream=stream):
                out = self.module(*args, **kwargs)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.captures += 1
        out_leaves, out_spec = pytree.tree_flatten(out)
        static_inputs = [x for x in static if isinstance(x, torch.Tensor)]
        return _Captured(graph, static_inputs, out_leaves, out_spec)


def graphed_inference(module: torch.nn.Module, *, warmup_calls: int = 2) -> GraphedInference:
    """`module`'s inference forward as CUDA graph replays: one capture per input signature, a replay per call
    (ops/graphs.py says what is checked before each replay). For decode-size batches of a converted model:

        model = ops.convert(model, fp8_weights=True).eval()
        fast = ops.graphed_inference(model)
        logits = fast(tokens)          # the first call of a shape captures; later ones replay
    """
    return GraphedInference(module, warmup_calls=warmup_calls)
