"""kernels/transpose.py: the FP8 transpose, interpreted and on the GPU, against data.t().contiguous(), bit
for bit; and the GEMM operands it serves (float8/gemm.py copies a layout an operand lacks through it)."""

from __future__ import annotations

import pytest
import torch

from float8 import Float8Tensor
from float8.kernels import transpose as tr

from .helpers import FP8, assert_bits, needs_interpreter

SHAPES = [(1, 1), (17, 33), (64, 128), (130, 257), (0, 5), (3, 0)]


def every_code(shape, fp8_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(fp8_dtype)  # NaN codes too


@needs_interpreter
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_launcher_moves_the_bits(shape, fp8_dtype):
    d = every_code(shape, fp8_dtype)
    out = tr.transpose_fp8_triton(d)
    assert_bits(out.view(torch.uint8), d.t().contiguous().view(torch.uint8), "transpose")
    assert out.dtype == fp8_dtype


@needs_interpreter
def test_launcher_takes_a_view():
    d = every_code((40, 80), torch.float8_e4m3fn)[3:30, 16:64]  # a non-contiguous slice
    assert_bits(tr.transpose_fp8_triton(d).view(torch.uint8), d.t().contiguous().view(torch.uint8), "transpose")


def test_op_on_cpu_is_the_reference_and_passes_opcheck():
    d = every_code((17, 33), torch.float8_e5m2)
    assert_bits(tr.transpose_fp8(d).view(torch.uint8), tr.transpose_fp8_ref(d).view(torch.uint8), "op")
    tests = ["test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]  # no FP8 CPU mul
    finite = torch.randn(17, 33).to(torch.float8_e5m2)  # opcheck compares with assert_close: NaN != NaN
    torch.library.opcheck(tr.transpose_fp8.op, (finite,), test_utils=tests)


@pytest.mark.parametrize("shape", [(1, 16), (16, 1), (0, 16)])
def test_a_transpose_that_needs_no_move_is_still_a_new_tensor(shape):
    # data.t().contiguous() of these shapes is a view of data: the registered op returned its input's memory
    # (opcheck's fake-tensor test refused it, and a write into one changed the other).
    d = torch.randn(*shape).to(torch.float8_e4m3fn)
    t = tr.transpose_fp8(d)
    assert t.shape == (shape[1], shape[0]) and t.is_contiguous()
    assert t.untyped_storage().data_ptr() != d.untyped_storage().data_ptr() or d.numel() == 0
    torch.library.opcheck(tr.transpose_fp8.op, (d,), test_utils=["test_faketensor"])


def test_bad_input():
    with pytest.raises(TypeError, match="FP8 tensor"):
        tr.transpose_fp8(torch.randn(4, 4))
    with pytest.raises(ValueError, match="2-D"):
        tr.transpose_fp8(torch.zeros(2, 3, 4, dtype=torch.float8_e4m3fn))


def test_gemm_with_a_rows_only_operand_matches_the_cached_transpose():
    # dW = dy^T x with dy in rows only (no transpose cache): the GEMM copies the layout through the kernel
    # and gives the bits of the same GEMM with the cache.
    torch.manual_seed(0)
    dy = torch.randn(64, 48, dtype=torch.bfloat16)
    x = torch.randn(64, 32, dtype=torch.bfloat16)
    with torch.enable_grad():
        dy8_t = Float8Tensor.quantize(dy, fp8_dtype=torch.float8_e5m2, with_transpose=True)
    dy8 = Float8Tensor.quantize(dy, fp8_dtype=torch.float8_e5m2)
    x8 = Float8Tensor.quantize(x)
    assert dy8.transpose_cache is None and dy8_t.transpose_cache is not None
    assert torch.equal(dy8.t() @ x8, dy8_t.t() @ x8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(1, 1), (130, 257), (16384, 14336)])
def test_cuda_moves_the_bits(shape):
    d = every_code(shape, torch.float8_e4m3fn).cuda()
    assert_bits(tr.transpose_fp8(d).view(torch.uint8), d.t().contiguous().view(torch.uint8), "transpose")
