"""An MLP block and a transformer layer built from ops train to the bf16 loss (within 2%) on a synthetic task.

Both sides keep float32 master weights and compute in bfloat16; the FP8 side runs its GEMMs in FP8
(HYBRID: E4M3 forward, E5M2 gradients). Same initial weights, same batches, same optimizer.
"""

import copy

import torch
import torch.nn.functional as F

import float8.ops as ops

D, FFN, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 4, 2, 16
BATCH, SEQ, STEPS = 4, 32, 300


def mlp_ops():
    """RMSNorm -> Linear -> SwiGLU -> Linear on a residual branch."""
    return [
        ops.Residual(),
        ops.RMSNorm(D),
        ops.Linear(D, 2 * FFN, bias=False),
        ops.SwiGLU(),
        ops.Linear(FFN, D, bias=False),
        ops.AddResidual(),
    ]


def mlp_block():
    return ops.Sequential(*mlp_ops())


def transformer_layer():
    return ops.Sequential(
        ops.Residual(),
        ops.RMSNorm(D),
        ops.Linear(D, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False),
        ops.Attention(HEADS, HEAD_DIM, num_kv_heads=KV_HEADS, causal=True),
        ops.Linear(HEADS * HEAD_DIM, D, bias=False),
        ops.AddResidual(),
        *mlp_ops(),
    )


def bf16_reference(seq: ops.Sequential):
    """The same block as plain PyTorch in bfloat16 (weights cast from the float32 masters on each use)."""

    def forward(x):
        stack = []
        for op in seq:
            if isinstance(op, ops.Residual):
                stack.append(x)
            elif isinstance(op, ops.AddResidual):
                x = x + stack.pop()
            elif isinstance(op, ops.RMSNorm):
                x = F.rms_norm(x.float(), (D,), op.weight, op.eps).to(x.dtype)
            elif isinstance(op, ops.Linear):
                x = F.linear(x, op.weight.to(x.dtype))
            elif isinstance(op, ops.SwiGLU):
                a, b = x.chunk(2, dim=-1)
                x = F.silu(a) * b
            elif isinstance(op, ops.Attention):
                b, s, _ = x.shape
                qkv = x.reshape(b, s, HEADS + 2 * KV_HEADS, HEAD_DIM).transpose(1, 2)
                q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
                k = k.repeat_interleave(HEADS // KV_HEADS, 1)
                v = v.repeat_interleave(HEADS // KV_HEADS, 1)
                x = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        return x

    return forward


def train(model_fn, params, data):
    opt = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0)
    losses = []
    for x, target in data:
        loss = F.mse_loss(model_fn(x).float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-20:]) / 20, losses[0]


def synthetic_task(block, seed):
    """Targets from a fixed random 'teacher' block of the same shape: learnable, not trivial."""
    torch.manual_seed(seed)
    teacher = bf16_reference(block())
    data = []
    with torch.no_grad():
        for _ in range(STEPS):
            x = torch.randn(BATCH, SEQ, D).to(torch.bfloat16)
            data.append((x, teacher(x).float()))
    return data


def check_block(block, seed):
    data = synthetic_task(block, seed)
    torch.manual_seed(seed + 1)
    fp8_model = block()
    ref_model = copy.deepcopy(fp8_model)
    fp8_final, first = train(fp8_model, fp8_model.parameters(), data)
    ref_final, _ = train(bf16_reference(ref_model), ref_model.parameters(), data)
    assert ref_final < 0.5 * first, "the task must be learnable for the comparison to mean anything"
    assert abs(fp8_final - ref_final) <= 0.02 * ref_final, (fp8_final, ref_final)


def test_mlp_block_trains_to_the_bf16_loss():
    check_block(mlp_block, 0)


def test_transformer_layer_trains_to_the_bf16_loss():
    check_block(transformer_layer, 1)


def test_activation_checkpointing_gives_the_same_gradients():
    """torch.utils.checkpoint around an ops block (both implementations): the backward recomputes the
    forward and gets the gradients of the plain run to the bit (the run saves its parameters for autograd,
    ops/runner.py, which the non-reentrant checkpoint repacks and checks by count)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = ops.Sequential(ops.RMSNorm(64), ops.Linear(64, 128), ops.GELU(), ops.Linear(128, 64)).to(torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16)

    def grads(fn):
        block.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        fn(leaf).float().pow(2).sum().backward()
        return [leaf.grad] + [p.grad for p in block.parameters()]

    plain = grads(block)
    for reentrant in (False, True):
        got = grads(lambda t: checkpoint(block, t, use_reentrant=reentrant))
        assert all(torch.equal(a, b) for a, b in zip(plain, got)), reentrant
