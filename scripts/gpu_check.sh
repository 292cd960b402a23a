#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (docs/decode.md, "On a GPU"): the CUDA tests, then
# `bench.gpu`, everything written under $OUT. About 6-9 minutes; from this machine:
#
#   bash scripts/gpu_wheels.sh
#   device run: command "bash scripts/gpu_check.sh", carry [".gpu_wheels"], timeout_s 570
#
# then copy $OUT's gpu.md to bench/results/gpu.md. Each part has its own time limit, so a hang in
# one still leaves the other's output.
set -uo pipefail
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu_wheels/*.whl \
    || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/nvidia-smi.txt" 2>&1
# The image lacks some test-only packages (playwright, ray, ...): only the files with CUDA tests.
cuda_tests=(tests/pe_runtime/test_pe_cache.py tests/service/test_model_incremental.py tests/service/test_fast_decode.py)
timeout 180 python3 -m pytest -q -p no:cacheprovider --continue-on-collection-errors -m cuda "${cuda_tests[@]}" 2>&1 \
    | tee "$out/tests.log"
timeout 360 python3 -m bench.gpu --output "$out/gpu.md" 2>&1 | tee "$out/bench.log"
