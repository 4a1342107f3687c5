"""The runner: a list of basic ops through one autograd Function, so that forward and backward fuse across
them; or, where the small-layer policy keeps every GEMM of the run in high precision, through the ops'
plain-torch twins. Part of the core of ops/: it knows ops only by the protocol of ops/base.py and what they
declare there as class attributes (`gemm`, `folds_into_gemm`, `splits_compiled_run`, `residual_step`,
`saves`), and imports no op.

Activations travel as 2-D (tokens, features) tensors between ops; the token dims of the input are kept in
the run state and restored on the output.
"""

from __future__ import annotations

import warnings
from typing import List, NamedTuple

import torch

from float8 import DelayedScalingState, Float8Tensor
from float8.ops.context import OpContext, RunState, second_backward_error, take
from float8.ops.fusion import BACKWARD_FUSIONS, FORWARD_FUSIONS, match
from float8.ops.saved import held_storages, pack_contexts, storage_key, unpack_contexts
from float8.quantizer import check_dense, reduce_deferred
from float8.row_collectives import all_reduce_sum


class Float8PrecisionWarning(UserWarning):
    """FP8 ops fed float32 activations: everything but the GEMMs then runs, and is stored, in float32."""


def _check_precision(x: torch.Tensor, ops) -> None:
    if x.dtype == torch.float32 and any(o.gemm for o in ops):
        warnings.warn(
            "float32 activations are reaching FP8 ops: only the GEMMs run in FP8; norms, activations, "
            "attention and the saved tensors stay float32 (twice the memory traffic of bfloat16, and slower "
            "than a plain bfloat16 model). Feed bfloat16 activations: cast the inputs (and the model, "
            "model.to(torch.bfloat16), unless you keep float32 master weights on purpose).",
            Float8PrecisionWarning,
            stacklevel=4,
        )


class _Runner:
    """One forward and its backward over a list of basic ops."""

    def __init__(self, ops: list, fuse: bool, grad: bool, lead, input_requires_grad: bool, shapes_agreed=()):
        self.ops, self.fuse = ops, fuse
        self.input_requires_grad = input_requires_grad
        self.run = RunState(grad, lead, shapes_agreed)
        self.ctxs = self.contexts(self.run)
        # Delayed states with an amax group defer their reductions to the end of the run: the amaxes of the
        # forward and the backward of one step go out in one all-reduce (per group), not one per tensor.
        self.grouped = [
            q for op in ops for q in op.quantizers if isinstance(q, DelayedScalingState) and q.amax_group is not None
        ]
        self.pending: list = []

    def contexts(self, run: RunState) -> List[OpContext]:
        """One context per op, all sharing `run`."""
        return [OpContext(run, self.input_requires_grad if i == 0 else True, i == 0) for i in range(len(self.ops))]

    def _deferring(self, on: bool) -> None:
        for q in self.grouped:
            q.deferred = self.pending if on else None

    def forward(self, x, ctxs=None):
        """y for x; `ctxs`: the contexts to keep what the ops save on (default: this runner's own)."""
        ops, grad, ctxs = self.ops, self.run.grad, (self.ctxs if ctxs is None else ctxs)
        units = match(ops, FORWARD_FUSIONS, self.fuse)
        self._deferring(True)
        try:
            for k, (i, unit) in enumerate(units):
                # With fusion off, no op writes FP8 for its neighbour: each consumer quantizes for itself.
                request = self._request_after(units, k, x.shape[0]) if self.fuse else None
                x = unit.forward(ctxs[i : i + len(unit.ops)], x, request)
        finally:
            self._deferring(False)
        if not grad and self.pending:
            reduce_deferred(self.pending)  # no backward to wait for
        return x

    def _request_after(self, units, k: int, rows: int):
        """What the op after unit k wants its input as. An op that only moves rows (AllGather) passes the
        request of the op after it on (`relay`), so the producer before it writes what the consumer reads."""
        relays = []
        for _, unit in units[k + 1 :]:
            op = unit.ops[0]
            if not getattr(op, "relays_request", False):
                request = op.input_request(self.run.grad, rows)
                for relay in reversed(relays):
                    request = relay.relay(request)
                return request
            relays.append(op)
            rows *= op.group.size()
        return None

    def backward(self, dy, ctxs=None):
        """(dx, flat parameter gradients) for dy; `ctxs`: the forward's contexts as unpacked under
        torch.compile (ops/saved.py), else this runner's own."""
        ops, ctxs = self.ops, (self.ctxs if ctxs is None else ctxs)
        grads = [None] * len(ops)
        self._deferring(True)
        try:
            for i, unit in reversed(match(ops, BACKWARD_FUSIONS, self.fuse)):
                prev = ops[i - 1] if i > 0 else None
                request = prev.grad_request(ctxs[i - 1]) if prev is not None and self.fuse else None
                dy, unit_grads = unit.backward(ctxs[i : i + len(unit.ops)], dy, request)
                grads[i : i + len(unit.ops)] = unit_grads
        finally:
            self._deferring(False)
        if self.pending:
            reduce_deferred(self.pending)  # the step's forward and backward amaxes, one all-reduce per group
        _sum_over_groups(ops, grads)
        flat = []
        for op, op_grads in zip(ops, grads):
            n = len(op.op_params())
            flat.extend((list(op_grads or []) + [None] * n)[:n])
        return dy, flat


