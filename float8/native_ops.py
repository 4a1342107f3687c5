"""Ops that Float8Tensor runs natively, in FP8: views, transposes, copies, device moves, split and cat.

Each handler moves the scale-inverse with the data so the tensor's meaning never changes (outputs that
alias the FP8 bits alias the scale; outputs that copy the bits copy the scale). Where a scale layout
cannot follow a view (e.g. a slice that cuts a 128-wide block), the handler hands the op to the fallback:
the result is then a plain high-precision tensor, with a warning.

The transpose cache is decided in one place, `transpose_cache_after`.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from float8 import dispatch
from float8.checks import block_shape, storage_address
from float8.kernels.reference import FP8_DTYPES, HIGH_PRECISION_DTYPES
from float8.tensor import Float8Tensor, _is_float8
from float8.writes import check_whole, mark_written, requantize_into, share_writes

aten = torch.ops.aten


# ---- the transpose cache ---------------------------------------------------------------------------
def transpose_cache_after(
    how: str, src: Float8Tensor, derive: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
) -> Optional[torch.Tensor]:
    """The transpose cache of an op's result, from the source's. The only place that decides it.

    how: "alias"  the result aliases src's bits in the same layout (detach, alias): alias the cache too.
         "copy"   the result copies src's bits (clone, device move): derive(cache), but only with grad
                  mode on; under no_grad/inference_mode no transpose is allocated.
         "swap"   the result is src transposed (t, transpose of the last two dims): src's own bits are
                  the new cache when they are contiguous (no allocation).
         "drop"   anything else (slices, reshapes, in-place writes that change layout): no cache; the
                  GEMM that needs the other layout makes it.
    """
    cache = src._transpose
    if how == "alias":
        return None if cache is None else cache.detach()
    if how == "copy":
        return None if cache is None or not torch.is_grad_enabled() else derive(cache)
    if how == "swap":
        return src._data if cache is not None and src._data.is_contiguous() else None
    if how == "drop":
        return None
    raise ValueError(f"unknown transpose-cache rule {how!r}")


def _wrap(src: Float8Tensor, data, scale_inv, transpose=None, dtype=None) -> Float8Tensor:
    out = Float8Tensor(data, scale_inv, dtype or src.dtype, transpose, quantizer_id=src._quantizer_id)
    out._gathered_master = src._gathered_master
    if _aliases(data, src):
        share_writes(out, src)  # a view: writes through it must reach src's cache check, and back
    return out


def _aliases(data: torch.Tensor, src: Float8Tensor) -> bool:
    """Whether `data` lies in the storage of src's bits or of its cache (False where storages have no
    address: fake and functional tensors while torch.compile traces)."""
    ptr = storage_address(data)
    if ptr is None:
        return False
    cache = src._transpose_raw
    return ptr == storage_address(src._data) or (cache is not None and ptr == storage_address(cache))


def _fallback(func, args, kwargs):
    return dispatch.fallback(func, args, kwargs, _is_float8, requantize_into)


def _shares_versions(handler):
    """Run a view handler so that the inner views it makes share their source's version counter.

    __torch_dispatch__ runs below autograd's ADInplaceOrView key, where a view of a plain tensor gets a
    counter of its own; a raw write into `view.fp8_data` would then not move the base's counter, and the
    base's transpose cache would go stale unseen (writes.transpose_in_step). Re-enabling the key for
    the handler makes the inner views ordinary autograd views of the source's bits."""

    @functools.wraps(handler)
    def run(func, args, kwargs):
        if torch.compiler.is_compiling():
            return handler(func, args, kwargs)
        with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
            return handler(func, args, kwargs)

    return run


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


# ---- aliases and copies ----------------------------------------------------------------------------
@dispatch.implements([aten.detach.default, aten.alias.default])
@_shares_versions
def _alias(func, args, kwargs):
    src = args[0]
    return _wrap(src, func(src._data), src._scale_inv, transpose_cache_after("alias", src))


