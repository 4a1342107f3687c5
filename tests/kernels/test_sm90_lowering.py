"""Every kernel specialization the launchers use compiles for Hopper (sm_90) — checked on the CPU tier, no GPU.

tests/kernels/sm90_lowering.py compiles them with Triton's NVIDIA backend (ptxas ships in the triton wheel);
here we read the PTX for what the numerics rely on: IEEE division for scales (div.rn.f32, never Triton's
default div.full.f32), the satfinite FP8 cast, integer atomics for the NaN-keeping amax, no spills to local
memory, and 16-byte vector loads/stores on aligned inputs. On a CUDA machine the GPU tier compiles and runs
the kernels for real, so this is skipped there.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _nvidia_backend_available() -> bool:
    try:
        from triton.backends import backends

        return "nvidia" in backends
    except Exception:
        return False


@pytest.fixture(scope="module")
def lowered():
    if torch.cuda.is_available():
        pytest.skip("CUDA machine: the GPU tier compiles and runs the kernels for real")
    if not _nvidia_backend_available():
        pytest.skip("this triton has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # 3.9 warns when unset; 1 is the default it keeps
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_lowering"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


WRITES_FP8 = {
    "_cast_kernel",
    "_cast_transpose_kernel",
    "_rowwise_kernel",
    "_block2d_kernel",
    "_quantize_small_kernel",
    "_quantize_transpose_small_kernel",
    "_multi_cast_flat_kernel",
    "_multi_cast_kernel",
}
ONE_PROGRAM = {"_quantize_small_kernel", "_quantize_transpose_small_kernel"}  # amax written, never atomically


def test_every_launch_compiled(lowered):
    kernels = {r["kernel"] for r in lowered}
    assert kernels == WRITES_FP8 | {"_amax_kernel", "_multi_amax_kernel", "_dequantize_kernel"}


def test_numerics_in_ptx(lowered):
    for r in lowered:
        c, what = r["counts"], f"{r['kernel']} {r['constexprs']}"
        assert c["div_inexact"] == 0, f"{what}: div.full/div.approx (not IEEE) in the PTX"
        assert c["float_atomic"] == 0, f"{what}: a float atomic (drops NaN)"
        assert c["local"] == 0, f"{what}: local memory (spills)"
        if r["kernel"] in WRITES_FP8:
            assert c["cvt_satfinite"] > 0, f"{what}: no cvt.rn.satfinite FP8 cast"
            assert c["div_rn"] > 0, f"{what}: scale_inv not computed with div.rn.f32"
        if r["kernel"] in ("_amax_kernel", "_multi_amax_kernel") or r["constexprs"].get("WITH_AMAX") == "True":
            assert c["int_max_atomic"] == 1, f"{what}: amax not folded with one integer atomic max"
        if r["kernel"] in ONE_PROGRAM:
            assert c["int_max_atomic"] == 0, f"{what}: an atomic in the one-program kernel"


def test_vectorized_on_aligned_inputs(lowered):
    for r in lowered:
        if r["kernel"] == "_rowwise_kernel" and r["constexprs"]["SINGLE"] == "False":
            continue  # recorded on rows of 9000 (not a multiple of 16 elements): scalar accesses are right there
        if r["kernel"] == "_multi_cast_kernel":
            continue  # tiles of tensors whose row length it reads from a table: the transposing path, not vectorized
        c, what = r["counts"], f"{r['kernel']} {r['constexprs']}"
        assert c["ld_v4"] > 0, f"{what}: no 16-byte vector loads"
        if r["kernel"] not in ("_amax_kernel", "_multi_amax_kernel"):
            assert c["st_v4"] > 0, f"{what}: no 16-byte vector stores"