def _sum_over_groups(ops, grads) -> None:
    """Sum the gradients of ops with a grad_sum_group (sequence-parallel norms and biases) over that group:
    one all-reduce per group, of all its gradients flattened together."""
    by_group = {}
    for op, op_grads in zip(ops, grads):
        if op.grad_sum_group is not None:
            # Keyed by the group's name: dynamo of torch 2.11 cannot trace id() of a ProcessGroup.
            by_group.setdefault(op.grad_sum_group.group_name, (op.grad_sum_group, []))[1].extend(
                g for g in op_grads or [] if g is not None
            )
    for group, tensors in by_group.values():
        if tensors:
            flat = all_reduce_sum(torch.cat([t.reshape(-1).float() for t in tensors]), group)
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(part.view_as(t))


class _RunFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, runner, *params):
        ctx.runner = runner
        ctx.x_dtype = x.dtype
        # Ops keep what their backward reads on their contexts; the input is the one of those a caller can
        # still write into. Where a context holds x's memory, x is saved here too, so that autograd's
        # version check refuses a backward after an in-place write into it (as torch's own ops do) instead
        # of computing gradients from changed values. Where none does (a Linear keeps only its FP8 copy), a
        # write into x changes nothing the backward reads, and saving x would hold its memory from the
        # forward to the backward for nothing: 6.5 GiB of the converted 8-block Llama's 26.6 GiB of
        # activations on the H100 (benchmarks.peak --case converted, 2026-11-25).
        if not torch.compiler.is_compiling():
            y = runner.forward(x)
            if not isinstance(y, Float8Tensor):
                # In the token dims here, not after the Function: a view of its output (ViewBackward0) is
                # what FSDP2 warns of, since an in-place write into it drops FSDP's pre-backward hook (the
                # backward then read resharded weights and failed).
                y = y.reshape(*runner.run.lead, y.shape[-1])
            held = held_storages(runner.ctxs)
            saved = [x] if isinstance(x, Float8Tensor) or (held and storage_key(x) in held) else []
            if (
                y._is_view()
                and not isinstance(y, Float8Tensor)
                and (isinstance(x, Float8Tensor) or storage_key(y) != storage_key(x))
            ):
                # A view made inside a Function refuses in-place writes ("Output 0 of View is a view and is
                # being modified inplace"): nn.ReLU(inplace=True) after a converted Linear failed. The
                # output is handed out as a tensor of its own over the same memory instead. A view of the
                # input (ops.Identity) stays one: autograd must see that a write into it writes the input.
                y = y.detach()
            if held and not isinstance(y, Float8Tensor) and storage_key(y) in held:
                saved.append(y)  # a write into the output would change what the backward reads: refused
            # The parameters too, as torch's own ops save their weights: a backward reads some of them live
            # (a norm's weight, a high-precision Linear's), so autograd's version check refuses a backward
            # after an in-place write into one (an optimizer step between a retain_graph backward and the
            # next) instead of mixing old and new weights. A reference, no copy; FSDP2 keeps the version
            # of the parameters it gathers again for the backward.
            saved.extend(params)
            if saved:
                ctx.save_for_backward(*saved)
            return y
        # Dynamo traces the backward only from what save_for_backward hands it (ops/saved.py). The contexts
        # are made here, inside the Function: what the ops keep on them (a parameter itself, when `.to()`
        # had nothing to convert) must not be a write into objects from outside it, which dynamo refuses
        # when the tensor aliases an input.
        ctxs = runner.contexts(RunState(runner.run.grad, runner.run.lead, runner.run.shapes_agreed))
        y = runner.forward(x, ctxs)
        if ctxs and ctxs[0].run.lead != runner.run.lead:
            runner.run.lead = ctxs[0].run.lead  # a Reshape op changed the token dims of the output
        # The input itself is not saved for a version check here: a context holding x has it among `tensors`
        # (packed as it is, so autograd checks its version), and any other tensor over x's memory was
        # copied by pack_contexts, which a later write into x cannot change.
        tensors, ctx.skeleton = pack_contexts(runner.ops, ctxs, (x, *params))
        ctx.save_for_backward(*tensors)
        return y

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors  # raises if the input was modified in place since the forward
        runner = take(ctx, "runner")
        if runner is None:
            raise second_backward_error("ops.Sequential / ops op")
        dy = dy.reshape(-1, dy.shape[-1])  # the rows the ops run on (the eager output has the token dims)
        ctxs = unpack_contexts(ctx.skeleton, saved) if torch.compiler.is_compiling() else None
        dx, grads = runner.backward(dy, ctxs)
        if isinstance(dx, Float8Tensor):
            dx = dx.dequantize()
        if not ctx.needs_input_grad[0]:
            dx = None
        elif dx is not None and dx.dtype != ctx.x_dtype:
            dx = dx.to(ctx.x_dtype)
        grads = [g if need else None for g, need in zip(grads, ctx.needs_input_grad[2:])]
        return (dx, None, *grads)


