"""fp32 master weights with bf16 activations and FP8 GEMMs, against pure bf16 weights.

With bf16 weights, an optimizer update smaller than half a bf16 ulp of the weight (~0.2% of it) is rounded
away: small learning rates stop training. fp32 master weights keep every update; the FP8 copy used by the
GEMMs is re-made from the master once per step. The cost: 4 bytes per parameter instead of 2 (plus the
optimizer's states, the same either way).

    python examples/master_weights.py
"""

import torch
import torch.nn.functional as F

import float8.ops as ops
from float8 import Recipe

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
D, FFN, STEPS, LR = 128, 256, 60, 2e-5


def block(param_dtype):
    torch.manual_seed(1)  # the same initial weights for both
    seq = ops.Sequential(
        ops.RMSNorm(D),
        ops.Linear(D, 2 * FFN, bias=False),
        ops.SwiGLU(),
        ops.Linear(FFN, D, bias=False),
        recipe=Recipe(min_fp8_gemm_flops=0),  # FP8 GEMMs even at this small size, on a GPU too
    )
    return seq.to(device, param_dtype)


x = torch.randn(8, 64, D, device=device, dtype=torch.bfloat16)
target = torch.randn(8, 64, D, device=device) * 0.5
results = {}
for name, dtype in (("fp32 master weights", torch.float32), ("bf16 weights", torch.bfloat16)):
    model = block(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    start = [p.detach().float().clone() for p in model.parameters()]
    losses = []
    for step in range(STEPS):
        loss = F.mse_loss(model(x).float(), target)  # activations are bf16 in both runs
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == STEPS - 1:
            print(f"  {name}: step {step:3d} loss {loss.item():.5f}")
    moved = sum(int((p.detach().float() != s).sum()) for p, s in zip(model.parameters(), start))
    total = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    results[name] = (losses[0] - losses[-1], moved / total, param_bytes)

print()
for name, (gain, moved, nbytes) in results.items():
    print(f"{name:20s} loss decrease {gain:.5f}, weights that changed {moved:6.1%}, parameters {nbytes / 1024:.0f} KiB")
fp32_gain, bf16_gain = results["fp32 master weights"][0], results["bf16 weights"][0]
print(f"at lr {LR}, fp32 masters reduce the loss {fp32_gain / max(bf16_gain, 1e-12):.1f}x as much as bf16 weights")
