"""Features in combination on the real stack: ranks x LoRA x precision x (fresh | killed and resumed).

Each cell trains the tiny model 4 steps with a warmup + cosine LR schedule three times: once
uninterrupted (the fresh run), once SIGKILLed at a chosen point (fault injection), and resumed
from its last checkpoint. In every cell:

- every step the trainer's recomputed log-probs match the ones vLLM sampled with after the push
  (``rollout/logprob_diff_mean``; a LoRA push that rescales the trainer's own adapters, or stale
  weights, opens a gap of 0.1 or more);
- the resumed run logs each step once and equals the fresh run bitwise from the resume on:
  loss, gradient norm, entropy, scores, lengths and the learning rate (``actor/lr``), which
  follows the schedule across the resume;
- the optimizer state in the last checkpoint has the fresh run's dtypes (bf16 moments stay bf16);
- the final checkpoint exports in bf16 with the safetensors' stored dtype and config.json agreeing.

Cells (where the CPU has no bf16 unit, the bf16 cells train and generate in fp32, and say so in
their id): chosen so that each of ranks, LoRA and precision is met by each value of the others
at least once with a resume, within the suite's time budget.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_rl.env import cpu_bf16_support
from tests.e2e import step_rows

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
BF16 = "bfloat16" if cpu_bf16_support() else "float32"
LENGTH = f"reward.functions=[{{name: custom, weight: 1.0, path: {ROOT / 'tests' / 'e2e' / 'length_reward.py'}, function: score}}]"
BASE = [
    "+recipe=grpo_math", "+overlay=ci_tiny", LENGTH, "algorithm.filter_groups.enable=false", "trainer.total_steps=4",
    "trainer.keep_last=10", "actor.lr=1e-3", "actor.lr_schedule=cosine", "actor.warmup_steps=2", "actor.min_lr_ratio=0.1",
    "actor.recompute_old_logprobs=always",
]  # fmt: skip
LORA = ["actor.lora.rank=8", "actor.lora.alpha=32", "actor.lr=5e-3"]  # alpha != rank: a push that rescales B shows
COMPARED = [
    "critic/score/mean",
    "actor/loss",
    "actor/grad_norm",
    "actor/entropy",
    "response_length/mean",
    "actor/lr",
    "weights_version",
]

# id: (ranks, LoRA, compute dtype, extra overrides, fault, save_every)
CELLS = {
    "1rank-lora-fp32-killed_in_update": (1, True, "float32", [], "update@3", 1),
    f"2rank-full-{BF16}-bf16moments-killed_in_save": (2, False, BF16, ["actor.optimizer_impl=bf16_moments"], "save@2", 1),
    f"2rank-lora-{BF16}-rank1_killed_in_generate": (2, True, BF16, [], "generate@4@1", 1),
    "1rank-full-fp32-killed_in_generate_step3_redone": (1, False, "float32", [], "generate@4", 2),
}
# Trainer vs vLLM log-prob gap per token after each push: the same weights in fp32 agree to ~1e-6;
# bf16 rounding of the two different kernels leaves ~1e-2.
PARITY = {"float32": 1e-3, "bfloat16": 5e-2}


def run(out: Path, args: list[str], ranks: int, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"HYBRID_RL_FAULT": fault} if fault else {})}
    cmd = [sys.executable, "-m", "hybrid_rl.main", *BASE, *args, f"trainer.output_dir={out}", f"trainer.nproc_per_node={ranks}"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False, env=env)


def optimizer_dtypes(ckpt: Path) -> dict[str, str]:
    """The stored dtype of every optimizer moment in a checkpoint, read from DCP's metadata."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return {k: str(m.properties.dtype) for k, m in meta.items() if "exp_avg" in k}


def stored_dtypes(folder: Path) -> set[str]:
    """The dtypes the safetensors files hold, from their headers (no load, no cast)."""
    from safetensors import safe_open

    out = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            out |= {fh.get_slice(k).get_dtype() for k in fh.keys()}
    return out


@pytest.mark.parametrize("cell", list(CELLS))
def test_cell_fresh_and_resumed(tmp_path, cell):
    ranks, lora, dtype, extra, fault, save_every = CELLS[cell]
    args = [
        f"actor.param_dtype={dtype}",
        f"rollout.dtype={dtype}",
        f"trainer.save_every={save_every}",
        *(LORA if lora else []),
        *extra,
    ]
    fresh, resumed = tmp_path / "fresh", tmp_path / "resumed"
    p = run(fresh, args, ranks)
    assert p.returncode == 0, p.stderr[-5000:]
    p = run(resumed, args, ranks, fault)
    assert p.returncode != 0 and "[fault injection] SIGKILL" in p.stderr, "the injected SIGKILL did not happen"
    p = run(resumed, args, ranks)
    assert p.returncode == 0, p.stderr[-5000:]
    assert "resumed from" in (resumed / "main.log").read_text()

    want, got = step_rows(fresh), step_rows(resumed)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    lrs = [want[s]["actor/lr"] for s in (1, 2, 3, 4)]
    assert lrs[0] < max(lrs) and lrs[3] < max(lrs) and min(lrs) > 0, f"warmup, then cosine decay: {lrs}"
    for step in (3, 4):
        for key in COMPARED:
            assert got[step][key] == want[step][key], (cell, step, key, got[step][key], want[step][key])
    for name, rows in (("fresh", want), ("resumed", got)):
        for step, r in rows.items():
            gap = r["rollout/logprob_diff_mean"]
            assert math.isfinite(gap) and gap < PARITY[dtype], f"{name} step {step}: trainer vs vLLM log-prob gap {gap}"

    last = resumed / "checkpoints" / "step_000004"
    moments = optimizer_dtypes(last)
    assert moments and moments == optimizer_dtypes(fresh / "checkpoints" / "step_000004")
    if "bf16_moments" in cell:
        assert set(moments.values()) == {"torch.bfloat16"}, moments

    from hybrid_rl.export import export_checkpoint

    export_checkpoint(last, tmp_path / "export", dtype="bfloat16")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert stored_dtypes(tmp_path / "export") == {"BF16"}
    assert config.get("torch_dtype") == "bfloat16" and config.get("dtype", "bfloat16") == "bfloat16"