def _delayed_training(ops, grad: bool) -> bool:
    return grad and any(isinstance(q, DelayedScalingState) for op in ops for q in op.quantizers)


_DELAYED_UNDER_COMPILE = (
    "delayed scaling, which torch.compile cannot trace in training (its amax history is updated in place "
    "inside forward and backward). Inference forwards (torch.no_grad, inference_mode) compile with delayed "
    "scaling; to train under compile use current scaling (TensorwiseScaling, RowwiseScaling or "
    "BlockwiseScaling), or run delayed scaling eagerly. Without fullgraph=True the run falls back to eager"
)


def _run_eagerly(ops, x, fuse):
    return run_ops(ops, x, fuse)


# Called while dynamo traces a training run under delayed scaling: dynamo runs it eagerly (a graph break, with
# the reason under fullgraph=True), so a compiled model without fullgraph trains correctly around it.
try:
    _run_delayed_training_eagerly = torch.compiler.disable(_run_eagerly, reason=_DELAYED_UNDER_COMPILE)
except TypeError:  # a torch whose disable() takes no reason: the same graph break, dynamo's own message
    _run_delayed_training_eagerly = torch.compiler.disable(_run_eagerly)


def _check_compilable(ops, grad: bool) -> None:
    """An op that says why it cannot run under torch.compile (`not_compilable`) raises. (Delayed scaling in
    training is not traced either: its amax history is module state written in place by the forward and by
    the backward, which dynamo refuses inside an autograd Function; run_ops hands such a run back to eager,
    `_run_delayed_training_eagerly`. An inference forward writes the history in plain traced code, which
    compiles: the buffers are updated in the graph as eager updates them.)"""
    for op in ops:
        if op.not_compilable is not None:
            raise NotImplementedError(f"ops.{type(op).__name__} cannot run under torch.compile: {op.not_compilable}.")


