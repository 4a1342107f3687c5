"""Weights and peak memory of a Hugging Face model for inference: bf16, FP8 GEMMs, FP8-only weights.

Users of the incumbents found that FP8 did not shrink their model: the weights stayed bf16, FP8 copies
and transposes stayed alive. Here a LlamaForCausalLM built from a config (nothing downloaded) is converted
with float8.ops.convert, and its bytes are counted with float8.memory_footprint (Hugging Face's
get_memory_footprint() counts an FP8 weight at its nominal 2 bytes).

    python examples/inference_memory.py        # a GPU: a ~1B-parameter config; a CPU: a tiny one
"""

import torch

import float8.ops as ops
from float8 import Float8Tensor, Recipe, memory_footprint

try:
    import transformers
except ImportError:  # transformers is in the test extra
    raise SystemExit("this example needs transformers: pip install transformers") from None

cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
size = (
    dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32768,
    )
    if cuda
    else dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    )
)
cfg = transformers.LlamaConfig(**size, max_position_embeddings=4096, tie_word_embeddings=False)
tokens = torch.randint(0, cfg.vocab_size, (1, 1024 if cuda else 64), device=device)


def build():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device, torch.bfloat16).eval()


def peak_forward_mib(model):
    if not cuda:  # the CPU has no peak-memory counter: the column says so instead of printing nan
        with torch.no_grad():
            model(tokens)
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model(tokens)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def transposes(model):
    return sum(isinstance(p, Float8Tensor) and p.transpose_cache is not None for p in model.parameters())


rows = []
model = build()
with torch.no_grad():
    ref = model(tokens).logits.float()
rows.append(
    ("bf16", memory_footprint(model), model.get_memory_footprint(), peak_forward_mib(model), transposes(model), 0.0)
)

ops.convert(model, recipe=Recipe(min_fp8_gemm_flops=0))  # FP8 GEMMs, bf16 weights (+ cached FP8 copies)
peak = peak_forward_mib(model)
with torch.no_grad():
    out = model(tokens).logits.float()
rel = ((out - ref).norm() / ref.norm()).item()
rows.append(
    ("FP8 GEMMs, bf16 weights", memory_footprint(model), model.get_memory_footprint(), peak, transposes(model), rel)
)

ops.convert(model, fp8_weights=True)  # FP8-only weights: the bf16 weights and the cached copies are freed
peak = peak_forward_mib(model)
with torch.no_grad():
    out = model(tokens).logits.float()
rel = ((out - ref).norm() / ref.norm()).item()
rows.append(("FP8-only weights", memory_footprint(model), model.get_memory_footprint(), peak, transposes(model), rel))

params = sum(p.numel() for p in model.parameters())
print(f"LlamaForCausalLM from a config: {params / 1e6:.1f}M parameters, {tokens.shape[1]} tokens, {device}")
print(
    f"{'variant':26s} {'real MiB':>9s} {'HF MiB':>8s} {'fwd peak MiB':>13s} {'transposes':>11s} {'logits rel. err':>16s}"
)
for name, real, hf, peak, nt, err in rows:
    peak_text = "n/a on CPU" if peak is None else f"{peak:.1f}"
    print(f"{name:26s} {real / 2**20:9.1f} {hf / 2**20:8.1f} {peak_text:>13s} {nt:11d} {err:16.4f}")
print("real: float8.memory_footprint (FP8 bits, scales, transposes, cached FP8 copies); HF: get_memory_footprint()")
print(
    f"FP8-only weights hold {rows[2][1] / rows[0][1]:.2f}x the bytes of bf16 (the embedding, norms and every "
    "Linear's 4-byte scale stay)"
)
