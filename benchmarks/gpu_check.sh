#!/usr/bin/env bash
# One prepared run of the CUDA path for a lent GPU (fits in ~10 minutes on one H200):
#   bash benchmarks/gpu_check.sh            # results under benchmarks/results/gpu/ (or $OUT)
# 1. the CUDA hybrid-engine tests (sleep mode, parity, abort, memory over 20 switches);
# 2. the switch benchmark on random-init Qwen2.5-0.5B/1.5B shapes (1 rank) vs memcpy and naive;
# 3. prefix caching for groups and vLLM vs transformers generate, on the 0.5B shape in bf16.
# Assumes the CUDA stack is installed (make setup on the GPU node: vllm + flash-attn).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=${OUT:-benchmarks/results/gpu}
mkdir -p "$DEST"
nvidia-smi > "$DEST/nvidia-smi.txt" 2>&1 || true
$PY -c "import torch, vllm; print(torch.__version__, torch.cuda.get_device_name(0), vllm.__version__)" | tee "$DEST/versions.txt"
rc=0
timeout 300 $PY -m pytest -m gpu tests/gpu -x -q -s > "$DEST/gpu_tests.log" 2>&1 || rc=1
tail -5 "$DEST/gpu_tests.log"
timeout 240 $PY -m benchmarks.switch_overhead --presets tiny,qwen0.5b,qwen1.5b --ranks 1 --repeats 5 > "$DEST/switch.log" 2>&1 || rc=1
tail -4 "$DEST/switch.log"
timeout 120 $PY -m benchmarks.prefix_cache --preset qwen0.5b --dtype bfloat16 --groups 1,8,32 --lengths 256,1024 --prompts 8 > "$DEST/prefix.log" 2>&1 || rc=1
tail -8 "$DEST/prefix.log"
timeout 120 $PY -m benchmarks.rollout_throughput --presets tiny,qwen0.5b --dtype bfloat16 --prompts 32 --max-tokens 256 > "$DEST/rollout.log" 2>&1 || rc=1
tail -2 "$DEST/rollout.log"
cp benchmarks/results/*.json benchmarks/results/*.png "$DEST/" 2>/dev/null || true
exit $rc
