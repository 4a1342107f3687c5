"""FP8 checkpoints in the layout the FP8 releases on the Hugging Face Hub use (DeepSeek-V3, Qwen3-FP8).

    float8.save_checkpoint(model, directory)     # *.safetensors (+ index when sharded) and config.json
    float8.load_checkpoint(model, directory)     # into a model converted with ops.convert(fp8_weights=True)

The layout, which transformers and vLLM read: each FP8 weight `<name>` is stored as `float8_e4m3fn` bytes of
its (N, K) shape, next to a float32 `<name>_scale_inv` of shape (ceil(N / 128), ceil(K / 128)), one
scale-inverse per 128x128 block (the last block of a ragged dim is shorter); every other tensor (norms,
embeddings, biases) is stored as it is. `config.json` carries
`"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128], "modules_to_not_convert": [...]}` (the Linears kept in high precision),
merged into the model's own config where it has one (`model.config`).

Numerics: conversions in both directions are exact (no FP8 value is re-rounded):
- saving: a per-tensor scale becomes the same scale in every block; a block-scaled weight keeps its scales;
  any other layout (per-row scales that differ inside a 128-row block) cannot be written without
  re-quantizing and raises, naming the recipe to convert with instead.
- loading: a weight whose dims are multiples of 128 gets 128x128 blocks; a ragged dim (576 rows: 5 row
  blocks, the last of 64 rows) gets blocks of gcd(dim, 128) rows (64 here), each taking the scale of the
  128-block it lies in, which is how Float8Tensor's block layout tiles a dim (float8/tensor.py).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Dict, Optional

import torch

from float8.tensor import Float8Tensor, block_shape

HUB_BLOCK = 128
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [HUB_BLOCK, HUB_BLOCK],
}
SCALE_SUFFIX = "_scale_inv"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

__all__ = [
    "QUANTIZATION_CONFIG", "enable_save_pretrained", "from_hub_blocks", "hub_blocks", "hub_state_dict", "load_checkpoint",
    "quantization_config", "read_checkpoint", "save_checkpoint",
]  # fmt: skip


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as e:  # pragma: no cover - safetensors is a dependency; this names it if missing
        raise ImportError("float8 checkpoints need the safetensors package: pip install safetensors") from e
    return safetensors.torch


# ---- one weight: Float8Tensor <-> (FP8 bytes, 128x128 block scale-inverses) -----------------------------


def hub_blocks(t: Float8Tensor, name: str = "weight") -> tuple:
    """(data, scale_inv): t's E4M3 bytes (N, K) and its scale-inverse per 128x128 block (ceil-div grid).
    Exact: raises ValueError where t's scales are not constant over each 128x128 block."""
    if not isinstance(t, Float8Tensor) or t.dim() != 2:
        raise ValueError(f"{name}: the hub layout holds 2-D Float8Tensor weights, got {type(t).__name__} {tuple(t.shape)}")
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


def from_hub_blocks(data: torch.Tensor, scale_inv: torch.Tensor, nominal_dtype: torch.dtype, name: str = "weight") -> Float8Tensor:
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


def save_checkpoint(model: torch.nn.Module, directory: str, *, max_shard_bytes: int = 5 * 2**30) -> list:
    """Write `model` (FP8-only weights: ops.convert(model, fp8_weights=True)) to `directory` in the hub's
    FP8 layout: safetensors files of at most `max_shard_bytes` each (model.safetensors, or
    model-00001-of-0000N.safetensors with model.safetensors.index.json), and config.json with the
    quantization_config. High-precision tensors are written as they are; float8's per-layer quantizer
    state is not written. Returns the files written."""
    st = _safetensors()
    tensors = {name: t.cpu().contiguous() for name, t in hub_state_dict(model).items()}
    os.makedirs(directory, exist_ok=True)
    for old in os.listdir(directory):  # an earlier save's files: a stale index would be read first
        if old == INDEX_FILE or old == SINGLE_FILE or re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", old):
            os.remove(os.path.join(directory, old))
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    meta = {"format": "pt"}
    written = []
    if len(shards) == 1:
        st.save_file(shards[0], os.path.join(directory, SINGLE_FILE), metadata=meta)
        written.append(SINGLE_FILE)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            st.save_file(shard, os.path.join(directory, fname), metadata=meta)
            weight_map.update({name: fname for name in shard})
            written.append(fname)
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(INDEX_FILE)
    config = _model_config(model)
    config["quantization_config"] = quantization_config(model)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    written.append("config.json")
    return written


