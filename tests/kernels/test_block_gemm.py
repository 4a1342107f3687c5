"""fp8_block_mm: block-scaled FP8 x FP8 GEMM (1 x C activation blocks, R x C weight blocks) against its
float32 reference, on the interpreter and on the GPU."""

import pytest
import torch

import float8.kernels as K
from float8.kernels import block_gemm as B

from .helpers import needs_interpreter

E4M3 = torch.float8_e4m3fn


def _operands(m, k, n, s_rows, cols, bias=False, device="cpu", seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 100).clamp(-448, 448).to(E4M3)
    sa = torch.rand(m, k // cols, generator=g) * 1e-2 + 1e-3
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(E4M3)
    sw = torch.rand(n // s_rows, k // cols, generator=g) * 1e-3 + 1e-4
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(a), move(sa), move(w), move(sw), move(b)


def _close(got, want, a, sa, w, sw):
    """Within the float32 summation error of K products plus one ulp of the output dtype."""
    k, n = a.shape[1], w.shape[0]
    cols = k // sa.shape[1]
    da = a.double().cpu().abs() * sa.double().cpu().repeat_interleave(cols, 1)
    dw = w.double().cpu().abs() * sw.double().cpu().repeat_interleave(n // sw.shape[0], 0).repeat_interleave(cols, 1)
    allowed = 2 * k * 2.0**-24 * (da @ dw.t()) + torch.finfo(got.dtype).eps * want.double().cpu().abs()
    bad = ~((got.double().cpu() - want.double().cpu()).abs() <= allowed)
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outputs outside the summation-order bound"


# 128-wide blocks; a hub checkpoint's ragged dims refined (272 rows in blocks of 16, 576 columns of 64);
# narrow blocks; partial row and column tiles.
SHAPES = [(5, 256, 256, 128, 128), (130, 576, 272, 16, 64), (33, 128, 96, 32, 32), (1, 384, 128, 128, 128)]


@needs_interpreter
@pytest.mark.parametrize("group_m", [1, 3], ids=["row-major tiles", "grouped tiles"])
@pytest.mark.parametrize("m,k,n,s_rows,cols", SHAPES)
def test_kernel_matches_reference_on_the_interpreter(m, k, n, s_rows, cols, group_m):
    """Every output tile written once and right, whatever order the programs take them in (GROUP_M 3 with
    five row tiles leaves a last group of two)."""
    a, sa, w, sw, b = _operands(m, k, n, s_rows, cols, bias=True, dtype=torch.float16)
    got = B.fp8_block_mm_triton(a, sa, w, sw, b, torch.float16, config=(32, 32, 4, 2, group_m))
    _close(got, B.fp8_block_mm_ref(a, sa, w, sw, b, torch.float16), a, sa, w, sw)


def test_reference_is_the_blockwise_dequantized_product():
    a, sa, w, sw, _ = _operands(3, 256, 128, 64, 128)
    rows, ks = torch.arange(128) // 64, torch.arange(256) // 128
    want = (a.double() * sa.double()[:, ks]) @ (w.double() * sw.double()[rows][:, ks]).t()
    assert torch.allclose(
        B.fp8_block_mm_ref(a, sa, w, sw, out_dtype=torch.float16).double(), want, rtol=1e-3, atol=1e-3
    )


def test_op_on_cpu_is_the_reference_passes_opcheck_and_compiles():
    a, sa, w, sw, b = _operands(6, 256, 128, 128, 128, bias=True)
    assert torch.equal(K.fp8_block_mm(a, sa, w, sw, b), B.fp8_block_mm_ref(a, sa, w, sw, b))
    tests = ["test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    torch.library.opcheck(torch.ops.float8.fp8_block_mm.default, (a, sa, w, sw, b), test_utils=tests)
    f = torch.compile(lambda a, sa: K.fp8_block_mm(a, sa, w, sw, b), fullgraph=True, backend="aot_eager")
    assert torch.equal(f(a, sa), K.fp8_block_mm(a, sa, w, sw, b))


def test_non_finite_scales_propagate():
    a, sa, w, sw, _ = _operands(4, 256, 128, 128, 128)
    sw[0, 1] = float("nan")
    assert K.fp8_block_mm(a, sa, w, sw).isnan().all()  # every output reads block column 1 of the weight


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a, sa, w, sw: (a.float(), sa, w, sw), "FP8"),
        (lambda a, sa, w, sw: (a, sa[:, :1].contiguous(), w, sw), "scale-inverses"),  # other block widths
        (lambda a, sa, w, sw: (a, sa, w, torch.ones(3, 2)), "scale-inverses"),  # 3 does not divide 128 rows
        # a hub checkpoint's ceil-div grid for 200 rows, (2, 2): it divides 200, but blocks of 100 rows are
        # not what it means (128 rows, then 72); refused, not misread
        (lambda a, sa, w, sw: (a, sa, torch.zeros(200, 256, dtype=E4M3), torch.ones(2, 2)), "scale-inverses"),
    ],
)
def test_bad_input_names_the_problem(change, match):
    a, sa, w, sw, _ = _operands(4, 256, 128, 128, 128)
    with pytest.raises(ValueError, match=match):
        K.fp8_block_mm(*change(a, sa, w, sw))


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,s_rows,cols", SHAPES + [(512, 4096, 2048, 128, 128), (200, 2048, 1024, 128, 128)])
def test_gpu_matches_reference(m, k, n, s_rows, cols):
    a, sa, w, sw, b = _operands(m, k, n, s_rows, cols, bias=True, device="cuda")
    got = K.fp8_block_mm(a, sa, w, sw, b)
    _close(got, B.fp8_block_mm_ref(a.cpu(), sa.cpu(), w.cpu(), sw.cpu(), b.cpu()), a, sa, w, sw)
    assert torch.equal(got, K.fp8_block_mm(a, sa, w, sw, b))  # no NaN in these operands: equal means deterministic