@dispatch.implements([aten.clone.default])
def _clone(func, args, kwargs):
    src = args[0]
    memory_format = kwargs.get("memory_format")
    data = src._data.clone() if memory_format is None else src._data.clone(memory_format=memory_format)
    cache = transpose_cache_after("copy", src, lambda t: t.clone())
    return _wrap(src, data, src._scale_inv.clone(), cache)


@dispatch.implements([aten._to_copy.default])
def _to_copy(func, args, kwargs):
    src = args[0]
    dtype = kwargs.get("dtype") or src.dtype
    if dtype in FP8_DTYPES:
        raise TypeError(
            f"Float8Tensor.to({dtype}) is ambiguous: use .fp8_data for the raw FP8 bits, or "
            "Float8Tensor.quantize(t.dequantize(), fp8_dtype) to re-quantize into another format"
        )
    if dtype not in HIGH_PRECISION_DTYPES:
        return _fallback(func, args, kwargs)
    device = kwargs.get("device") or src.device
    non_blocking = kwargs.get("non_blocking", False)

    def move(t):
        return t.to(device, non_blocking=non_blocking, copy=True)

    cache = transpose_cache_after("copy", src, move)
    # A high-precision dtype changes what the tensor stands for; the FP8 bits stay as they are.
    return _wrap(src, move(src._data), move(src._scale_inv), cache, dtype=dtype)


@dispatch.implements([aten.copy_.default])
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not _is_float8(dst):
        dst.copy_(src.dequantize(dst.dtype if dst.dtype in HIGH_PRECISION_DTYPES else src.dtype))
        return dst
    check_whole(dst)
    if (
        _is_float8(src)
        and src.fp8_dtype == dst.fp8_dtype
        and src.shape == dst.shape
        and src._scale_inv.shape == dst._scale_inv.shape
    ):
        # FP8 -> FP8 of the same format and layout: the bits and their scale travel together.
        with torch.no_grad():
            bits = src._data
            if _aliases(bits, dst):
                bits = bits.clone()  # e.g. x8.copy_(x8.t()): the source is dst's own cache or data
            dst._data.copy_(bits)
            dst._scale_inv.copy_(src._scale_inv)
            if dst._transpose is not None:
                dst._transpose_raw.copy_(bits.transpose(-2, -1))
        mark_written(dst)
        return dst
    requantize_into(dst, src.dequantize() if _is_float8(src) else src)
    return dst


@dispatch.implements([aten.empty_like.default, aten.zeros_like.default])
def _like(func, args, kwargs):
    src = args[0]
    dtype = kwargs.get("dtype")
    device = kwargs.get("device") or src.device
    if dtype is not None and dtype != src.dtype:
        return func(src._data, dtype=dtype, device=device)
    data = func(src._data, device=device, memory_format=torch.contiguous_format)
    return Float8Tensor(data, torch.ones_like(src._scale_inv, device=device), src.dtype, quantizer_id=src._quantizer_id)


# ---- views -------------------------------------------------------------------------------------------
def _slice_scale(src: Float8Tensor, dim: int, start: int, end: int, step: int):
    """The scale of data[..., start:end:step (on dim), ...], or None if blocks do not allow it."""
    s = src._scale_inv
    if s.dim() == 0 or s.shape[dim] == 1:
        return s
    block = block_shape(src._data.shape, s.shape)[dim]
    if block == 1:
        return aten.slice.Tensor(s, dim, start, end, step)
    n = src._data.shape[dim]
    if step != 1 or start % block or (end % block and end != n):
        return None
    return s.narrow(dim, start // block, -(-end // block) - start // block)


def _norm_slice(n: int, start, end):
    start = 0 if start is None else start
    end = n if end is None else end
    start = max(0, min(n, start + n if start < 0 else start))
    end = max(start, min(n, end + n if end < 0 else end))
    return start, end


@dispatch.implements([aten.slice.Tensor])
@_shares_versions
def _slice(func, args, kwargs):
    src = args[0]
    dim = _norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), src.dim())
    start = args[2] if len(args) > 2 else kwargs.get("start")
    end = args[3] if len(args) > 3 else kwargs.get("end")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    start, end = _norm_slice(src.shape[dim], start, end)
    scale = _slice_scale(src, dim, start, end, step)
    if scale is None:
        raise ValueError(
            f"slicing dim {dim} as [{start}:{end}:{step}] cuts a scale block of this Float8Tensor "
            f"(scale_inv {tuple(src._scale_inv.shape)} for data {tuple(src.shape)}), so the slice cannot "
            "be a view; dequantize() first, or slice along block boundaries"
        )
    return _wrap(src, aten.slice.Tensor(src._data, dim, start, end, step), scale, transpose_cache_after("drop", src))


