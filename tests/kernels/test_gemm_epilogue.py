"""The Triton FP8 GEMM with a fused bias/activation/amax epilogue (benchmarks/gemm_epilogue.py) against its
float64 reference: under the interpreter on odd shapes and partial tiles, and on the GPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks import gemm_epilogue as G

from .helpers import needs_interpreter

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
SMALL_TILE = (16, 32, 32, 2, 4, 2)  # partial tiles in every dimension of the shapes below


def operands(m, k, n, device="cpu", b_dtype=E4M3, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 2).to(E4M3).to(device)
    b = torch.randn(n, k, generator=g).to(b_dtype).to(device).t()  # column-major, as a weight viewed .t()
    sa, sb = torch.tensor(0.37, device=device), torch.tensor(1.9, device=device)
    bb = torch.randn(n, generator=g).to(BF16).to(device) if bias else None
    return a, sa, b, sb, bb


def assert_close_to_ref(y, amax, ref_y, ref_amax):
    # The reference accumulates in float64. The kernel's FP8 tensor cores keep fewer bits than float32
    # between promotions (every 64-128 products of K): y agrees to one bf16 step of the output's scale,
    # amax to 2**-13 relative (measured on the H100: 1.5e-5 at K = 1024 with 64-product windows).
    assert y.dtype == BF16 and y.shape == ref_y.shape
    scale = ref_y.float().abs().max().clamp_min(1.0)
    err = (y.float() - ref_y.float()).abs().max()
    assert err <= scale * 2.0**-7, f"y differs by {err.item()} (scale {scale.item()})"
    assert amax.dtype == torch.float32 and amax.shape == ()
    torch.testing.assert_close(amax.cpu(), ref_amax.float().cpu(), rtol=2.0**-13, atol=1e-6)


@needs_interpreter
@pytest.mark.parametrize("kind", ["identity", "relu", "gelu", "silu"])
@pytest.mark.parametrize("shape, b_dtype, bias", [((37, 80, 50), E4M3, True), ((64, 96, 33), E5M2, False)])
def test_kernel_against_reference(kind, shape, b_dtype, bias):
    a, sa, b, sb, bb = operands(*shape, b_dtype=b_dtype, bias=bias)
    y, amax = G.gemm_epilogue_triton(a, sa, b, sb, bb, kind, SMALL_TILE)
    assert_close_to_ref(y, amax, *G.gemm_epilogue_ref(a, sa, b, sb, bb, kind))


def test_public_entry_on_cpu_is_the_reference():
    a, sa, b, sb, bb = operands(20, 48, 24)
    for got, want in zip(G.gemm_epilogue(a, sa, b, sb, bb, "gelu"), G.gemm_epilogue_ref(a, sa, b, sb, bb, "gelu")):
        assert torch.equal(got, want)


def test_bad_input():
    a, sa, b, sb, bb = operands(16, 32, 16)
    with pytest.raises(ValueError, match="do not chain"):
        G.gemm_epilogue(a, sa, b[:16], sb)
    with pytest.raises(TypeError, match="must be FP8"):
        G.gemm_epilogue(a.float(), sa, b, sb)
    with pytest.raises(ValueError, match="column-major"):
        G.gemm_epilogue(a, sa, b.contiguous(), sb)
    with pytest.raises(ValueError, match="kind"):
        G.gemm_epilogue(a, sa, b, sb, kind="swiglu")
    with pytest.raises(ValueError, match="bias must be"):
        G.gemm_epilogue(a, sa, b, sb, bb[:8])
    with pytest.raises(ValueError, match="per-tensor"):
        G.gemm_epilogue(a, sa.expand(16, 1), b, sb)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("config", G.CONFIGS, ids=lambda c: "x".join(map(str, c)))
def test_cuda_configs_against_reference(config):
    a, sa, b, sb, bb = operands(1000, 1024, 777, device="cuda")
    y, amax = G.gemm_epilogue(a, sa, b, sb, bb, "gelu", config=config)
    assert_close_to_ref(y, amax, *G.gemm_epilogue_ref(a, sa, b, sb, bb, "gelu"))
