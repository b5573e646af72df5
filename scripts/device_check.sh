#!/usr/bin/env bash
# One short run on an accelerator, no network needed: it generates, measures and reports.
#   scripts/device_check.sh [OUT_DIR] [--quick] [--stages env,e2e,...] [--budget SECONDS]
# OUT_DIR defaults to $OUT, else ./device_check_out. The stages, their budgets (8 minutes in all on
# an H200) and what each writes: scripts/device_check.py. --quick rehearses them all on CPU.
set -uo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/device_check.py" "$@"
