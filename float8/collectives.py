"""Float8Tensor through torch.distributed's c10d collectives: the FP8 bytes move, with their scale-inverse.

`dist.broadcast`, `dist.all_gather`, `dist.all_gather_into_tensor`, `dist.send`/`recv`/`isend`/`irecv`,
`dist.scatter` and `dist.gather` of Float8Tensors reach `__torch_dispatch__` as `c10d` ops. Each handler
here runs the same collective on the inner tensors: the FP8 bits as uint8 (gloo has no float8 type) and the
float32 scale-inverse, and leaves correct Float8Tensors behind (docs/design.md §9):

- Before moving data, the ranks agree on what they move: one small all-gather of each rank's description
  (FP8 format, nominal dtype, shape, scale layout). A mismatch raises ValueError on every rank (each sees
  the same descriptions), never a hang or a wrong result. Point-to-point send/recv carry a header instead;
  a receiver that does not match drains the payload first (so the sender never blocks) and then raises.
- all_gather_into_tensor puts every rank's bits into one tensor, which can hold one per-tensor scale
  only: the gathered scales must be equal (quantize with a TensorwiseQuantizer(amax_group=...) so they
  are), else ValueError. Row-wise and block scales travel with their rows and blocks.
- all_reduce of a Float8Tensor takes the high-precision path: each rank's dequantized values are summed
  (or reduced with the given op) in float32 and the result is re-quantized into the tensor with its own
  layout, identically on every rank. reduce_scatter, reduce and all_to_all of FP8 data raise: dequantize
  first. So does every other c10d or functional collective not handled here: nothing falls back silently.
- Functional collectives (`_c10d_functional`: torch.compile, DTensor) all_gather_into_tensor, broadcast,
  all_reduce and wait_tensor return new Float8Tensors. A functional all-gather of per-tensor scaled
  tensors keeps each rank's scale for its block of rows; in eager, where ranks shared one scale, the
  result has that one scale (one small wait). Traced code cannot compare scales on the host and keeps the
  blocks. So DTensor's distribute_tensor, redistribute (Shard <-> Replicate, uneven shards too) and
  to_local keep FP8 bytes and values.
- A receiving tensor's transpose cache is dropped (its bits changed); views of it see the write.
- The collectives run synchronously inside the handler (data, then scales) and return the Work of the
  last step (complete for collectives; for send/recv the scale's, which the caller waits for), so
  `async_op=True` works but does not overlap. `isend` blocks until its header and bits are received:
  two ranks that `isend` to each other before posting their `irecv` deadlock (post the receive first on
  one side, or order them by rank). Point-to-point cannot check what the other side passes before moving
  data: a plain tensor sent into a Float8Tensor's `recv` (or the reverse) is a protocol mismatch that
  gloo aborts or that leaves garbage in the plain receiver; pass Float8Tensors on both sides.
- Each rank checks its own arguments (receiving tensors whole, contiguous and distinct; outputs matching
  the input) and sends the verdict along with its descriptions: a problem on one rank raises on all.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives  # noqa: F401  (registers the functional ops it defines)

from float8 import dispatch
from float8.checks import block_shape, is_whole, storage_address
from float8.kernels.reference import FP8_DTYPES, HIGH_PRECISION_DTYPES
from float8.tensor import Float8Tensor, _is_float8
from float8.writes import mark_written, requantized, share_writes

c10d = torch.ops.c10d
MAX_DIMS = 8
# A description: [fp8 code, nominal code, ndim, shape (MAX_DIMS), scale ndim, scale shape (MAX_DIMS)].
DESCRIPTION_LEN = 4 + 2 * MAX_DIMS
_DTYPES = list(FP8_DTYPES) + list(HIGH_PRECISION_DTYPES)


def _group(pg):
    """The Python ProcessGroup of the one a c10d op was given (a boxed ScriptObject there)."""
    return dist.ProcessGroup.unbox(pg) if not isinstance(pg, dist.ProcessGroup) else pg


def _size_rank(pg):
    """(world size, rank) of the process group a c10d op was given."""
    group = _group(pg)
    return group.size(), group.rank()


def _bits(t: Float8Tensor) -> torch.Tensor:
    return t._data.view(torch.uint8)


def describe(t: torch.Tensor) -> torch.Tensor:
    """(DESCRIPTION_LEN,) int64: format, nominal dtype, shape and scale shape of a Float8Tensor (-1 = not one)."""
    d = torch.full((DESCRIPTION_LEN,), -1, dtype=torch.int64)
    if not _is_float8(t):
        return d
    if t.dim() > MAX_DIMS:
        raise ValueError(f"Float8Tensor collectives take up to {MAX_DIMS} dims, got shape {tuple(t.shape)}")
    d[0], d[1], d[2] = _DTYPES.index(t.fp8_dtype), _DTYPES.index(t.dtype), t.dim()
    d[3 : 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    s = t._scale_inv
    d[3 + MAX_DIMS] = s.dim()
    d[4 + MAX_DIMS : 4 + MAX_DIMS + s.dim()] = torch.tensor(s.shape, dtype=torch.int64)
    return d


def _explain(d: torch.Tensor) -> str:
    if int(d[0]) < 0:
        return "not a Float8Tensor"
    nd, snd = int(d[2]), int(d[3 + MAX_DIMS])
    shape = tuple(int(v) for v in d[3 : 3 + nd])
    scale = tuple(int(v) for v in d[4 + MAX_DIMS : 4 + MAX_DIMS + snd])
    return f"{_DTYPES[int(d[0])]} shape {shape} (scale_inv {scale}, nominal {_DTYPES[int(d[1])]})"


# What a rank found wrong with its own arguments, sent along with its descriptions so that every rank raises.
PROBLEMS = (
    "",
    "an output does not match the input (format, shape or scale layout)",
    "outputs share their bits or scale (e.g. chunks of one tensor), so each cannot hold its own scale",
    "a receiving tensor is part of a larger one (it shares its scale and transpose with the rest): pass whole tensors",
    "a tensor is not contiguous: pass contiguous ones",
)


def problem_of(
    tensors: Sequence[Float8Tensor], inputs: Optional[Sequence[Float8Tensor]] = None, receiving: bool = True
) -> int:
    """The PROBLEMS index of a rank's own arguments: tensors that receive (whole, contiguous, distinct, and
    matching `inputs`' description where given)."""
    seen = set()
    for t in tensors:
        if inputs is not None and describe(t).tolist() != describe(inputs[0]).tolist():
            return 1
        if receiving:
            for part in (t._data, t._scale_inv):
                ptr = storage_address(part)
                if ptr is not None and part.numel():
                    if ptr in seen:
                        return 2
                    seen.add(ptr)
            if not is_whole(t):
                return 3
        if not t._data.is_contiguous():
            return 4
    return 0


