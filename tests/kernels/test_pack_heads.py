"""kernels/pack_heads.py: SDPA's q/k/v gradients packed into (tokens, features), high precision and FP8.

The Triton launcher runs on the interpreter here (bit for bit against its reference); the GPU tier repeats
the comparison on the hardware. The reference itself is checked against the plain torch expression.
"""

import pytest
import torch

from float8.kernels import pack_heads as ph

from .helpers import FP8, assert_outputs, make_x, needs_interpreter

CAST_T = ("data", "data_t", "scale_inv", "amax")
SCALE = torch.tensor([0.37])


def parts_for(heads=(4, 2, 2), b=2, s=5, d=8, dtype=torch.bfloat16, layout="head_major", specials=False, device="cpu"):
    """Head-major (B, H, S, D) parts laid out as SDPA may hand them back:
    head_major: contiguous (B, H, S, D); token_major: contiguous (B, S, H, D), permuted;
    packed: views into one packed (B, S, sum(H), D) tensor (not dense: the amax pass copies)."""
    if layout == "packed":
        whole = make_x((b, s, sum(heads), d), dtype, specials=specials, device=device).transpose(1, 2)
        return list(whole.split(list(heads), dim=1))
    out = []
    for i, h in enumerate(heads):
        if layout == "head_major":
            out.append(make_x((b, h, s, d), dtype, seed=i, specials=specials, device=device))
        else:
            out.append(make_x((b, s, h, d), dtype, seed=i, specials=specials, device=device).transpose(1, 2))
    return out


def torch_packed(parts, sequence_first):
    perm = (2, 0, 1, 3) if sequence_first else (0, 2, 1, 3)
    cat = torch.cat([p.permute(*perm) for p in parts], dim=2)
    return cat.reshape(cat.shape[0] * cat.shape[1], -1)


@pytest.mark.parametrize("sequence_first", [False, True])
@pytest.mark.parametrize("layout", ["head_major", "token_major", "packed"])
def test_pack_heads_is_the_torch_expression(sequence_first, layout):
    parts = parts_for(layout=layout)
    out = ph.pack_heads(parts, sequence_first)
    assert out.is_contiguous()
    assert torch.equal(out, torch_packed(parts, sequence_first))


@pytest.mark.parametrize("with_transpose", [True, False])
def test_reference_is_quantize_of_the_packed_matrix(with_transpose):
    parts = parts_for()
    ours = ph.pack_heads_fp8_ref(parts, False, torch.float8_e4m3fn, None, 1, True, with_transpose)
    from float8.kernels.reference import quantize_tensorwise_ref

    ref = quantize_tensorwise_ref(torch_packed(parts, False), torch.float8_e4m3fn, None, 1, True, with_transpose)
    for a, b in zip(ours, ref):
        assert torch.equal(
            a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b
        )


@needs_interpreter
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("layout", ["head_major", "token_major", "packed"])
@pytest.mark.parametrize("sequence_first", [False, True])
@pytest.mark.parametrize("scale", [None, SCALE])
def test_triton_matches_reference(fp8_dtype, layout, sequence_first, scale):
    parts = parts_for(layout=layout, specials=scale is not None)
    args = (parts, sequence_first, fp8_dtype, scale, 0, False, True)
    assert_outputs(ph.pack_heads_fp8_triton(*args), ph.pack_heads_fp8_ref(*args), CAST_T)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_several_tiles_no_transpose(dtype):
    # 70 tokens (two row tiles, the second partial) and heads of 64 (two heads per column tile).
    parts = parts_for(heads=(3, 1, 1), b=1, s=70, d=64, dtype=dtype)
    args = (parts, False, torch.float8_e4m3fn, None, 2, True, False)
    ours, ref = ph.pack_heads_fp8_triton(*args), ph.pack_heads_fp8_ref(*args)
    assert ours[1].shape == (0,)
    assert_outputs(ours, ref, CAST_T)


