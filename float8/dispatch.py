"""The dispatch table of Float8Tensor and its one fallback.

`implements([aten.x, aten.y])` registers a handler for those ops; registering an op twice is an error.
`Float8Tensor.__torch_dispatch__` looks the op up here; an op not in the table goes to `fallback`:

    compute in high precision: every Float8Tensor argument is dequantized to its nominal dtype, the op
    runs on plain tensors, and its plain result is returned. A warning (Float8FallbackWarning) names the
    op, once per op (Python's warning filter de-duplicates by message). An in-place op on a Float8Tensor
    (`w.add_(g)`, `w.mul_(0.5)`) runs on the dequantized copy and re-quantizes the result into the same
    Float8Tensor (same FP8 dtype and scaling granularity, fresh scale), so it keeps its type.

This module knows nothing of Float8Tensor's class: handlers live in float8/native_ops.py and
float8/gemm.py, which import both.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.utils._pytree import tree_map


class Float8FallbackWarning(UserWarning):
    """An op had no FP8 implementation and ran in high precision (slower, and its result is not FP8)."""


_TABLE: dict = {}


def implements(ops: Iterable[Union[torch._ops.OpOverload, torch._ops.OpOverloadPacket]]) -> Callable:
    """Register a handler `fn(func, args, kwargs)` for each aten op (overload packet or overload)."""

    def decorator(fn):
        for op in ops:
            if op in _TABLE:
                raise ValueError(f"Float8Tensor already has a handler for {op}: {_TABLE[op].__name__}")
            _TABLE[op] = fn
        return fn

    return decorator


def lookup(func: torch._ops.OpOverload) -> Optional[Callable]:
    """The handler for `func` (an OpOverload), looked up by overload first, then by its packet."""
    handler = _TABLE.get(func)
    if handler is None:
        handler = _TABLE.get(func.overloadpacket)
    return handler


def fallback(
    func: torch._ops.OpOverload, args: tuple, kwargs: dict, is_float8: Callable, requantize_into: Callable
) -> Any:
    """Run `func` on dequantized copies; re-quantize into the mutated Float8Tensor for in-place ops."""
    warnings.warn(
        f"Float8Tensor has no FP8 implementation of {func}; it ran in high precision on dequantized "
        "copies (slower, and the result is a plain tensor). Dequantize explicitly to silence this.",
        Float8FallbackWarning,
        stacklevel=3,
    )

    def unwrap(t):
        return t.dequantize() if is_float8(t) else t

    plain_args = tree_map(unwrap, args)
    plain_kwargs = tree_map(unwrap, kwargs)
    out = func(*plain_args, **plain_kwargs)

    mutated = _mutated_float8_args(func, args, kwargs, is_float8)
    if not mutated:
        return out
    trained = [t for _, _, t in mutated if t.requires_grad]
    if trained:
        raise RuntimeError(
            f"{func}: an in-place update of an FP8 tensor that requires grad (an optimizer step on an FP8-only "
            "parameter?). FP8 has no room for such updates: small ones round away, optimizer moments kept in "
            "FP8 round to zero, and the weights diverge. Train a high-precision master weight (ops.Linear or "
            "ops.convert without fp8_weights quantizes it in each forward) and keep FP8-only weights frozen "
            "(requires_grad=False)."
        )
    # In-place: the op wrote into the dequantized copy of each mutated argument; write it back as FP8.
    for key, j, t in mutated:
        written = plain_args[key] if isinstance(key, int) else plain_kwargs[key]
        requantize_into(t, written if j is None else written[j])
    first = mutated[0][2]
    return first if func._schema.returns and len(func._schema.returns) == 1 and mutated[0][1] is None else out


def _mutated_float8_args(func, args, kwargs, is_float8):
    """(argument key, index in a tensor list or None, Float8Tensor) for each Float8Tensor the op writes into:
    a mutated tensor argument, or an element of a mutated tensor list (the _foreach_*_ ops an optimizer
    runs, whose writes were lost before)."""
    mutated = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if i < len(args):
            key, value = i, args[i]
        elif arg.name in kwargs:
            key, value = arg.name, kwargs[arg.name]
        else:
            continue
        if is_float8(value):
            mutated.append((key, None, value))
        elif isinstance(value, (list, tuple)):
            mutated.extend((key, j, t) for j, t in enumerate(value) if is_float8(t))
    return mutated