def agree(
    tensors: Sequence[Float8Tensor], pg: Union[dist.ProcessGroup, torch.ScriptObject], op: str, problem: int = 0
) -> None:
    """Every rank holds tensors of the same description (format, dtype, shape, scale layout) and found no
    problem with its own arguments (`problem`, a PROBLEMS index), or every rank raises a ValueError naming
    the rank and the difference. One all-gather of a few int64s; nothing is moved before it."""
    # On the data's device: NCCL moves CUDA tensors only.
    rows = torch.stack([describe(t) for t in tensors])
    local = torch.cat([rows, torch.full((rows.shape[0], 1), problem, dtype=torch.int64)], dim=1)
    local = local.to(tensors[0]._data.device)
    world, _ = _size_rank(pg)
    gathered = torch.empty((world * local.shape[0], local.shape[1]), dtype=torch.int64, device=local.device)
    dist.all_gather_into_tensor(gathered, local, group=_group(pg))
    gathered = gathered.cpu().reshape(world, *local.shape)
    for rank in range(world):
        code = int(gathered[rank][:, -1].max())
        if code:
            raise ValueError(f"{op} of Float8Tensors: on rank {rank}, {PROBLEMS[code]}")
    gathered = gathered[..., :-1]
    for rank in range(world):
        if not torch.equal(gathered[rank], gathered[0]):
            i = int((gathered[rank] != gathered[0]).any(dim=1).nonzero()[0])
            raise ValueError(
                f"{op} of Float8Tensors: rank {rank} holds {_explain(gathered[rank][i])} where rank 0 holds "
                f"{_explain(gathered[0][i])}; every rank must pass tensors of the same format, shape and scale layout"
            )


