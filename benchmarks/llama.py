"""A Llama-style model three ways, one set of shapes: plain PyTorch (bf16, and what torchao converts), the
same modules with float8's Linears (`ops.convert`, the form torch.compile takes), and blocks of float8 ops
(norms and activations writing FP8 for the Linear after them; eager only: ops.Attention does not compile).

Block: RMSNorm; QKV Linear; grouped-KV causal SDPA; output Linear; RMSNorm; SwiGLU FFN. Model: embedding,
blocks, final RMSNorm, LM head with cross-entropy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import float8.ops as ops
from benchmarks import distributed
from float8 import Recipe


@dataclass(frozen=True)
class LlamaShape:
    """Model and batch sizes."""

    d: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    blocks: int = 8
    vocab: int = 32768
    batch: int = 8
    seq: int = 2048
    # the plain-torch MLP with a gate and an up projection, as Hugging Face's Llama (benchmarks.distributed.Block)
    separate_gate_up: bool = False
    # q, k and v projections, as Hugging Face's Llama (one qkv projection otherwise)
    separate_qkv: bool = False


TINY = LlamaShape(d=64, heads=4, kv_heads=2, head_dim=16, ffn=128, blocks=2, vocab=256, batch=2, seq=32)


def Block(s: LlamaShape) -> torch.nn.Module:
    """One Llama block in plain PyTorch (the 2-GPU benchmark's, benchmarks/distributed.py)."""
    return distributed.Block(s.d, s.heads, s.kv_heads, s.head_dim, s.ffn, s.separate_gate_up, s.separate_qkv)


def ops_block(s: LlamaShape, recipe=None) -> torch.nn.Module:
    """The same block from float8 ops."""
    return distributed.ops_block(s.d, s.heads, s.kv_heads, s.head_dim, s.ffn, recipe)


class TorchHead(torch.nn.Module):
    """Final RMSNorm, LM head and cross-entropy in plain PyTorch (float32 logits, as F.cross_entropy wants)."""

    def __init__(self, s: LlamaShape):
        super().__init__()
        self.norm = torch.nn.RMSNorm(s.d, eps=1e-6)
        self.head = torch.nn.Linear(s.d, s.vocab, bias=False)

    def forward(self, x, target):
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1))


def ops_head(s: LlamaShape, recipe=None) -> torch.nn.Module:
    """Final RMSNorm and the fused FP8 linear + cross-entropy (no logits tensor)."""
    return ops.Sequential(ops.RMSNorm(s.d), ops.LinearCrossEntropy(s.d, s.vocab, bias=False, recipe=recipe or Recipe()))


class LlamaModel(torch.nn.Module):
    """Embedding, blocks, head; forward(tokens, target) returns the mean loss."""

    def __init__(self, s: LlamaShape, blocks, head):
        super().__init__()
        self.embed = torch.nn.Embedding(s.vocab, s.d)
        self.blocks = torch.nn.ModuleList(blocks)
        self.head = head

    def forward(self, tokens, target):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x, target)


def build(kind: str, s: LlamaShape, device, recipe=None, fuse_swiglu: bool = True) -> LlamaModel:
    """kind: "torch" (plain bf16), "converted" (plain modules, float8 Linears, fused FP8 head; fuse_swiglu:
    ops.convert's) or "ops" (blocks of float8 ops, fused FP8 head). bfloat16 parameters on `device`."""
    torch.manual_seed(0)
    with torch.device(device):
        if kind == "torch":
            model = LlamaModel(s, [Block(s) for _ in range(s.blocks)], TorchHead(s))
        elif kind == "converted":
            blocks = [ops.convert(Block(s), recipe=recipe, fuse_swiglu=fuse_swiglu) for _ in range(s.blocks)]
            model = LlamaModel(s, blocks, ops_head(s, recipe))
        elif kind == "ops":
            model = LlamaModel(s, [ops_block(s, recipe) for _ in range(s.blocks)], ops_head(s, recipe))
        else:
            raise ValueError(f"unknown model kind {kind!r}")
    return model.to(torch.bfloat16)


def compile_blocks(model: LlamaModel) -> LlamaModel:
    """torch.compile each block and the head (fullgraph): identical blocks share one compiled graph, so
    the compile time is one block's, not the model's."""
    for block in model.blocks:
        block.compile(fullgraph=True)
    model.head.compile(fullgraph=True)
    return model
