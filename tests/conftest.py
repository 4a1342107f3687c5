"""Test-wide setup: the Triton interpreter on CPU-only machines, and the `gpu` marker.

Without CUDA, TRITON_INTERPRET=1 lets the Triton launchers run on CPU tensors (with numpy). Triton reads
it when @triton.jit decorates (its own tl.* helpers included), so it is set here, before test modules
import triton or float8. Tests marked @pytest.mark.gpu are skipped, saying why, where there is no CUDA.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # Here, not in pyproject's filterwarnings: pytest imports the categories named there before it loads any
    # conftest, which would import float8 (and triton) before TRITON_INTERPRET is set above.
    config.addinivalue_line("filterwarnings", "error::float8.tensor.Float8FallbackWarning")


_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory(request):
    """After each GPU test under xdist (the GPU tier runs 6 workers on one GPU), hand the memory the caching
    allocator kept back to the device: a neighbour's cuBLAS allocates its handle's workspace outside its
    allocator and failed with CUBLAS_STATUS_ALLOC_FAILED in 2 tests of the tier of 2026-11-26 while other
    workers held their caches. (A fixed share of the GPU per worker was tried first: the SwiGLU tests at
    the MLP block's shape need more than a sixth of an H100 and ran out of memory.)"""
    yield
    if _WORKERS > 1 and "gpu" in request.keywords and torch.cuda.is_available():
        torch.cuda.empty_cache()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (GPU tier: run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