def quantization_config(model: torch.nn.Module) -> dict:
    """QUANTIZATION_CONFIG plus `modules_to_not_convert`: the Linear layers whose weights are not FP8 here
    (layers convert skipped). A loader that converts every other Linear to FP8 (transformers) then matches
    the file: without the list, transformers keeps its default skips (the LM head) in high precision and
    reads FP8 bytes as bf16 values where the head is FP8."""
    skip = [
        name for name, m in model.named_modules()
        if hasattr(m, "in_features") and hasattr(m, "out_features")
        and isinstance(getattr(m, "weight", None), torch.Tensor) and not isinstance(m.weight, Float8Tensor)
    ]  # fmt: skip
    return {**QUANTIZATION_CONFIG, "modules_to_not_convert": skip}


def _model_config(model) -> dict:
    cfg = getattr(model, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else {}


def read_checkpoint(directory: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint directory (sharded with an index, or one file), by name."""
    _safetensors()  # names the package if it is missing
    from safetensors import safe_open

    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]  # name -> the file that holds it, and only that one
    elif os.path.exists(os.path.join(directory, SINGLE_FILE)):
        weight_map = None
    else:
        raise FileNotFoundError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE}")
    files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
    out = {}
    for fname in files:
        # Copied out of the file's mapping: loaded weights use these tensors as they are, and weights backed by
        # the file would change (or fault) when it is rewritten or truncated later.
        with safe_open(os.path.join(directory, fname), framework="pt") as f:
            for name in f.keys():
                if weight_map is None or weight_map.get(name) == fname:
                    out[name] = f.get_tensor(name).clone()
    if weight_map is not None and set(weight_map) - set(out):
        raise ValueError(f"{index}: names no file holds: {sorted(set(weight_map) - set(out))[:5]}")
    return out


def _check_quantization_config(directory: str) -> None:
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        q = json.load(f).get("quantization_config")
    if q is None:
        return
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3" or list(q.get("weight_block_size") or []) != [128, 128]:
        raise ValueError(
            f"{path}: quantization_config {q} is not the layout float8 reads (quant_method 'fp8', fmt 'e4m3', "
            "weight_block_size [128, 128])"
        )


def load_checkpoint(model: torch.nn.Module, directory: str, *, strict: bool = True) -> None:
    """Load a hub-layout FP8 checkpoint (ours, or one made elsewhere) into `model`, in place.

    Each `<name>` stored with a `<name>_scale_inv` must be an FP8-only weight of the model (convert it with
    ops.convert(model, fp8_weights=True) first): the parameter becomes a new Parameter, a Float8Tensor of
    the stored bytes with their block scales (nominal dtype: the old weight's), on the old weight's device,
    under every name it had (tied weights stay tied). Build optimizers and capture CUDA graphs after
    loading: they would hold the old parameters. Every other tensor loads through load_state_dict.
    strict: every checkpoint tensor is used and every tensor of the model (but float8's quantizer state and
    tied duplicates) is in the checkpoint. Everything is checked before anything is changed: a checkpoint
    that does not fit raises ValueError and leaves the model as it was."""
    _check_quantization_config(directory)
    tensors = read_checkpoint(directory)
    fp8_names = {n[: -len(SCALE_SUFFIX)] for n in tensors if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in tensors}
    bare = [n for n, t in tensors.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and n not in fp8_names]
    if bare:
        raise ValueError(
            f"load_checkpoint({directory!r}): FP8 tensors without a `<name>{SCALE_SUFFIX}` (not the hub layout, whose "
            f"scales are per 128x128 block): {bare[:5]}"
        )
    state = model.state_dict(keep_vars=True)
    replacements, unused = {}, []
    for name in sorted(fp8_names):
        current = state.get(name)
        if current is None:
            unused += [name, name + SCALE_SUFFIX]
            continue
        if not isinstance(current, Float8Tensor) or not _is_param(model, name):
            raise ValueError(
                f"{name}: the checkpoint holds it in FP8, but the model's is a {type(current).__name__} "
                f"{current.dtype}; convert the model with float8.ops.convert(model, fp8_weights=True) first"
            )
        data, scale_inv = tensors[name], tensors[name + SCALE_SUFFIX]
        if tuple(data.shape) != tuple(current.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(data.shape)}, model shape {tuple(current.shape)}")
        w = from_hub_blocks(data.to(current.device), scale_inv.to(current.device), current.dtype, name)
        replacements[name] = (current, torch.nn.Parameter(w, requires_grad=False))
    taken = fp8_names | {n + SCALE_SUFFIX for n in fp8_names}
    rest = {n: t for n, t in tensors.items() if n not in taken and n in state}
    unused += [n for n in tensors if n not in taken and n not in state]
    for name, t in rest.items():
        if isinstance(state[name], Float8Tensor):
            raise ValueError(
                f"{name}: the model's weight is FP8, the checkpoint's is {t.dtype} (a layer the checkpoint keeps in "
                "high precision): leave it out of the conversion (ops.convert's filter_fn), or load into a model "
                "converted without fp8_weights"
            )
    if strict:
        loaded = set(replacements) | set(rest)
        tied = _tied_names(model)
        own = _quantizer_state_names(model)
        missing = [n for n in state if n not in loaded and n not in own and not (tied.get(n, set()) & loaded)]
        if missing or unused:
            raise ValueError(
                f"load_checkpoint({directory!r}): the model's {missing} are not in the checkpoint; the checkpoint's "
                f"{unused} are not in the model (strict=False loads the rest)"
            )
    owners: Dict[int, list] = {}  # parameter -> every (module, attribute) holding it: tied weights stay tied
    for module in model.modules():
        for attr, p in module._parameters.items():
            owners.setdefault(id(p), []).append((module, attr))
    for old, new in replacements.values():
        for module, attr in owners[id(old)]:
            setattr(module, attr, new)
    model.load_state_dict(rest, strict=False)


def _quantizer_state_names(model: torch.nn.Module) -> set:
    """The state keys of float8's own quantizers in the model (delayed-scaling histories, calibrated input
    scales): not part of the hub layout; a loaded model keeps (or starts afresh) its own."""
    from float8.quantizer import Quantizer

    prefixes = [name + "." for name, m in model.named_modules() if isinstance(m, Quantizer) and name]
    return {k for k in model.state_dict() if any(k.startswith(p) for p in prefixes)}


def _is_param(model, name) -> bool:
    module_name, _, attr = name.rpartition(".")
    return attr in model.get_submodule(module_name)._parameters


def _tied_names(model) -> Dict[str, set]:
    """name -> the other names of the same parameter (tied weights)."""
    by_id: Dict[int, set] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), set()).add(name)
    return {n: names - {n} for names in by_id.values() for n in names}


def enable_save_pretrained(model: torch.nn.Module) -> bool:
    """Make a Hugging Face model's `save_pretrained` write the hub FP8 layout (what save_checkpoint writes),
    the way transformers' own quantized models do: it sets `model.hf_quantizer` (transformers asks it for the
    state dict to save) and `model.config.quantization_config`. ops.convert(fp8_weights=True) calls it.
    Returns False, touching nothing, for a model that is not a transformers PreTrainedModel, when
    transformers is not installed, or when the model already has a quantizer of another kind."""
    if not callable(getattr(model, "save_pretrained", None)) or getattr(model, "config", None) is None:
        return False
    try:
        from float8.hf_quantizer import Float8HubQuantizer
    except ImportError:  # transformers is not installed
        return False
    current = getattr(model, "hf_quantizer", None)
    if current is not None and not isinstance(current, Float8HubQuantizer):
        return False
    model.hf_quantizer = Float8HubQuantizer()
    model.config.quantization_config = quantization_config(model)
    return True