def _check_float8(tensors, op: str) -> None:
    for t in tensors:
        if not _is_float8(t):
            raise TypeError(
                f"{op} mixes Float8Tensors and plain tensors ({type(t).__name__} {getattr(t, 'dtype', '')}); "
                "pass Float8Tensors for every tensor, or dequantize them all"
            )


def _received(tensors) -> None:
    """The bits of these tensors were written by a collective: drop stale caches (and tell their views)."""
    for t in tensors:
        t._transpose_raw = None
        mark_written(t)


# ---- the handled collectives -------------------------------------------------------------------------


def _parts(t: Float8Tensor):
    """What moves of a Float8Tensor, in order: its bits (uint8) and its scale-inverse."""
    return (_bits(t), t._scale_inv)


def _last(works):
    """Wait for all but the last Work and return that one (the caller waits for it)."""
    for w in works[:-1]:
        w.wait()
    return works[-1]


def _boxed(work):
    """A Python Work as the c10d op returns it (a boxed ScriptObject)."""
    return work.boxed() if isinstance(work, dist.Work) else work


# The handlers call the Python collectives on the unboxed group, not the c10d op they received: calling
# the op with its boxed group from inside __torch_dispatch__ crashed NCCL on torch 2.11 (2 H200s).


@dispatch.implements([c10d.broadcast_.default])
def _broadcast(func, args, kwargs):
    tensors, pg, root_rank = args[0], args[1], args[2]
    _check_float8(tensors, "broadcast")
    agree(tensors, pg, "broadcast", problem_of(tensors))
    g = _group(pg)
    parts = [_bits(t) for t in tensors] + [t._scale_inv for t in tensors]
    work = _last([dist.broadcast(p, group=g, group_src=root_rank, async_op=True) for p in parts])
    work.wait()
    if _size_rank(pg)[1] != root_rank:
        _received(tensors)
    return tensors, _boxed(work)


@dispatch.implements([c10d.allgather_.default])
def _all_gather(func, args, kwargs):
    outputs, inputs, pg = args[0], args[1], args[2]
    _check_float8(inputs, "all_gather")
    for outs in outputs:
        _check_float8(outs, "all_gather")
    problem = max((problem_of(outs, [x]) for outs, x in zip(outputs, inputs)), default=0)
    agree(inputs, pg, "all_gather", problem)
    g = _group(pg)
    works = [
        dist.all_gather([_parts(o)[i] for o in outs], _parts(x)[i].contiguous(), group=g, async_op=True)
        for outs, x in zip(outputs, inputs)
        for i in range(2)
    ]
    work = _last(works)
    work.wait()
    for outs in outputs:
        _received(outs)
    return outputs, _boxed(work)


@dispatch.implements([c10d._allgather_base_.default])
def _all_gather_into_tensor(func, args, kwargs):
    out, x, pg = args[0], args[1], args[2]
    _check_float8([out, x], "all_gather_into_tensor")
    world, _ = _size_rank(pg)
    s = x._scale_inv
    fits = (
        out.fp8_dtype == x.fp8_dtype
        and out.shape[0] == world * x.shape[0]
        and out.shape[1:] == x.shape[1:]
        and (s.dim() == 0) == (out._scale_inv.dim() == 0)
        and (
            s.dim() == 0
            or (
                tuple(out._scale_inv.shape) == (world * s.shape[0],) + tuple(s.shape[1:])
                and block_shape(out._data.shape, out._scale_inv.shape) == block_shape(x._data.shape, s.shape)
            )
        )
    )
    agree([x], pg, "all_gather_into_tensor", 1 if not fits else problem_of([out]))
    g = _group(pg)
    if s.dim() == 0:
        # The scales first: if they differ, nothing has been written yet.
        scales = torch.empty((world,), dtype=s.dtype, device=s.device)
        dist.all_gather_into_tensor(scales, s.reshape(1), group=g)
        if not bool((scales == scales[0]).all()):
            raise ValueError(
                "all_gather_into_tensor of per-tensor scaled Float8Tensors with different scales on different ranks "
                f"(scale_inv {scales.tolist()}): one output tensor holds one scale. Quantize with one scale across "
                "the group (TensorwiseQuantizer(amax_group=group)), or all_gather into a list"
            )
        work = dist.all_gather_into_tensor(_bits(out), _bits(x).contiguous(), group=g, async_op=True)
        work.wait()
        out._scale_inv.copy_(scales[0])
    else:
        dist.all_gather_into_tensor(_bits(out), _bits(x).contiguous(), group=g)
        work = dist.all_gather_into_tensor(out._scale_inv, s.contiguous(), group=g, async_op=True)
        work.wait()
    _received([out])
    return out, _boxed(work)