def _refuse_forward_ad(x: torch.Tensor) -> None:
    """Forward-mode AD has no FP8 form here (quantization passes gradients straight through only in reverse
    mode): a dual input would come out without its tangent. Refused, loudly."""
    if torch.autograd.forward_ad._current_level >= 0 and torch.autograd.forward_ad.unpack_dual(x).tangent is not None:
        raise NotImplementedError(
            "float8 ops do not support forward-mode AD (a dual tensor reached them: its tangent would be lost). "
            "Use reverse mode (backward), or run the layer in high precision for jvp."
        )


def _runs_as_torch(ops: list, x2: torch.Tensor) -> bool:
    """The small-layer policy applied to a whole run: when none of its Linears runs in FP8 (each too small
    for FP8 to win, on CUDA), no kernel of ours has FP8 to write or read, and torch's own functions under
    ordinary autograd cost the host least. On the H100 machine's host a tiny Linear -> RMSNorm -> GELU
    took 1558 us per forward+backward through our kernels against 419 us for torch.nn (2026-11-22,
    benchmarks/host.py): the Triton launches and the run's Python, with nothing for FP8 to win. At least
    one Linear: norms or activations alone keep their kernels. Not under lean activations, whose FP8
    copies of saved inputs only the ops' own backwards read."""
    if x2.device.type != "cuda" or isinstance(x2, Float8Tensor):
        return False
    rows, device, linear = x2.shape[0], x2.device, False
    for op in ops:
        if not op.has_torch_forward or op.recipe.lean_activations:
            return False
        op.op_params()  # a parameter still sharded by FSDP2 is refused here, naming the op
        if op.gemm:
            if not op.runs_as_torch(rows, device):
                return False
            linear = True
    return linear


def _run_as_torch(ops: list, x2: torch.Tensor, lead, fuse: bool) -> torch.Tensor:
    """The ops' plain-torch twins in order; with fusion on, a Linear and the Bias after it (its own, or
    one after a bias-free Linear) as one F.linear, as LinearBiasForward fuses them."""
    run = RunState(torch.is_grad_enabled(), lead)
    i = 0
    while i < len(ops):
        op, after = ops[i], ops[i + 1] if i + 1 < len(ops) else None
        fold = (
            fuse
            and op.gemm
            and after is not None
            and after.folds_into_gemm
            and (op.bias is None or op.bias is after.bias)
        )
        if fold:
            x2 = op.torch_forward(x2, run, bias=after.bias)
            i += 2
        else:
            x2 = op.torch_forward(x2, run)
            i += 1
    return x2


def _run_split_at_attention(ops: list, x: torch.Tensor, fuse: bool) -> torch.Tensor:
    """A run holding ops.Attention, under torch.compile: the attention runs as SDPA under ordinary autograd
    (whose backward dynamo traces; the op's own backward differentiates a recorded SDPA graph, which it
    cannot), between fused runs of the other ops. The residual pairs around it become plain adds, so no
    activation crosses from one fused run into another; `_check_residual_pairs` keeps each pair inside
    one Sequential run. The numerics are eager's: the same kernels, and a residual's gradients are summed
    two by two in the order of Residual's backward (Residual.torch_forward). The fused runs between never
    take the torch twins: the eager run, one fused Function, did not either."""
    stack = RunState(torch.is_grad_enabled())
    part: list = []
    # The ranks' shapes are compared once per group, in the first part that holds a collective: the later
    # parts' shapes follow from the same ops on every rank (two all-gathers fewer per tensor-parallel layer).
    agreed: frozenset = frozenset()
    for op in [*ops, None]:
        if op is None or op.splits_compiled_run or op.residual_step:
            if part:
                x = run_ops(part, x, fuse, as_torch=False, shapes_agreed=agreed)
                agreed = agreed | {o.shape_checked_group.group_name for o in part if o.shape_checked_group is not None}
                part = []
            if op is not None and op.splits_compiled_run:
                x = op.torch_forward_nd(x)
            elif op is not None:
                x = op.torch_forward(x, stack)
        else:
            part.append(op)
    return x


