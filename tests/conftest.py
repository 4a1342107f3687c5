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
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and torch.cuda.is_available():
        # The GPU tier runs 6 workers on one GPU. Each caching allocator keeps what it freed, so one worker
        # could hold the memory another's cuBLAS needs for its handle, which is allocated outside the
        # allocator (CUBLAS_STATUS_ALLOC_FAILED in 2 tests of the tier of 2026-11-26). A share of the GPU
        # per worker makes an allocator release its cache before it takes more than its share.
        torch.cuda.set_per_process_memory_fraction(0.9 / workers)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (GPU tier: run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
