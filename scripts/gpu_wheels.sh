#!/usr/bin/env bash
# The pure-Python wheels a bare GPU node without network may lack (one with torch, transformers,
# safetensors, pyarrow, tensorboard, sympy, but no Hydra, OmegaConf or math-verify): built here
# into wheels/gpu/ (git-ignored, ~1 MiB), copied there with the repository, installed offline
# by benchmarks/gpu_check.sh. Versions are pyproject.toml's pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=wheels/gpu
mkdir -p "$DEST"
$PY -m pip download --quiet --no-deps --only-binary=:all: -d "$DEST" \
    hydra-core==1.3.8 omegaconf==2.3.1 math-verify==0.9.0 latex2sympy2_extended==1.11.0
# antlr4 4.9.3 (what omegaconf needs) is published as an sdist only: build its wheel here.
ls "$DEST"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 || \
    $PY -m pip wheel --quiet --no-deps -w "$DEST" antlr4-python3-runtime==4.9.3
du -sh "$DEST"; ls "$DEST"
