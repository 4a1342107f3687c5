"""A tiny Hugging Face LlamaForCausalLM (2 layers, hidden 64, GQA 4/2, vocab 256) for the tests that convert
one, as users do: skipped where transformers is not installed."""

import pytest
import torch


def tiny_llama(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The model, its weights drawn after torch.manual_seed(0)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype)
