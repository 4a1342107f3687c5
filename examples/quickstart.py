"""float8 in five minutes, on a CPU or a GPU: quantize, multiply, save, train a block.

python examples/quickstart.py
"""

import io
import warnings

import torch

import float8.ops as ops
from float8 import Float8Tensor, Recipe, RowwiseScaling

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)


def sqnr_db(ref, approx):
    return float(10 * torch.log10(ref.double().pow(2).sum() / (ref.double() - approx.double()).pow(2).sum()))


# 1. A Float8Tensor carries FP8 bits and their scale-inverse, written by the same kernel.
x = torch.randn(256, 512, device=device, dtype=torch.bfloat16)
x8 = Float8Tensor.quantize(x)
print(x8)
print(f"  bits {x8.fp8_data.dtype}, scale_inv {x8.scale_inv.item():.3g}, {x8.fp8_data.element_size()} byte/element")
print(f"  quantize -> dequantize SQNR: {sqnr_db(x, x8.dequantize()):.1f} dB")

# 2. Products of Float8Tensors are FP8 GEMMs (cuBLASLt through torch._scaled_mm), output in bfloat16.
w8 = Float8Tensor.quantize(torch.randn(1024, 512, device=device, dtype=torch.bfloat16), scaling=RowwiseScaling())
y = x8 @ w8.t()
print(
    f"x8 @ w8.t(): {tuple(y.shape)} {y.dtype}, SQNR against bf16: {sqnr_db(x.float() @ w8.dequantize().float().t(), y):.1f} dB"
)

# 3. Views, slices and transposes stay FP8; a transpose is cached only when a backward pass will read it.
with torch.no_grad():
    inference_w = Float8Tensor.quantize(torch.randn(1024, 512, device=device), with_transpose=True)
print(f"transpose cache under no_grad: {inference_w.transpose_cache}  (none: inference pays 1 byte/param)")

# 4. Save and load with weights_only=True (the safe loader).
buf = io.BytesIO()
torch.save({"w": w8}, buf)
buf.seek(0)
loaded = torch.load(buf, weights_only=True)["w"]
print(
    f"saved and loaded: {type(loaded).__name__}, identical bits: {torch.equal(loaded.fp8_data.view(torch.uint8), w8.fp8_data.view(torch.uint8))}"
)

# 5. Ops: an MLP block whose norm and activation write FP8 for the next Linear, trained a few steps.
mlp = ops.Sequential(
    ops.Residual(),
    ops.RMSNorm(512),
    ops.Linear(512, 2 * 1024, bias=False),
    ops.SwiGLU(),
    ops.Linear(1024, 512, bias=False),
    ops.AddResidual(),
    recipe=Recipe(),  # HYBRID: E4M3 forward, E5M2 gradients, per-tensor current scaling
).to(device)
opt = torch.optim.AdamW(mlp.parameters(), lr=1e-3)  # float32 master weights, bf16 activations
target = torch.randn(8, 64, 512, device=device, dtype=torch.bfloat16) * 0.1
inputs = torch.randn(8, 64, 512, device=device, dtype=torch.bfloat16)
for step in range(5):
    loss = torch.nn.functional.mse_loss(mlp(inputs).float(), target.float() + inputs.float())
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step}: loss {loss.item():.4f}")

# 6. float32 activations into FP8 ops: a warning says what it costs and how to fix it.
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mlp(inputs.float())
print(f"float32 input -> {caught[0].category.__name__}: {str(caught[0].message)[:72]}...")