def _header(t) -> torch.Tensor:
    return describe(t).to(t._data.device)


@dispatch.implements([c10d.send.default])
def _send(func, args, kwargs):
    tensors, pg, dst, tag = args
    _check_float8(tensors, "send")
    g = _group(pg)
    work = None
    for t in tensors:
        if work is not None:
            work.wait()
        dist.send(_header(t), group=g, group_dst=dst, tag=tag)
        dist.send(_bits(t).contiguous(), group=g, group_dst=dst, tag=tag)
        # gloo's point-to-point ops hang on 0-d tensors, and a second wait() on their Work waits for a second
        # message: the last send is left to the caller's wait.
        work = dist.isend(t._scale_inv.contiguous().view(-1), group=g, group_dst=dst, tag=tag)
    return _boxed(work)


@dispatch.implements([c10d.recv_.default])
def _recv(func, args, kwargs):
    tensors, pg, src, tag = args
    _check_float8(tensors, "recv")
    g = _group(pg)
    work = None
    for t in tensors:
        if work is not None:
            work.wait()
        header = torch.empty((DESCRIPTION_LEN,), dtype=torch.int64, device=t._data.device)
        dist.recv(header, group=g, group_src=src, tag=tag)
        mine = describe(t)
        own = problem_of([t])
        if own or not torch.equal(header.cpu(), mine):
            # Drain what the sender sends, so that it never blocks, then refuse.
            h = header.cpu()
            nd, snd = int(h[2]), int(h[3 + MAX_DIMS])
            numel = int(torch.tensor(h[3 : 3 + nd].tolist() or [1]).prod()) if nd else 1
            snumel = int(torch.tensor(h[4 + MAX_DIMS : 4 + MAX_DIMS + snd].tolist() or [1]).prod()) if snd else 1
            dist.recv(torch.empty(numel, dtype=torch.uint8, device=t._data.device), group=g, group_src=src, tag=tag)
            dist.recv(torch.empty(snumel, dtype=torch.float32, device=t._data.device), group=g, group_src=src, tag=tag)
            why = PROBLEMS[own] if own else f"rank {src} sent {_explain(h)} into {_explain(mine)}"
            raise ValueError(f"recv: {why}")
        dist.recv(_bits(t), group=g, group_src=src, tag=tag)
        _received([t])
        work = dist.irecv(t._scale_inv.view(-1), group=g, group_src=src, tag=tag)  # waited by the caller
    return _boxed(work)


@dispatch.implements([c10d.allreduce_.default])
def _all_reduce(func, args, kwargs):
    tensors, pg = args[0], args[1]
    rest = args[2:]
    _check_float8(tensors, "all_reduce")
    agree(tensors, pg, "all_reduce", problem_of(tensors))
    op = dist.ReduceOp.RedOpType(rest[0].op())  # the boxed ReduceOp the c10d op was given
    wides = [t.dequantize(torch.float32) for t in tensors]
    work = _last([dist.all_reduce(w, op=op, group=_group(pg), async_op=True) for w in wides])
    work.wait()
    with torch.no_grad():
        for t, w in zip(tensors, wides):
            fresh = requantized(t, w)
            t._data.copy_(fresh._data)
            t._scale_inv.copy_(fresh._scale_inv)
    _received(tensors)
    return tensors, _boxed(work)


