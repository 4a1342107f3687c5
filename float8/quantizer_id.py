"""A quantizer's identity as constants: what a Float8Tensor carries to re-quantize itself (float8/tensor.py).

    quantizer_id(q) -> (layout, "module:qualname", args, kwargs)   constants only
    rebuild_quantizer(qid) -> a new quantizer built as q was

Constants because torch.compile's dynamo carries nothing else through the code it traces: a quantizer object
given to the Float8Tensor constructor there fails ("Failed to convert args/kwargs to proxy", torch 2.13),
while a tuple of an enum, strings, dtypes and numbers rides through traced code, a compiled graph's
context, deepcopy and pickle alike, and a guard compares it without calling Python. The class is named by
its import path, as pickle names a class, and looked up among the modules already imported: loading a
checkpoint never imports code.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from float8.checks import ScaleLayout


def quantizer_id(q: Any) -> tuple:
    """(q.layout, "module:qualname" of q's class, positional arguments, sorted keyword arguments): the
    arguments are q's `constructor_arguments()`, which build it again."""
    args, kwargs = q.constructor_arguments()
    cls = type(q)
    return (q.layout, f"{cls.__module__}:{cls.__qualname__}", tuple(args), tuple(sorted(kwargs.items())))


def rebuild_quantizer(qid: tuple, base: type) -> Any:
    """The quantizer that `qid` names, built again from its arguments. ValueError where its class cannot be
    found among the imported modules (a class defined inside a function, or its module not imported), is
    not a subclass of `base`, or builds a quantizer that is not its own requantizer (a static scale, a
    margin): an identity read from a file calls nothing but a requantizer's class, and imports nothing."""
    check_quantizer_id(qid)
    _, path, args, kwargs = qid
    module_name, _, qualname = path.partition(":")
    found = sys.modules.get(module_name)
    for part in qualname.split("."):
        # The namespace itself, not getattr: a module's __getattr__ may import (a lazy submodule).
        found = vars(found).get(part) if found is not None and hasattr(found, "__dict__") else None
    if found is None:
        raise ValueError(
            f"cannot find the quantizer class {path} to re-quantize a Float8Tensor it made: define it at the top "
            f"level of a module and import {module_name!r} first"
        )
    if not (isinstance(found, type) and issubclass(found, base)):
        raise ValueError(f"{path} names {found!r}, not a subclass of {base.__name__}: refusing to call it")
    q = found(*args, **dict(kwargs))
    if q.requantizer_id != qid:
        raise ValueError(
            f"{path}{args} is not its own requantizer (its writes would use {q.requantizer_id[1]}): a "
            "quantizer whose constructor takes other arguments than its format says so in "
            "constructor_arguments()"
        )
    return q


def lays_out(qid: tuple, data_shape: Sequence[int], scale_shape: Sequence[int]) -> bool:
    """Whether a scale of `scale_shape` for data of `data_shape` is laid out as the quantizer `qid` names
    lays out its own: one scale per tensor, one per row, or blocks of its block shape. Other layouts (a
    granularity of one's own): True, its write checks the scales it makes."""
    layout = qid[0]
    if layout is ScaleLayout.TENSOR:
        return len(scale_shape) == 0
    if layout is ScaleLayout.ROW:
        return len(scale_shape) == len(data_shape) >= 1 and tuple(scale_shape) == (*data_shape[:-1], 1)
    block = dict(qid[3]).get("block")
    if (
        layout is ScaleLayout.BLOCK
        and block is not None
        and len(data_shape) >= 2
        and len(scale_shape) == len(data_shape)
    ):
        rows, cols = block
        lead = tuple(data_shape[:-2])
        want = (*lead, -(-data_shape[-2] // rows), -(-data_shape[-1] // cols))
        return tuple(scale_shape) == want
    return True


def check_quantizer_id(qid: object) -> None:
    """ValueError unless qid has the form `quantizer_id` gives (checked where one is read from a file)."""
    ok = (
        isinstance(qid, tuple)
        and len(qid) == 4
        and isinstance(qid[0], ScaleLayout)
        and isinstance(qid[1], str)
        and ":" in qid[1]
        and isinstance(qid[2], tuple)
        and isinstance(qid[3], tuple)
        and all(isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in qid[3])
    )
    if not ok:
        raise ValueError(f"not a quantizer identity (layout, 'module:class', args, kwargs): {qid!r}")
