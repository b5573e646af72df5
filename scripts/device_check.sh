#!/usr/bin/env bash
# One-shot accelerator check for the paged-attention kernels (no network needed).
#   scripts/device_check.sh [OUT_DIR]     (default: $OUT, else ./device_check_out)
# 1. tests/kernels compiled natively on the device (PAXPAGE_KERNEL_INTERPRET=0: the platform's
#    kernel family, not the interpreter); 2. scripts/bench_kernels.py. Budget: under 8 minutes (the H200 ran tests/kernels past 240 s).
set -uo pipefail
OUT_DIR="${1:-${OUT:-./device_check_out}}"
mkdir -p "$OUT_DIR"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONDONTWRITEBYTECODE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

"$PY" -c "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices())" 2>&1 | tee "$OUT_DIR/env.txt"
command -v nvidia-smi >/dev/null && nvidia-smi >> "$OUT_DIR/env.txt" 2>&1

start=$(date +%s)
PAXPAGE_KERNEL_INTERPRET=0 timeout 360 "$PY" -m pytest tests/kernels --extended -q -rs --durations=10 \
    --junitxml="$OUT_DIR/tests.xml" 2>&1 | tee "$OUT_DIR/tests.log"
tests_rc=${PIPESTATUS[0]}
echo "tests rc=$tests_rc in $(( $(date +%s) - start ))s" | tee -a "$OUT_DIR/summary.txt"

start=$(date +%s)
timeout 200 "$PY" scripts/bench_kernels.py --json "$OUT_DIR/bench.json" 2>&1 | tee "$OUT_DIR/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "bench rc=$bench_rc in $(( $(date +%s) - start ))s" | tee -a "$OUT_DIR/summary.txt"

[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