@dispatch.implements([c10d.scatter_.default])
def _scatter(func, args, kwargs):
    outputs, inputs, pg, root = args[0], args[1], args[2], args[3]
    _check_float8(outputs, "scatter")
    for ins in inputs:
        _check_float8(ins, "scatter")
    problem = problem_of(outputs) or max((problem_of(ins, outputs, receiving=False) for ins in inputs), default=0)
    agree(outputs, pg, "scatter", problem)
    g, is_root = _group(pg), _size_rank(pg)[1] == root
    works = [
        dist.scatter(
            _parts(o)[i],
            [_parts(x)[i].contiguous() for x in inputs[k]] if is_root else None,
            group=g,
            group_src=root,
            async_op=True,
        )
        for k, o in enumerate(outputs)
        for i in range(2)
    ]
    work = _last(works)
    work.wait()
    _received(outputs)
    return outputs, _boxed(work)


@dispatch.implements([c10d.gather_.default])
def _gather(func, args, kwargs):
    outputs, inputs, pg, root = args[0], args[1], args[2], args[3]
    _check_float8(inputs, "gather")
    for outs in outputs:
        _check_float8(outs, "gather")
    problem = max((problem_of(outs, inputs) for outs in outputs), default=0)
    agree(inputs, pg, "gather", problem)
    g, is_root = _group(pg), _size_rank(pg)[1] == root
    works = [
        dist.gather(
            _parts(x)[i].contiguous(),
            [_parts(o)[i] for o in outputs[k]] if is_root else None,
            group=g,
            group_dst=root,
            async_op=True,
        )
        for k, x in enumerate(inputs)
        for i in range(2)
    ]
    work = _last(works)
    work.wait()
    for outs in outputs:
        _received(outs)
    return _boxed(work)


# ---- everything else refuses ------------------------------------------------------------------------

_REFUSED = {
    "reduce_scatter_": "reduce-scatter of FP8 data: dequantize, reduce-scatter in high precision, then quantize",
    "_reduce_scatter_base_": "reduce-scatter of FP8 data: dequantize, reduce-scatter in high precision, then quantize",
    "reduce_scatter_tensor_coalesced_": "reduce-scatter of FP8 data: dequantize first",
    "reduce_": "reduce of FP8 data: dequantize, reduce in high precision, then quantize",
    "allreduce_coalesced_": "coalesced all_reduce of FP8 data: all_reduce each tensor, or dequantize first",
    "alltoall_": "all_to_all of Float8Tensors is not handled: move fp8_data and scale_inv yourself",
    "alltoall_base_": "all_to_all of Float8Tensors is not handled: move fp8_data and scale_inv yourself",
    "allgather_coalesced_": "coalesced all_gather of Float8Tensors is not handled: all_gather each tensor",
    "allgather_into_tensor_coalesced_": "coalesced all_gather_into_tensor of Float8Tensors is not handled",
    "recv_any_source_": "recv from any source into a Float8Tensor is not handled: name the source rank",
    "barrier": "barrier takes no Float8Tensor",
}
_FUNCTIONAL_REFUSED = {
    "reduce_scatter_tensor": "reduce-scatter of FP8 data: dequantize first",
    "reduce_scatter_tensor_coalesced": "reduce-scatter of FP8 data: dequantize first",
    "all_to_all_single": "all_to_all of Float8Tensors is not handled",
    "all_reduce_coalesced": "coalesced all_reduce of FP8 data: all_reduce each tensor",
    "all_gather_into_tensor_coalesced": "coalesced all_gather of Float8Tensors: gather each tensor",
    "all_gather_into_tensor_out": "all_gather into a given Float8Tensor: use the c10d op (dist.all_gather_into_tensor)",
}


def _refuse(reason: str):
    def handler(func, args, kwargs):
        raise NotImplementedError(f"{func} on a Float8Tensor: {reason}. Nothing was moved.")

    return handler


def _register_refusals() -> None:
    """Every op of the collective namespaces not handled above raises (listed from the registered schemas,
    so a torch version's new collectives are covered too)."""
    reasons = {
        **{f"c10d::{k}": v for k, v in _REFUSED.items()},
        **{f"_c10d_functional::{k}": v for k, v in _FUNCTIONAL_REFUSED.items()},
    }
    for schema in torch._C._jit_get_all_schemas():
        namespace, _, name = schema.name.partition("::")
        if namespace not in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            continue
        packet = getattr(getattr(torch.ops, namespace), name, None)
        op = getattr(packet, schema.overload_name or "default", None) if packet is not None else None
        if op is None or dispatch.lookup(op) is not None:
            continue
        dispatch.implements([op])(
            _refuse(reasons.get(schema.name, "this collective of Float8Tensors is not handled; dequantize first"))
        )