@dispatch.implements([aten.select.int])
@_shares_versions
def _select(func, args, kwargs):
    src, dim, index = args[0], _norm_dim(args[1], args[0].dim()), args[2]
    index = index + src.shape[dim] if index < 0 else index
    s = src._scale_inv
    if s.dim() > 0:
        block = block_shape(src._data.shape, s.shape)[dim]
        s = s.select(dim, 0 if s.shape[dim] == 1 else index // block)
    return _wrap(src, func(src._data, dim, index), s, transpose_cache_after("drop", src))


def _split(src: Float8Tensor, dim: int, sizes):
    outs, start = [], 0
    for size in sizes:
        outs.append(aten.slice.Tensor(src, dim, start, start + size, 1))
        start += size
    return outs


@dispatch.implements([aten.split.Tensor])
def _split_tensor(func, args, kwargs):
    src, size = args[0], args[1]
    dim = _norm_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), src.dim())
    n = src.shape[dim]
    sizes = [min(size, n - i) for i in range(0, n, size)] if n else [0]
    return _split(src, dim, sizes)


@dispatch.implements([aten.split_with_sizes.default])
def _split_with_sizes(func, args, kwargs):
    src, sizes = args[0], args[1]
    dim = _norm_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), src.dim())
    return _split(src, dim, sizes)


@dispatch.implements([aten.view.default, aten._unsafe_view.default])
@_shares_versions
def _view(func, args, kwargs):
    src, shape = args[0], list(args[1])
    data = func(src._data, shape)
    if tuple(data.shape) == tuple(src.shape):
        return _wrap(src, data, src._scale_inv, transpose_cache_after("alias", src))
    s = src._scale_inv
    if s.dim() > 0 and tuple(data.shape) != tuple(src.shape):
        same_rows = tuple(s.shape[:-1]) == tuple(src._data.shape[:-1])
        if not (data.dim() >= 1 and src.dim() >= 1 and data.shape[-1] == src.shape[-1] and same_rows):
            raise ValueError(
                f"a Float8Tensor with scale_inv {tuple(s.shape)} for data {tuple(src.shape)} cannot be viewed "
                f"as {tuple(data.shape)}: its scale blocks would not follow; dequantize() first"
            )
        # Per-row and 1xK layouts: leading dims may be reshaped freely, the last dim keeps its blocks.
        s = s.reshape(tuple(data.shape[:-1]) + (s.shape[-1],))
    return _wrap(src, data, s, transpose_cache_after("drop", src))


