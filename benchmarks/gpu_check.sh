#!/usr/bin/env bash
# The GPU check: one command, at most 7 minutes, on a machine with one CUDA GPU (Python 3.12, a CUDA
# torch, JAX with CUDA, pytest; no package registry reachable). From the repository root:
#
#     OUT=/some/folder bash benchmarks/gpu_check.sh
#
# Wheels it installs first (no registry there): the cp312 wheels of `mpich` and `mpi4py` in
# build/gpu-wheels/ (an ignored path: carry it to the GPU machine), fetched on a machine that has a
# registry with
#     pip download --no-deps -d build/gpu-wheels --python-version 3.12 --only-binary=:all: \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 mpich mpi4py
# Then it installs this checkout (pip install --no-index --no-deps --no-build-isolation -e .) and runs,
# in this order (the benchmark first, so its figures come back even if a later step runs out of time):
#   1. benchmarks/gpu_step.py --json   (plain torch, phalanx/DDP nccl 1 rank, phalanx mpi/gloo and
#                                       DDP gloo with 2 ranks sharing the GPU)   -> gpu_step.json/.log
#   2. tests/test_gpu.py, tests/test_world_of_one.py                              -> test_gpu.log
#   3. tests/test_jax.py on the machine's JAX (PHALANX_REQUIRE_JAX=1), with what time is left -> test_jax.log
# Everything is written to $OUT (default /tmp/phalanx-gpu-check); summary.txt has one line per step.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/phalanx-gpu-check}
mkdir -p "$OUT"
BUDGET=${PHALANX_GPU_CHECK_SECONDS:-410}   # the whole script, under the 7 minutes
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
step() {  # step NAME SECONDS LOG COMMAND...: run bounded, note rc and seconds in summary.txt
    local name=$1 limit=$2 log=$3; shift 3
    if (( limit < 20 )); then echo "$name: skipped (no time left)" >> "$OUT/summary.txt"; return; fi
    local t0=$(date +%s)
    timeout -k 5 "$limit" "$@" > "$OUT/$log" 2>&1
    local rc=$?
    echo "$name: rc=$rc in $(( $(date +%s) - t0 )) s (limit $limit s) -> $log" >> "$OUT/summary.txt"
}
: > "$OUT/summary.txt"
{ date -u; nvidia-smi 2>&1 | head -15; python3 --version; git rev-parse HEAD 2>/dev/null; git status --short; } \
    > "$OUT/machine.txt" 2>&1
if [[ -z "${PHALANX_GPU_CHECK_NO_INSTALL:-}" ]]; then  # set it where phalanx is installed already
    step "install wheels" 60 install.log python3 -m pip install --no-index --no-deps build/gpu-wheels/*.whl
    step "install phalanx" 60 install-phalanx.log python3 -m pip install --no-index --no-deps --no-build-isolation -e .
fi
step "phalanx info" 30 info.txt python3 -m phalanx info
step "benchmark" 170 gpu_step.log python3 benchmarks/gpu_step.py --json "$OUT/gpu_step.json"
step "gpu tests" $(( $(left) - 100 < 150 ? $(left) - 100 : 150 )) test_gpu.log \
    python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_world_of_one.py
PHALANX_REQUIRE_JAX=1 step "jax tests" "$(( $(left) - 5 ))" test_jax.log \
    python3 -m pytest -q -p no:cacheprovider -x tests/test_jax.py
echo "total: $(( $(date +%s) - START )) s" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
[[ -f "$OUT/gpu_step.json" ]] && cat "$OUT/gpu_step.json"
tail -n 3 "$OUT/test_gpu.log" "$OUT/test_jax.log" 2>/dev/null
exit 0