# ---- functional collectives (torch.compile, DTensor): a new Float8Tensor out, waited by wait_tensor ----
# These are traced by torch.compile, so nothing here reads a value on the host: a gathered per-tensor
# scaled tensor keeps every rank's scale, as one scale per rank-block along dim 0 (scale_inv
# (world, 1, ...): blocks of the input's shape, a layout the tensor contract allows), bits untouched.

_functional = getattr(torch.ops, "_c10d_functional", None)


def _gathered_scale(s: torch.Tensor, ndim: int, gather):
    if s.dim() == 0:
        return gather(s.reshape((1,) * max(ndim, 1)))
    return gather(s.contiguous())


if _functional is not None:

    @dispatch.implements([_functional.all_gather_into_tensor.default])
    def _f_all_gather(func, args, kwargs):
        x, group_size, group_name = args
        _check_float8([x], "all_gather_into_tensor")
        if x.dim() == 0:
            raise ValueError("all_gather_into_tensor of a 0-d Float8Tensor: give it a dim to gather along")
        data = func(_bits(x).contiguous(), group_size, group_name).view(x.fp8_dtype)
        scale = _gathered_scale(x._scale_inv, x.dim(), lambda s: func(s, group_size, group_name))
        if x._scale_inv.dim() == 0 and not torch.compiler.is_compiling():
            # Eager: one small wait tells whether the ranks shared one scale (a tensor quantized whole and
            # then sharded, or a quantizer with an amax group); then the result has that one scale, which
            # FP8 GEMMs and DTensor's unpadding of uneven shards need.
            scale = _functional.wait_tensor(scale)
            if bool((scale == scale.reshape(-1)[0]).all()):
                scale = scale.reshape(-1)[0].clone()
        # Per-tensor scales that differ by rank become blocks, which the identity does not lay out: a write
        # then reads the layout from the scale (Float8Tensor.requantizer), the GEMM its shape.
        return Float8Tensor(data, scale, x.dtype, quantizer_id=x._quantizer_id)

    @dispatch.implements([_functional.broadcast.default])
    def _f_broadcast(func, args, kwargs):
        x, src, group_name = args
        _check_float8([x], "broadcast")
        data = func(_bits(x).contiguous(), src, group_name).view(x.fp8_dtype)
        scale = func(x._scale_inv.contiguous(), src, group_name)
        return Float8Tensor(data, scale, x.dtype, quantizer_id=x._quantizer_id)

    @dispatch.implements([_functional.all_reduce.default])
    def _f_all_reduce(func, args, kwargs):
        # The high-precision path of the c10d handler; the sum must be known to re-quantize it, so the
        # reduction is waited for here.
        x, reduce_op, group_name = args
        _check_float8([x], "all_reduce")
        total = _functional.wait_tensor(func(x.dequantize(torch.float32), reduce_op, group_name))
        return requantized(x, total)

    def _f_wrap(func, args, kwargs):
        # In eager, torch wraps a functional collective's output in an AsyncCollectiveTensor that waits on
        # first use. A Float8Tensor is waited for here instead (no overlap in eager; traced code never
        # comes here), and an alias of the same bits comes back.
        (t,) = args
        _f_wait(_functional.wait_tensor.default, (t,), {})
        alias = Float8Tensor(t._data, t._scale_inv, t.dtype, t._transpose_raw, quantizer_id=t._quantizer_id)
        return share_writes(alias, t)

    if hasattr(_functional, "_wrap_tensor_autograd"):  # not in every torch version
        dispatch.implements([_functional._wrap_tensor_autograd.default])(_f_wrap)

    @dispatch.implements([_functional.wait_tensor.default])
    def _f_wait(func, args, kwargs):
        (t,) = args
        func(t._data)
        func(t._scale_inv)
        if t._transpose_raw is not None:
            func(t._transpose_raw)
        return t


_register_refusals()