@dispatch.implements([aten.as_strided.default])
@_shares_versions
def _as_strided(func, args, kwargs):
    """The same strided view of the FP8 bits (strides count elements, one byte each). One scale follows any
    such view; per-row and block scales only the identity view (FSDP2 makes one of its unsharded weight)."""
    src, size, stride = args[0], list(args[1]), list(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    data = func(src._data, size, stride, offset)
    s = src._scale_inv
    if s.dim() and (
        tuple(data.shape) != tuple(src.shape)
        or data.stride() != src._data.stride()
        or data.storage_offset() != src._data.storage_offset()
    ):
        raise ValueError(
            f"as_strided{tuple(size), tuple(stride), offset} of a Float8Tensor with scale_inv {tuple(s.shape)}: its "
            "scale blocks cannot follow a view other than the identity; dequantize() first"
        )
    same = tuple(data.shape) == tuple(src.shape) and data.stride() == src._data.stride()
    return _wrap(src, data, s, transpose_cache_after("alias" if same else "drop", src))


@dispatch.implements([aten.unsqueeze.default])
@_shares_versions
def _unsqueeze(func, args, kwargs):
    src, dim = args[0], _norm_dim(args[1], args[0].dim() + 1)
    s = src._scale_inv if src._scale_inv.dim() == 0 else src._scale_inv.unsqueeze(dim)
    return _wrap(src, func(src._data, dim), s, transpose_cache_after("drop", src))


@dispatch.implements([aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims])
@_shares_versions
def _squeeze(func, args, kwargs):
    src = args[0]
    if len(args) == 1:
        dims = [d for d in range(src.dim()) if src.shape[d] == 1]
    else:
        dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        dims = [_norm_dim(d, src.dim()) for d in dims if src.dim() and src.shape[_norm_dim(d, src.dim())] == 1]
    s = src._scale_inv if src._scale_inv.dim() == 0 else src._scale_inv.squeeze(dims)
    return _wrap(src, src._data.squeeze(dims), s, transpose_cache_after("drop", src))


def _transposed(src: Float8Tensor, d0: int, d1: int) -> Float8Tensor:
    nd = src.dim()
    d0, d1 = _norm_dim(d0, nd), _norm_dim(d1, nd)
    s = src._scale_inv if src._scale_inv.dim() == 0 else src._scale_inv.transpose(d0, d1)
    if d0 == d1:
        return _wrap(src, src._data.transpose(d0, d1), s, transpose_cache_after("alias", src))
    if {d0, d1} == {nd - 2, nd - 1}:
        # Swap data and cache: the cached layout becomes the data, the old data the cache.
        cache = transpose_cache_after("swap", src)
        data = src._transpose if src._transpose is not None else src._data.transpose(d0, d1)
        return _wrap(src, data, s, cache)
    return _wrap(src, src._data.transpose(d0, d1), s, transpose_cache_after("drop", src))


@dispatch.implements([aten.t.default])
@_shares_versions
def _t(func, args, kwargs):
    src = args[0]
    if src.dim() < 2:
        return _wrap(src, src._data.t(), src._scale_inv, transpose_cache_after("alias", src))
    return _transposed(src, 0, 1)


@dispatch.implements([aten.transpose.int])
@_shares_versions
def _transpose(func, args, kwargs):
    return _transposed(args[0], args[1], args[2])


@dispatch.implements([aten.permute.default])
@_shares_versions
def _permute(func, args, kwargs):
    src, dims = args[0], [_norm_dim(d, args[0].dim()) for d in args[1]]
    swapped = [i for i, d in enumerate(dims) if i != d]
    if not swapped:
        return _wrap(src, src._data.permute(dims), src._scale_inv, transpose_cache_after("alias", src))
    if len(swapped) == 2 and dims[swapped[0]] == swapped[1]:
        return _transposed(src, swapped[0], swapped[1])
    s = src._scale_inv if src._scale_inv.dim() == 0 else src._scale_inv.permute(dims)
    return _wrap(src, src._data.permute(dims), s, transpose_cache_after("drop", src))


@dispatch.implements([aten.new_zeros.default, aten.new_empty.default])
def _new_like(func, args, kwargs):
    """A new Float8Tensor of another size in the same format (zeros: +0.0 bits). It shares a per-tensor
    source's scale object (zeros are zeros under any scale, and `cat` with the source stays FP8, as when
    DTensor pads an uneven shard); per-row/block sources give scales of 1 in their layout where the size
    allows it, else one scale of 1. A different dtype gives a plain tensor of that dtype."""
    src, size = args[0], list(args[1])
    dtype = kwargs.get("dtype")
    device = kwargs.get("device") or src.device
    if dtype is not None and dtype != src.dtype:
        return func(src._data, size, dtype=dtype, device=device)
    data = func(src._data, size, dtype=src.fp8_dtype, device=device)
    s = src._scale_inv
    if s.dim() == 0:
        s = s if s.device == data.device else s.to(data.device)
        return Float8Tensor(data, s, src.dtype, quantizer_id=src._quantizer_id)
    blocks = block_shape(src._data.shape, s.shape)
    if len(size) == len(blocks) and all(n % b == 0 for n, b in zip(size, blocks)) and size[-1] == src.shape[-1]:
        scale = torch.ones([n // b for n, b in zip(size, blocks)], dtype=torch.float32, device=device)
        return Float8Tensor(data, scale, src.dtype, quantizer_id=src._quantizer_id)
    return Float8Tensor(data, torch.ones((), dtype=torch.float32, device=device), src.dtype)


# ---- padding -----------------------------------------------------------------------------------------
@dispatch.implements([aten.constant_pad_nd.default])
def _pad(func, args, kwargs):
    """Zero padding stays FP8 (the zero bits are +0.0 in both formats, so any scale keeps them 0): what
    DTensor does to even out uneven shards before a collective. Padded scale entries are 1; a pad that
    would cut a scale block raises. Padding with another value goes to the fallback."""
    src, pad = args[0], list(args[1])
    value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    if value != 0 or any(p < 0 for p in pad):
        return _fallback(func, args, kwargs)
    data = func(src._data.view(torch.uint8), pad, 0).view(src.fp8_dtype)
    s = src._scale_inv
    if s.dim() == 0:
        return Float8Tensor(data, s, src.dtype, quantizer_id=src._quantizer_id)
    blocks = block_shape(src._data.shape, s.shape)
    scale_pad = []
    for i in range(0, len(pad), 2):
        dim = src.dim() - 1 - i // 2
        lo, hi = pad[i], pad[i + 1]
        if lo % blocks[dim] or hi % blocks[dim] or (s.shape[dim] == 1 and src.shape[dim] > 1 and (lo or hi)):
            raise ValueError(
                f"zero padding {pad} of a Float8Tensor with scale_inv {tuple(s.shape)} for data {tuple(src.shape)} "
                "would cut a scale block; dequantize first"
            )
        scale_pad += [lo // blocks[dim], hi // blocks[dim]]
    return Float8Tensor(data, func(s, scale_pad, 1.0), src.dtype, quantizer_id=src._quantizer_id)


# ---- cat ---------------------------------------------------------------------------------------------
def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if torch.compiler.is_compiling():
        return False  # no storage pointers under tracing: only the same scale object counts
    return (
        a.shape == b.shape
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.stride() == b.stride()
    )


@dispatch.implements([aten.cat.default])
def _cat(func, args, kwargs):
    tensors = [t for t in args[0]]
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    first = tensors[0] if tensors else None
    if not tensors or not all(_is_float8(t) for t in tensors):
        return _fallback(func, args, kwargs)
    dim = _norm_dim(dim, first.dim())
    same_kind = all(t.fp8_dtype == first.fp8_dtype and t.dtype == first.dtype for t in tensors)
    data = None
    if same_kind and first._scale_inv.dim() == 0:
        # One scale for all: only when it is literally the same scale tensor (no host sync to compare).
        if all(_same_tensor(t._scale_inv, first._scale_inv) for t in tensors):
            data, scale = torch.cat([t._data for t in tensors], dim), first._scale_inv.clone()
    elif same_kind and all(t._scale_inv.dim() == first.dim() for t in tensors):
        blocks = {block_shape(t._data.shape, t._scale_inv.shape) for t in tensors}
        if len(blocks) == 1:
            data = torch.cat([t._data for t in tensors], dim)
            scale = torch.cat([t._scale_inv for t in tensors], dim)
    if data is None:
        return _fallback(func, args, kwargs)
    # The quantizer all carry, if they carry one; otherwise the result's layout is read from its scale.
    same = all(t._quantizer_id == first._quantizer_id for t in tensors)
    return Float8Tensor(data, scale, first.dtype, quantizer_id=first._quantizer_id if same else None)