class RunPlan(NamedTuple):
    """How one run of ops goes, decided once by `plan`.

    route: "torch" (the ops' plain-torch twins under ordinary autograd: the small-layer policy keeps every
    GEMM of the run in high precision), "split" (under torch.compile, a run holding an op that runs outside
    the fused Functions, such as ops.Attention: fused runs between such ops), "eager" (under torch.compile,
    delayed scaling in training: handed back to eager), "autograd" (one autograd Function over all ops: a
    backward will run) or "forward" (the fused forward alone, nothing to differentiate).
    grad: whether a backward will run. params: the ops' parameters, in the order their gradients come."""

    route: str
    grad: bool
    params: list


def plan(ops: list, x: torch.Tensor, as_torch: bool = True) -> RunPlan:
    """The route of a run of basic `ops` on x (..., features) under the current grad mode and tracing state
    (`as_torch=False`: the plain-torch twins are not allowed). Raises where an op cannot run under
    torch.compile (`BasicOp.not_compilable`)."""
    compiling = torch.compiler.is_compiling()
    if as_torch and _runs_as_torch(ops, x if x.dim() == 2 else x.reshape(-1, x.shape[-1])):
        return RunPlan("torch", torch.is_grad_enabled(), [])
    if compiling and any(op.splits_compiled_run for op in ops):
        return RunPlan("split", torch.is_grad_enabled(), [])
    params = [p for op in ops for p in op.op_params()]
    grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
    if compiling:
        _check_compilable(ops, grad)
        if _delayed_training(ops, grad):
            return RunPlan("eager", grad, params)
    return RunPlan("autograd" if grad else "forward", grad, params)


def run_ops(
    ops: list, x: torch.Tensor, fuse: bool = True, as_torch: bool = True, shapes_agreed: frozenset = frozenset()
) -> torch.Tensor:
    """Run basic ops on x (..., features) by the route `plan` picks: one autograd node for all of them, or,
    where the small-layer policy keeps every GEMM of the run in high precision, torch's own functions
    (`as_torch`: allowed). shapes_agreed: names of process groups whose ranks' shapes are already known to
    agree (an earlier part of a split compiled run)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"ops take a tensor, got {type(x).__name__}")
    check_dense(x, "an op")
    if x.dim() == 0:
        raise ValueError("ops take a tensor of at least one dim (..., features), got a scalar")
    if not torch.compiler.is_compiling():
        _check_precision(x, ops)  # dynamo cannot trace warnings.warn: checked on eager calls only
        _refuse_forward_ad(x)
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, x.shape[-1])
    route, grad, params = plan(ops, x2, as_torch)  # the 2-D view: the same route, one reshape
    if route == "torch":
        y = _run_as_torch(ops, x2, lead, fuse)
        return y.reshape(*lead, y.shape[-1])
    if route == "split":
        return _run_split_at_attention(ops, x, fuse)
    if route == "eager":
        return _run_delayed_training_eagerly(ops, x, fuse)
    runner = _Runner(ops, fuse, grad, lead, x.requires_grad, shapes_agreed)
    if route == "autograd":
        y = _RunFunction.apply(x2, runner, *params)
    else:
        y = runner.forward(x2)
    shape = (*runner.run.lead, y.shape[-1])
    return y if tuple(y.shape) == shape else y.reshape(shape)
