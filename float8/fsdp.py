"""FSDP2 all-gathers a Linear's weight as FP8: 1 byte per element on the wire instead of 2 (bf16) or 4.

    float8.fsdp.enable_fp8_all_gather(model)      # before fully_shard: the one switch
    fully_shard(block) ...; fully_shard(model)
    ... loss.backward(); optimizer.step()
    float8.fsdp.precompute_scales(model)          # optional: all weights' scales in one all-reduce a step

The choice (docs/design.md §9): a weight wrapper, not FP8 primary weights. `Float8TrainingWeight` wraps the
high-precision master shard (what the optimizer updates, in float32 or bfloat16); every op on it runs on
the master, so optimizers, state dicts and gradient clipping see a plain tensor. Only FSDP2's all-gather
sees FP8: `fsdp_pre_all_gather` quantizes the local shard with one scale for the whole weight (its amax
reduced with MAX over the data-parallel group, or the scale `precompute_scales` computed for all weights in
one all-reduce), FSDP gathers the bytes (as uint8, which every backend moves), and `fsdp_post_all_gather`
returns the unsharded weight as a Float8Tensor, which the Linear uses directly for its GEMMs and computes
the weight's high-precision gradient for (FSDP reduce-scatters it into the master's gradient). FP8 primary
weights would save the master's memory but put the optimizer's arithmetic on FP8 values (updates smaller
than an FP8 step vanish); keeping masters is the trade-off issue 10's master-weight work builds on.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch.utils._pytree import tree_map

from float8.checks import ScaleLayout, all_reduce_amax
from float8.kernels import amax as amax_kernel
from float8.kernels.multi_quantize import amax_multi
from float8.kernels.quantize import cast_with_scale
from float8.kernels.reference import scale_from_amax
from float8.tensor import Float8Tensor

aten = torch.ops.aten
# Ops whose results alias the master's storage: they count writes with it (a write through one makes a
# scale precomputed for the master stale).
_ALIASING = {
    aten.detach.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.narrow.default,
    aten.t.default,
    aten.alias.default,
    aten.reshape.default,
}
# Ops whose results stay weights (FSDP2 shards, views, copies and moves the parameter through these).
_KEEP_WRAPPED = _ALIASING | {
    aten.clone.default,
    aten._to_copy.default,
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.zeros_like.default,
    aten._pin_memory.default,
}


class Float8TrainingWeight(torch.Tensor):
    """A high-precision master weight (shard) that FSDP2 all-gathers as FP8.

    Every op runs on the wrapped master (`master`), so to everything but FSDP's all-gather it is the
    master itself; in-place ops (optimizer steps) write into it. fp8_dtype: the format of the gathered
    weight (the Linear's forward format).
    """

    @staticmethod
    def __new__(cls, master: torch.Tensor, fp8_dtype=torch.float8_e4m3fn):
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            master.shape,
            strides=master.stride(),
            storage_offset=master.storage_offset(),
            dtype=master.dtype,
            device=master.device,
            requires_grad=master.requires_grad,
        )
        self.master = master
        self.fp8_dtype = fp8_dtype
        self.precomputed_scale: Optional[torch.Tensor] = None
        # Writes into the master through this wrapper or any alias of it (detach, views, .data, a state
        # dict's entries, DTensor.to_local(): each is a new wrapper), shared by all of them; with the
        # master's version (writes that reach it without this class: a compiled optimizer step) it stamps a
        # precomputed scale, which a gather uses only while both are unchanged.
        self._writes = [0]
        self._scale_stamp = None
        return self

    def set_precomputed_scale(self, scale: torch.Tensor) -> None:
        """The scale the next gathers quantize with, valid until the master is written."""
        self.precomputed_scale, self._scale_stamp = scale, (self._writes[0], self.master._version)

    def _valid_precomputed_scale(self) -> Optional[torch.Tensor]:
        if self.precomputed_scale is None or self._scale_stamp != (self._writes[0], self.master._version):
            return None
        return self.precomputed_scale

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"Float8TrainingWeight({self.fp8_dtype}, master={self.master!r})"

    def __reduce_ex__(self, protocol):
        # Saved as its master, a plain tensor: a checkpoint of an FSDP2 model with the FP8 all-gather loads
        # with `torch.load(..., weights_only=True)` and with torch.distributed.checkpoint, which refuse
        # unknown classes ("Unsupported global: float8.fsdp.Float8TrainingWeight"), and into any model:
        # load_state_dict copies the values into the master of a wrapped weight.
        return self.master.detach().__reduce_ex__(protocol)

    def __tensor_flatten__(self):
        return ["master"], (self.fp8_dtype,)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Float8TrainingWeight(inner["master"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        weights = []

        def unwrap(t):
            if isinstance(t, Float8TrainingWeight):
                weights.append(t)
                return t.master
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        fp8 = weights[0].fp8_dtype
        if func in _KEEP_WRAPPED:
            writes = weights[0]._writes if func in _ALIASING else None
            return tree_map(lambda t: _wrapped(t, fp8, writes) if isinstance(t, torch.Tensor) else t, out)
        if func._schema.is_mutable:
            # A write into a master (an optimizer step): counted, so a scale stamped before it is not used
            # (by this wrapper or any alias sharing the count: _valid_precomputed_scale).
            for w in weights:
                w._writes[0] += 1
            if isinstance(args[0], Float8TrainingWeight):
                return args[0]
        return out

    # ---- FSDP2 ----------------------------------------------------------------------------------------
    def fsdp_pre_all_gather(
        self,
        mesh: torch.distributed.device_mesh.DeviceMesh,
        outer_size: Optional[torch.Size] = None,
        outer_stride: Optional[tuple[int, ...]] = None,
        module: Optional[torch.nn.Module] = None,
        mp_policy: Optional[torch.distributed.fsdp.MixedPrecisionPolicy] = None,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The local shard as FP8 bytes (uint8) under one scale for the whole weight."""
        scale = self._valid_precomputed_scale()
        if scale is None:  # one all-reduce for this weight; precompute_scales does all weights in one
            amax = _reduce_over(amax_kernel(self.master), _mesh_groups(mesh))
            scale = scale_from_amax(amax, self.fp8_dtype)
        data, scale_inv = cast_with_scale(self.master, self.fp8_dtype, scale.reshape(()))
        bits = data.view(torch.uint8)
        if outer_size is not None and bits.dim() and mesh.size() > 1:
            # An uneven (or empty) shard: FSDP gathers equal blocks of ceil(rows / world) rows and trims the
            # unsharded weight to its size afterwards; the padding rows are zeros that nothing reads.
            padded_rows = -(-outer_size[0] // mesh.size())
            if bits.shape[0] < padded_rows:
                bits = torch.cat([bits, bits.new_zeros((padded_rows - bits.shape[0], *bits.shape[1:]))])
        return (bits,), (scale_inv,)

    # FSDP2 reads this hook's signature (inspect.signature) before every all-gather: 64 times a step in
    # benchmarks/distributed.py's 8-block model. Kept on the function, inspect returns it without rebuilding
    # it from the code object (16 -> 5 us a call on a development CPU).
    fsdp_pre_all_gather.__signature__ = inspect.signature(fsdp_pre_all_gather)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: tuple[torch.Tensor, ...],
        param_dtype: torch.dtype,
        *,
        out: Optional[Float8Tensor] = None,
    ) -> Optional[tuple[Float8Tensor, tuple[torch.Tensor, ...]]]:
        """The unsharded weight: a Float8Tensor of the gathered bytes, marked as a trainable master's copy."""
        (bits,) = all_gather_outputs
        (scale_inv,) = metadata
        if scale_inv.is_cuda:
            # FSDP2 calls fsdp_pre_all_gather on its copy-in stream, so the scale was allocated there. Tell the
            # caching allocator it is read on this stream too: else its block can go to the next weight's
            # prefetch (on the copy-in stream) before this stream has read it.
            scale_inv.record_stream(torch.cuda.current_stream())
        if out is not None:
            # FSDP reuses the unsharded parameter: it wrote the new bits into the same storage. The new scale
            # is put in place of the old one, not copied into it: a compiled forward saved the old scale for
            # its backward, and an in-place write bumps its version, so backward's re-gather (reshard after
            # forward) failed the version check ("modified by an inplace operation", float32 []). A saved
            # scale and the new one hold the same value within a step: no optimizer write comes between.
            out._scale_inv = scale_inv
            out._transpose_raw = out._t_stamp = None  # the bits were rewritten: no transpose of the old ones
            return
        weight = Float8Tensor(bits.view(self.fp8_dtype), scale_inv.clone(), param_dtype)
        weight._gathered_master = True
        return weight, (bits,)


def _wrapped(t: torch.Tensor, fp8_dtype: torch.dtype, writes: Optional[list]) -> Float8TrainingWeight:
    w = Float8TrainingWeight(t, fp8_dtype)
    if writes is not None:
        w._writes = writes
    return w


def _mesh_groups(mesh) -> tuple:
    """The process groups of every dim of a mesh: one for FSDP, two for HSDP's whole mesh (replicate,
    shard). The amax is reduced over all of them, so every rank quantizes a weight with one scale (a 2-D
    mesh has no single group: get_group() refused it, and HSDP with the FP8 all-gather failed in its first
    forward). precompute_scales passes the parameter's mesh; FSDP may hand a gather its shard dim alone
    (torch 2.13 does), which gives the same amax: the replicas hold equal shards."""
    return tuple(mesh.get_group(dim) for dim in range(mesh.ndim))


def _reduce_over(amax: torch.Tensor, groups) -> torch.Tensor:
    for group in groups:
        all_reduce_amax(amax, group)
    return amax


def enable_fp8_all_gather(model: torch.nn.Module, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> list:
    """Wrap the weights of the model's float8.ops Linears (per-tensor weight scaling) so that FSDP2
    all-gathers them as FP8; call before fully_shard. Returns the names of the wrapped weights. A Linear
    whose weight cannot be served (row-wise or block weight scaling, an FP8-only weight) keeps the
    high-precision all-gather."""
    wrapped = []
    for name, module in model.named_modules():
        quantizers = getattr(module, "quantizers", ())  # a Linear's three; () for other ops and modules
        weight = getattr(module, "weight", None)
        if not quantizers or not isinstance(weight, torch.nn.Parameter) or isinstance(weight, Float8Tensor):
            continue
        if quantizers.weight.layout is not ScaleLayout.TENSOR or isinstance(weight.data, Float8TrainingWeight):
            continue
        module.weight = torch.nn.Parameter(
            Float8TrainingWeight(weight.data, fp8_dtype), requires_grad=weight.requires_grad
        )
        wrapped.append(f"{name}.weight" if name else "weight")
    return wrapped


@torch.no_grad()
def precompute_scales(model: torch.nn.Module) -> int:
    """After optimizer.step(): the scales of all FP8-gathered weights, from one all-reduce of their amaxes
    per data-parallel group (instead of one per weight at each all-gather). Returns how many weights.
    A gather uses a scale only while its master is unwritten: an eager write through the weight or any
    alias of it (.data, detach(), to_local(), views, a state dict's entries; dcp.load) drops it, and the
    gather takes the amax itself. A compiled optimizer step writes the masters out of sight (inductor moves
    no version counter here): call this after every such step, or the gathers quantize with the scales of
    the last call (saturating weights that grew since). Every rank must write its weights alike (as
    FSDP's training does): a rank that drops its scales alone runs an all-reduce the others do not."""
    by_mesh = {}
    for p in model.parameters():
        # The DTensor's own local tensor, the object FSDP2 calls fsdp_pre_all_gather on: to_local() returns
        # a new wrapper each call, and a scale set on it was lost (every gather all-reduced its amax again:
        # 64 small all-reduces a step in the 8-block benchmark model).
        local = getattr(p, "_local_tensor", p)
        if isinstance(local, Float8TrainingWeight):
            mesh_groups = _mesh_groups(p.device_mesh) if hasattr(p, "device_mesh") else ()
            by_mesh.setdefault(tuple(id(g) for g in mesh_groups), (mesh_groups, []))[1].append(local)
    for mesh_groups, weights in by_mesh.values():
        masters = [w.master for w in weights]
        first = masters[0]
        # One launch unless a CUDA graph is being captured (its table copy from the host cannot be).
        if not (first.is_cuda and torch.cuda.is_current_stream_capturing()) and all(
            type(m) is torch.Tensor and m.is_contiguous() and m.dtype == first.dtype and m.device == first.device
            for m in masters
        ):
            amaxes = amax_multi(masters)  # one launch for all of them (32 launches and fills before)
        else:
            amaxes = torch.stack([amax_kernel(m) for m in masters])
        amaxes = _reduce_over(amaxes, mesh_groups)
        # The scales of all weights of one format in one scale_from_amax call (a few launches instead of
        # a few per weight: 32 weights of the 8-block model launched ~250 tiny kernels between the
        # optimizer step and the next forward); each weight keeps a view of its element.
        for fp8_dtype in {w.fp8_dtype for w in weights}:
            scales = scale_from_amax(amaxes, fp8_dtype)
            for i, w in enumerate(weights):
                if w.fp8_dtype == fp8_dtype:
                    w.set_precomputed_scale(scales[i])
    return sum(len(w) for _, w in by_mesh.values())
