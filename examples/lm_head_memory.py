"""A large-vocabulary LM head and its loss: naive `.float()` logits against the fused linear + cross-entropy.

Users of the incumbents found that `F.cross_entropy(logits.float(), t)` doubled peak memory: the bf16 logits
(tokens x vocab) are written, then copied to float32, and the backward writes their gradient too.
float8.ops.functional.linear_cross_entropy takes the tokens in chunks and never holds the whole logits.

    python examples/lm_head_memory.py          # a GPU: 8192 tokens, vocab 128256, hidden 4096; a CPU: tiny
"""

import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from float8 import Recipe
from float8.ops.functional import linear_cross_entropy

cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
N, H, V = (8192, 4096, 128256) if cuda else (512, 128, 8192)


class LargestTensor(TorchDispatchMode):
    """On a CPU (no allocator statistics): the largest tensor an operation creates, in bytes."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.nbytes = max(self.nbytes, o.numel() * o.element_size())
        return out


torch.manual_seed(0)
x = torch.randn(N, H, device=device, dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(V, H, device=device) * 0.02).to(torch.bfloat16).requires_grad_(True)
t = torch.randint(0, V, (N,), device=device)
variants = {
    "naive: F.cross_entropy(F.linear(x, w).float(), t)": lambda: F.cross_entropy(F.linear(x, w).float(), t),
    "fused, bf16 GEMMs": lambda: linear_cross_entropy(x, w, t),
    "fused, FP8 GEMMs": lambda: linear_cross_entropy(x, w, t, recipe=Recipe()),
}
print(f"{N} tokens, hidden {H}, vocab {V} ({device}); the logits are {N * V * 2 / 2**20:.0f} MiB in bf16")
print(f"{'variant':52s} {'loss':>8s} {'ms':>8s} {'memory MiB':>11s}")
for name, fn in variants.items():
    x.grad = w.grad = None
    fn().backward()  # warm-up (Triton compiles on first use)
    x.grad = w.grad = None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if cuda:
        loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        memory = (torch.cuda.max_memory_allocated() - base) / 2**20  # peak above the inputs
    else:
        with LargestTensor() as probe:
            loss = fn()
            loss.backward()
        memory = probe.nbytes / 2**20  # the largest single tensor
    ms = (time.perf_counter() - t0) * 1e3
    print(f"{name:52s} {loss.item():8.4f} {ms:8.1f} {memory:11.1f}")
print(
    "memory: "
    + ("peak allocated above the inputs, during forward+backward" if cuda else "largest tensor created (CPU)")
)
