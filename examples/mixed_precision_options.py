"""Pure bf16, fp32 master + bf16 compute, both copies, or FP8 compute: memory, step time and loss.

Users ask which to pick (seed TE #950). The same small MLP regression task, four ways, AdamW:
- pure bf16: bf16 parameters, gradients and optimizer states (2+2+4 bytes per parameter); updates below
  half a bf16 ulp of a weight are rounded away;
- fp32 master + bf16 compute: fp32 parameters, bf16 activations under autocast (4+4+8 bytes);
- both copies: a bf16 model for compute and an fp32 master copy that the optimizer updates, copied back
  after each step (2+2 bf16 + 4+8 fp32 master/states, plus a 4-byte fp32 gradient copy per step);
- FP8 compute: float8.ops with fp32 masters, bf16 activations and FP8 GEMMs (4+4+8 bytes; the FP8 weight
  copy lives only inside a step).
Prints a table; writes mixed_precision_options.png when matplotlib is installed.

    python examples/mixed_precision_options.py
"""

import time

import torch
import torch.nn.functional as F

import float8.ops as ops
from float8 import Recipe, memory_footprint

cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
D, FFN, TOKENS, STEPS, LR = (1024, 4096, 8192, 200, 3e-5) if cuda else (128, 256, 256, 60, 3e-5)
torch.manual_seed(0)
x = torch.randn(TOKENS, D, device=device, dtype=torch.bfloat16)
teacher = torch.randn(D, D, device=device) / D**0.5
target = (x.float() @ teacher).tanh()


def torch_mlp(dtype):
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(D, FFN, bias=False), torch.nn.GELU(), torch.nn.Linear(FFN, D, bias=False)
    ).to(device, dtype)


def fp8_mlp():
    return ops.convert(torch_mlp(torch.float32), recipe=Recipe(min_fp8_gemm_flops=0))


def run(name):
    model = (
        fp8_mlp()
        if name == "FP8 compute"
        else torch_mlp(torch.bfloat16 if name in ("pure bf16", "both copies") else torch.float32)
    )
    master = (
        [p.detach().float().clone().requires_grad_(True) for p in model.parameters()] if name == "both copies" else None
    )
    opt = torch.optim.AdamW(master or model.parameters(), lr=LR, weight_decay=0.0)
    losses = []

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=name == "fp32 master + bf16 compute"):
            loss = F.mse_loss(model(x).float(), target)
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        loss.backward()
        if master is not None:
            for m, p in zip(master, model.parameters()):
                m.grad = p.grad.float()
        opt.step()
        if master is not None:
            with torch.no_grad():
                for m, p in zip(master, model.parameters()):
                    p.copy_(m)
        return loss

    losses.append(step().item())  # the first step warms up (allocations, Triton compiles): not timed
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(1, STEPS):
        losses.append(step().item())
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / (STEPS - 1)
    held = memory_footprint(model) + (sum(m.numel() * m.element_size() for m in master) if master else 0)
    states = sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
    )
    return {"losses": losses, "ms": ms, "param_MiB": held / 2**20, "state_MiB": states / 2**20}


results = {name: run(name) for name in ("pure bf16", "fp32 master + bf16 compute", "both copies", "FP8 compute")}
print(f"MLP {D}->{FFN}->{D}, {TOKENS} tokens, AdamW lr {LR}, {STEPS} steps, {device}")
print(f"{'option':28s} {'params MiB':>10s} {'Adam MiB':>9s} {'ms/step':>8s} {'loss first':>11s} {'loss last':>10s}")
for name, r in results.items():
    print(
        f"{name:28s} {r['param_MiB']:10.2f} {r['state_MiB']:9.2f} {r['ms']:8.2f} {r['losses'][0]:11.5f} {r['losses'][-1]:10.5f}"
    )
print("params: the weights held (both copies: bf16 model + fp32 masters); Adam: the optimizer's two moments")
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in results.items():
        ax.plot(r["losses"], label=f"{name} ({r['param_MiB'] + r['state_MiB']:.1f} MiB)")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig("mixed_precision_options.png", dpi=120)
    print("wrote mixed_precision_options.png")
except ImportError:
    print("matplotlib not installed: no plot")
