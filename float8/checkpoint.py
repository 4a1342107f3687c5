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

The conversions between Float8Tensor weights and that layout, exact in both directions, are in
float8/hub_layout.py; this module writes and reads the files, and makes transformers' `save_pretrained`
write them too (`enable_save_pretrained`, through float8/hf_quantizer.py).
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict

import torch

from float8.hub_layout import HUB_BLOCK, SCALE_SUFFIX, _quantizer_state_names, from_hub_blocks, hub_state_dict
from float8.tensor import Float8Tensor

QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [HUB_BLOCK, HUB_BLOCK],
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

__all__ = [
    "QUANTIZATION_CONFIG",
    "enable_save_pretrained",
    "load_checkpoint",
    "quantization_config",
    "read_checkpoint",
    "save_checkpoint",
]


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as e:  # pragma: no cover - safetensors is a dependency; this names it if missing
        raise ImportError("float8 checkpoints need the safetensors package: pip install safetensors") from e
    return safetensors.torch


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
        name
        for name, m in model.named_modules()
        if hasattr(m, "in_features")
        and hasattr(m, "out_features")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and not isinstance(m.weight, Float8Tensor)
    ]
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
    if (
        q.get("quant_method") != "fp8"
        or q.get("fmt", "e4m3") != "e4m3"
        or list(q.get("weight_block_size") or []) != [128, 128]
    ):
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
    fp8_names = {
        n[: -len(SCALE_SUFFIX)] for n in tensors if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in tensors
    }
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
