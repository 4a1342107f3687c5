#!/usr/bin/env bash
# Before/after timing on the GPU machine, in one run: the benchmark cases of two versions of the library,
# alternating (before, after, before, after) so clock drift hits both alike.
#   bash .ci/gpu_before_after.sh BEFORE_TREE [CASES] [ROUNDS]
# BEFORE_TREE: a copy of the older source tree (e.g. `git archive <commit> | tar -x -C .before`); the
# working tree is the "after". CASES: benchmarks case letters (default a,d: kernels and the MLP block).
# Writes $OUT/before_N, $OUT/after_N and $OUT/before_after.md.
set -uo pipefail
OUT=${OUT:-gpu_out}
before=$1
cases=${2:-a,d}
rounds=${3:-2}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site_before "$before" >"$OUT/install_before.log" 2>&1 || {
    echo "install of $before failed"; tail -5 "$OUT/install_before.log"; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/site_after . >"$OUT/install_after.log" 2>&1 || {
    echo "install of the working tree failed"; tail -5 "$OUT/install_after.log"; exit 1; }
for i in $(seq 1 "$rounds"); do
    for side in before after; do
        echo "== $side, round $i"
        (cd /tmp && PYTHONPATH=/tmp/site_$side timeout 280 python3 -m benchmarks --cases "$cases" --no-rowwise \
            --out "$OUT/${side}_$i" 2>&1 | tail -4)
    done
done
PYTHONPATH=/tmp/site_after python3 -m benchmarks.before_after --before "$OUT"/before_* --after "$OUT"/after_* \
    --md "$OUT/before_after.md" --json "$OUT/before_after.json"
