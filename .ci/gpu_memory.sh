#!/usr/bin/env bash
# Issue 10's GPU checks and memory benchmarks in one call on nvidia-h100-x1: the cross-entropy kernel's GPU
# tests, then python -m benchmarks.memory (LCE against naive/Liger/CCE, FP8-only inference, what a
# training step holds, activation peaks; `--only CASES` picks cases). Peers travel as wheels in .whl (carry it). Results under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || {
    echo "editable install failed; see install.log"; tail -5 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_cross_entropy_kernel.py tests/kernels/test_multi_quantize.py tests/ops/test_requantize.py tests/ops/test_linear_cross_entropy.py -p no:cacheprovider -rf 2>&1 | tail -12 | tee "$OUT/gpu_tests.log"
timeout ${BENCH_TIMEOUT:-420} python3 -W ignore -m benchmarks.memory --out "$OUT/memory.json" "$@" 2>&1 | tee "$OUT/bench_memory.log" | tail -40
