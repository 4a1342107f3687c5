#!/usr/bin/env bash
# The 2-GPU NCCL checks and benchmarks, in one call on nvidia-h200-x2 (NVLink multicast off, as the
# device notes ask). Writes logs and results under $OUT. Not run by CI: CI has no GPU.
#   .ci/gpu_distributed.sh [smoke|bench|all] [extra args for benchmarks.distributed]
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then  # peers (torchao) as wheels, when carried
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || {
    echo "editable install failed; see install.log"; tail -5 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
stage=${1:-all}
shift || true
if [[ $stage == all || $stage == smoke ]]; then
    PYTHONPATH=.:${PYTHONPATH:-} timeout 180 torchrun --standalone --nproc_per_node 2 tests/distributed/nccl_smoke.py 2>&1 \
        | tee "$OUT/nccl_smoke.log" | grep -v Warning | tail -40
fi
if [[ $stage == all || $stage == bench ]]; then
    timeout ${BENCH_TIMEOUT:-420} torchrun --standalone --nproc_per_node 2 -m benchmarks.distributed --out "$OUT/distributed.json" "$@" 2>&1 \
        | tee "$OUT/bench_distributed.log" | grep -v Warning | tail -30
fi
