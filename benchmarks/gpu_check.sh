#!/usr/bin/env bash
# One prepared run of the CUDA path on a bare GPU node (no network, python3 with torch and
# transformers but no vLLM, Hydra or math-verify). Under 10 minutes; results as files under $OUT.
#
# Here, before the call:   bash scripts/gpu_wheels.sh        (wheels/gpu/, ~0.6 MiB, git-ignored)
# There:                   bash benchmarks/gpu_check.sh   (with wheels/ copied along; OUT=<dir> for results)
# On a GPU node with the full stack (make setup): make gpu-check (the same, plus the vLLM parts).
#
# 1. training side without vLLM (benchmarks/gpu_train_check.py, torchrun, NCCL): sharded init,
#    bf16 compute with fp32 masters and AdamW state, the chunked log-prob head on the 151,936-row
#    vocabulary vs the naive one, a training step, the switch's offload (bytes moved), the
#    transformers rollout backend (weight push + generate); peak memory per phase, on the
#    Qwen2.5-0.5B and -1.5B shapes;
# 2. GRPO through the real trainer with rollout.backend=hf (needs the carried Hydra wheels):
#    the SFT warm start and 5 steps on the tiny model, then 3 steps on the qwen0.5b shape;
# 3. only where vLLM imports: the CUDA hybrid-engine tests and the vLLM benchmarks.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=${PY:-.venv/bin/python}; else PY=${PY:-python3}; fi
DEST=${OUT:-benchmarks/results/gpu}
mkdir -p "$DEST"
export HYBRID_RL_CACHE=${HYBRID_RL_CACHE:-/tmp/hybrid_rl_cache}
start=$(date +%s)
stamp() { echo "[gpu_check +$(( $(date +%s) - start ))s] $*" | tee -a "$DEST/summary.txt"; }
nvidia-smi > "$DEST/nvidia-smi.txt" 2>&1 || true
if ls wheels/gpu/*.whl >/dev/null 2>&1 && ! $PY -c "import hydra, math_verify" 2>/dev/null; then
    $PY -m pip install --quiet --no-index --no-deps wheels/gpu/*.whl > "$DEST/pip.log" 2>&1 || stamp "wheel install failed (pip.log)"
fi
$PY - > "$DEST/versions.json" 2>&1 <<'EOF'
import importlib, json, torch
mods = {m: (getattr(importlib.import_module(m), "__version__", "?") if importlib.util.find_spec(m) else None)
        for m in ("transformers", "safetensors", "hydra", "omegaconf", "math_verify", "vllm", "flash_attn")}
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
                  "name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, **mods}, indent=1))
EOF
cat "$DEST/versions.json"
NGPU=$($PY -c "import torch; print(max(torch.cuda.device_count(), 1))")
rc=0

stamp "1. training side (no vLLM), $NGPU rank(s)"
timeout 300 $PY -m torch.distributed.run --standalone --nproc-per-node="$NGPU" benchmarks/gpu_train_check.py \
    --out "$DEST" --presets qwen0.5b,qwen1.5b > "$DEST/train_check.log" 2>&1 || { rc=1; stamp "training-side check failed"; }
grep '^{' "$DEST/train_check.log" | cut -c1-400

if $PY -c "import hydra, omegaconf, math_verify" 2>/dev/null; then
    stamp "2a. GRPO, rollout.backend=hf, tiny model (SFT warm start + 5 steps)"
    timeout 200 $PY -m hybrid_rl.main +recipe=grpo_math trainer.device=cuda trainer.nproc_per_node=1 rollout.backend=hf \
        actor.param_dtype=bfloat16 rollout.dtype=bfloat16 trainer.total_steps=5 trainer.val_every=5 data.val_size=128 \
        trainer.run_name=gpu_grpo_tiny trainer.output_dir="$DEST/grpo_tiny" > "$DEST/grpo_tiny.log" 2>&1 || { rc=1; stamp "GRPO tiny failed"; }
    tail -3 "$DEST/grpo_tiny.log"
    stamp "2b. GRPO, rollout.backend=hf, qwen0.5b shape (random init), 3 steps"
    timeout 200 $PY -m hybrid_rl.main +recipe=grpo_math_gpu model.path=builtin:tiny model.preset=qwen0.5b \
        trainer.nproc_per_node=1 rollout.backend=hf trainer.total_steps=3 trainer.val_every=0 trainer.save_every=0 \
        data.train_batch_size=8 rollout.n=4 rollout.max_response_length=128 data.max_prompt_length=128 \
        trainer.run_name=gpu_grpo_qwen05 trainer.output_dir="$DEST/grpo_qwen05" trainer.val_before_train=false trainer.export_hf=false > "$DEST/grpo_qwen05.log" 2>&1 || { rc=1; stamp "GRPO qwen0.5b failed"; }
    tail -3 "$DEST/grpo_qwen05.log"
else
    stamp "2. skipped: Hydra/math-verify not importable (run scripts/gpu_wheels.sh here and carry wheels/)"
fi

if $PY -c "import vllm" 2>/dev/null; then
    stamp "3. vLLM parts"
    timeout 300 $PY -m pytest -m gpu tests/gpu -x -q -s > "$DEST/gpu_tests.log" 2>&1 || rc=1
    tail -5 "$DEST/gpu_tests.log"
    timeout 240 $PY -m benchmarks.switch_overhead --presets tiny,qwen0.5b,qwen1.5b --ranks 1 --repeats 5 > "$DEST/switch.log" 2>&1 || rc=1
    timeout 120 $PY -m benchmarks.prefix_cache --preset qwen0.5b --dtype bfloat16 --groups 1,8,32 --lengths 256,1024 --prompts 8 > "$DEST/prefix.log" 2>&1 || rc=1
    cp benchmarks/results/*.json benchmarks/results/*.png "$DEST/" 2>/dev/null || true
else
    stamp "3. skipped: no vLLM on this machine"
fi
stamp "done rc=$rc"
exit $rc
