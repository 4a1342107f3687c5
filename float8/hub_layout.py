"""The FP8 layout of the Hugging Face Hub's FP8 releases (DeepSeek-V3, Qwen3-FP8), in memory: a Float8Tensor
weight <-> its E4M3 bytes and 128x128 block scale-inverses, and a model's state dict in that layout.

Each FP8 weight `<name>` is `float8_e4m3fn` bytes of its (N, K) shape, next to a float32 `<name>_scale_inv`
of shape (ceil(N / 128), ceil(K / 128)), one scale-inverse per 128x128 block (the last block of a ragged
dim is shorter); every other tensor (norms, embeddings, biases) is as it is. float8/checkpoint.py writes
and reads it in files; float8/hf_quantizer.py hands it to transformers' `save_pretrained`. Both import this
module, which imports neither.

Numerics: conversions in both directions are exact (no FP8 value is re-rounded):
- to the hub layout: a per-tensor scale becomes the same scale in every block; a block-scaled weight keeps
  its scales; any other layout (per-row scales that differ inside a 128-row block) cannot be written without
  re-quantizing and raises, naming the recipe to convert with instead.
- from it: a weight whose dims are multiples of 128 gets 128x128 blocks; a ragged dim (576 rows: 5 row
  blocks, the last of 64 rows) gets blocks of gcd(dim, 128) rows (64 here), each taking the scale of the
  128-block it lies in, which is how Float8Tensor's block layout tiles a dim (float8/tensor.py).
"""

from __future__ import annotations

import math
from typing import Dict

import torch

from float8.checks import block_shape
from float8.tensor import Float8Tensor, Quantizer

HUB_BLOCK = 128
SCALE_SUFFIX = "_scale_inv"

__all__ = ["HUB_BLOCK", "SCALE_SUFFIX", "from_hub_blocks", "hub_blocks", "hub_state_dict"]


# ---- one weight: Float8Tensor <-> (FP8 bytes, 128x128 block scale-inverses) -----------------------------


def hub_blocks(t: Float8Tensor, name: str = "weight") -> tuple:
    """(data, scale_inv): t's E4M3 bytes (N, K) and its scale-inverse per 128x128 block (ceil-div grid).
    Exact: raises ValueError where t's scales are not constant over each 128x128 block."""
    if not isinstance(t, Float8Tensor) or t.dim() != 2:
        raise ValueError(
            f"{name}: the hub layout holds 2-D Float8Tensor weights, got {type(t).__name__} {tuple(t.shape)}"
        )
    if t.fp8_dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: the hub layout is E4M3 ('fmt': 'e4m3'); this weight is {t.fp8_dtype}")
    n, k = t.shape
    grid = (math.ceil(n / HUB_BLOCK), math.ceil(k / HUB_BLOCK))
    s = t.scale_inv.float()
    if s.dim() == 0:
        return t.fp8_data.contiguous(), s.reshape(1, 1).repeat(grid)  # a real (not expanded) tensor
    bn, bk = block_shape(t.shape, s.shape)
    # Our block (a, b) lies in hub blocks (a*bn // 128 ... (a*bn + bn - 1) // 128) along rows, likewise along
    # columns: the pairs (our index, hub index) along each dim, and each hub block takes the scale of its
    # first row and column. Exact only if every pair agrees: compared on the small grid of pairs.
    rows = _index_pairs(n, bn)
    cols = _index_pairs(k, bk)
    ours = s[rows[:, 0]][:, cols[:, 0]]
    hub = torch.empty(grid, dtype=torch.float32, device=s.device)
    hub[rows[:, 1][:, None], cols[:, 1][None, :]] = ours  # last write wins; checked next
    if not torch.equal(hub[rows[:, 1]][:, cols[:, 1]], ours):
        raise ValueError(
            f"{name}: its scales ({tuple(s.shape)}: blocks of {bn}x{bk}) differ inside a 128x128 block, so it cannot be "
            "written in the hub's 128x128 layout without re-quantizing. Convert with recipe=Recipe.blockwise() "
            "(128x128 weight blocks) or per-tensor scaling (the default) before ops.convert(fp8_weights=True)"
        )
    return t.fp8_data.contiguous(), hub


def _index_pairs(length: int, block: int) -> torch.Tensor:
    """The distinct (block index at `block`, hub block index) pairs over the positions of a dim."""
    pos = torch.arange(length)
    return torch.unique(torch.stack([pos // block, pos // HUB_BLOCK], dim=1), dim=0)


def from_hub_blocks(
    data: torch.Tensor, scale_inv: torch.Tensor, nominal_dtype: torch.dtype, name: str = "weight"
) -> Float8Tensor:
    """A Float8Tensor of E4M3 `data` (N, K) with hub block scale-inverses (ceil(N/128), ceil(K/128)).

    Ragged dims are tiled by blocks of gcd(dim, 128), each with the scale of its 128-block (exact)."""
    if data.dtype != torch.float8_e4m3fn or data.dim() != 2:
        raise ValueError(f"{name}: expected 2-D float8_e4m3fn weight bytes, got {data.dtype} {tuple(data.shape)}")
    n, k = data.shape
    grid = (math.ceil(n / HUB_BLOCK), math.ceil(k / HUB_BLOCK))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"{name}{SCALE_SUFFIX}: a ({n}, {k}) weight in 128x128 blocks needs scale_inv of shape {grid}, got "
            f"{tuple(scale_inv.shape)}"
        )
    s = scale_inv.to(torch.float32)
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise ValueError(f"{name}{SCALE_SUFFIX}: a corrupt checkpoint; scale-inverses must be finite and positive")
    for dim, size in enumerate((n, k)):
        if size % HUB_BLOCK:
            sub = math.gcd(size, HUB_BLOCK)
            s = s.repeat_interleave(HUB_BLOCK // sub, dim=dim).narrow(dim, 0, size // sub)
    return Float8Tensor(data, s.contiguous(), nominal_dtype)


# ---- a model ----------------------------------------------------------------------------------------------


def _unique_tensors(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The model's state, one entry per tensor object (a tied weight is written once, under its first name)."""
    seen, out = set(), {}
    for name, t in model.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out[name] = t.detach()
    return out


def hub_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The model's tensors in the hub layout, by name: each FP8 weight as its E4M3 bytes and `<name>_scale_inv`
    (hub_blocks), every other tensor as it is; float8's quantizer state and tied duplicates left out."""
    out, own = {}, _quantizer_state_names(model)
    for name, t in _unique_tensors(model).items():
        if name in own:
            continue
        if type(t).__name__ == "DTensor" or hasattr(t, "device_mesh"):
            raise ValueError(
                f"{name} is a sharded DTensor: save_checkpoint writes whole tensors. Gather the model first "
                "(e.g. torch.distributed.checkpoint's get_model_state_dict with full_state_dict=True into an "
                "unsharded copy), or save the shards with torch.distributed.checkpoint"
            )
        if isinstance(t, Float8Tensor):
            out[name], out[name + SCALE_SUFFIX] = hub_blocks(t, name)
        else:
            out[name] = t
    return out


def _quantizer_state_names(model: torch.nn.Module) -> set:
    """The state keys of float8's own quantizers in the model (delayed-scaling histories, calibrated input
    scales): not part of the hub layout; a loaded model keeps (or starts afresh) its own."""
    prefixes = [name + "." for name, m in model.named_modules() if isinstance(m, Quantizer) and name]
    return {k for k in model.state_dict() if any(k.startswith(p) for p in prefixes)}
