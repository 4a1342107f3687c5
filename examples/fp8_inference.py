"""FP8-only weights for inference: 1 byte per parameter, no transposes, no high-precision copy.

Users of the incumbents found that FP8 did not shrink their models: the weights stayed in bf16 and a
transpose was allocated for a backward pass that never came. Here the weights themselves are FP8.

    python examples/fp8_inference.py
"""

import io

import torch

import float8.ops as ops
from float8 import Float8Tensor, Recipe

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
D, F = 512, 2048


def tensor_bytes(t: torch.Tensor) -> int:
    if isinstance(t, Float8Tensor):
        parts = [t.fp8_data, t.scale_inv] + ([t.transpose_cache] if t.transpose_cache is not None else [])
        return sum(p.numel() * p.element_size() for p in parts)
    return t.numel() * t.element_size()


def model_bytes(model: torch.nn.Module) -> int:
    return sum(tensor_bytes(p) for p in model.parameters())


model = ops.Sequential(
    ops.RMSNorm(D),
    ops.Linear(D, 2 * F, bias=False),
    ops.SwiGLU(),
    ops.Linear(F, D, bias=False),
    recipe=Recipe(min_fp8_gemm_flops=0),  # layers this small would otherwise stay bf16 on a GPU
).to(device, torch.bfloat16)
x = torch.randn(4, 128, D, device=device, dtype=torch.bfloat16)
with torch.inference_mode():
    y_bf16_weights = model(x)  # FP8 GEMMs already; the FP8 weight copies are made from bf16 masters
    norm, up, _, down = model
    a, b = torch.nn.functional.linear(torch.nn.functional.rms_norm(x, (D,), norm.weight, norm.eps), up.weight).chunk(
        2, -1
    )
    y_plain_bf16 = torch.nn.functional.linear(torch.nn.functional.silu(a) * b, down.weight)  # no FP8 at all
before = model_bytes(model)

# Make every Linear weight FP8, in place of the bf16 one (the bf16 tensor is freed).
with torch.no_grad():
    for op in model:
        if isinstance(op, ops.Linear):
            op.weight = torch.nn.Parameter(Float8Tensor.quantize(op.weight), requires_grad=False)
after = model_bytes(model)
print(
    f"parameters: {before / 2**20:.2f} MiB in bf16 -> {after / 2**20:.2f} MiB with FP8 weights ({before / after:.2f}x smaller)"
)

with torch.inference_mode():
    y = model(x)
linears = [op for op in model if isinstance(op, ops.Linear)]
print(f"transposes allocated for inference: {sum(op.weight.transpose_cache is not None for op in linears)}")
print(f"same output as with bf16 master weights (the same FP8 bits): {torch.equal(y, y_bf16_weights)}")
ref = y_plain_bf16.double()
sqnr = 10 * torch.log10(ref.pow(2).sum() / (ref - y.double()).pow(2).sum())
print(f"output against plain bf16 (no FP8): SQNR {sqnr.item():.1f} dB")

buf = io.BytesIO()
torch.save(model.state_dict(), buf)
print(f"state_dict on disk: {buf.tell() / 2**20:.2f} MiB; loads with torch.load(weights_only=True)")
buf.seek(0)
state = torch.load(buf, weights_only=True)
assert all(
    isinstance(state[f"ops.{i}.weight"], Float8Tensor) for i, op in enumerate(model) if isinstance(op, ops.Linear)
)