@needs_interpreter
def test_triton_nan_anywhere_gives_nan_scale():
    parts = parts_for()
    parts[2] = parts[2].clone()
    parts[2][1, 1, 4, 7] = float("nan")
    data, _, scale_inv, amax = ph.pack_heads_fp8_triton(parts, False, torch.float8_e4m3fn)
    assert amax.isnan() and scale_inv.isnan()
    assert data.float().isnan().all()


def test_op_dispatches_and_checks():
    parts = parts_for()
    data, data_t, scale_inv, amax = ph.pack_heads_fp8(parts, False, torch.float8_e4m3fn)
    assert data.shape == (10, 64) and data_t.shape == (64, 10)
    with pytest.raises(ValueError, match="head size"):
        ph.pack_heads_fp8([parts[0], parts[1][..., :4]], False, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="4-D"):
        ph.pack_heads([parts[0][0]], False)
    with pytest.raises(TypeError, match="already FP8"):
        ph.pack_heads_fp8([parts[0].to(torch.float8_e4m3fn)], False, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="non-empty"):
        ph.pack_heads([], False)
    from float8 import Float8Tensor

    with pytest.raises(TypeError, match="Float8Tensor; pass plain tensors"):
        ph.pack_heads_fp8([Float8Tensor.quantize(parts[0])], False, torch.float8_e4m3fn)


def test_op_opcheck():
    parts = parts_for(dtype=torch.float32)
    torch.library.opcheck(ph.pack_heads_fp8.op, (parts, True, torch.float8_e5m2), {"scale": torch.tensor([2.0])})


@pytest.mark.gpu
@pytest.mark.parametrize("sequence_first", [False, True])
@pytest.mark.parametrize("scale", [None, "given"])
def test_gpu_sdpa_gradients_bit_exact(sequence_first, scale):
    # The gradients SDPA's backward really hands back (GQA, bf16, its own layouts), packed on the GPU against
    # the reference on the same CUDA tensors; tiles cover partial rows and several heads.
    torch.manual_seed(0)
    b, s, h, hk, d = 2, 200, 8, 2, 128
    qkv = torch.randn(b, s, h + 2 * hk, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    q, k, v = (t.detach().requires_grad_(True) for t in qkv.split([h, hk, hk], dim=1))
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grads = list(torch.autograd.grad(o, (q, k, v), torch.randn_like(o)))
    given = torch.tensor([3.0], device="cuda") if scale else None
    for fp8_dtype in FP8:
        args = (grads, sequence_first, fp8_dtype, given, 1, True, True)
        ours, ref = ph.pack_heads_fp8_triton(*args), ph.pack_heads_fp8_ref(*args)
        assert_outputs(ours, ref, CAST_T)
    assert torch.equal(ph.pack_heads(grads, sequence_first), torch_packed(grads, sequence_first))


@needs_interpreter
@pytest.mark.parametrize("sequence_first", [False, True])
def test_attention_op_runs_the_launcher_bit_exact(sequence_first, monkeypatch):
    # Inside ops.Attention's backward, the Triton launcher (on the interpreter, whose FP8 conversions this
    # folder's conftest makes hardware-faithful) gives the unfused run's bits.
    import float8.ops as ops

    monkeypatch.setattr(ph, "use_triton", lambda x, writes_fp8=True: True)
    x, dy = torch.randn(4, 6, 64, dtype=torch.bfloat16), torch.randn(4, 6, 64, dtype=torch.bfloat16)
    runs = []
    for fuse in (True, False):
        torch.manual_seed(0)
        seq = ops.Sequential(
            ops.Linear(64, 128, bias=False),
            ops.Attention(4, 16, num_kv_heads=2, sequence_first=sequence_first),
            ops.Linear(64, 64, bias=False),
            fuse=fuse,
        ).to(torch.bfloat16)
        xi = x.clone().requires_grad_(True)
        seq(xi).backward(dy)
        runs.append([xi.grad] + [p.grad for p in seq.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
