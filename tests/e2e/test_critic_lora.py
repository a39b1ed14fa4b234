"""PPO with a LoRA critic (``critic.lora.rank > 0``) on 2 ranks: the critic learns through its
adapters and value head, its checkpoint holds only those (the frozen body comes from the model
folder again), and a run resumes from it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
BASE = [
    "+recipe=ppo_math",
    "+overlay=ci_tiny",
    "trainer.nproc_per_node=2",
    "trainer.save_every=1",
    "critic.lora.rank=8",
    "critic.lr=1e-3",
    f"reward.functions=[{{name: custom, weight: 1.0, path: {ROOT / 'tests' / 'e2e' / 'length_reward.py'}, function: score}}]",
]


def run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hybrid_rl.main", *BASE, f"trainer.output_dir={out}", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-5000:]
    return p


def test_lora_critic_learns_checkpoints_its_adapters_only_and_resumes(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    run(tmp_path, "trainer.total_steps=3")
    rows = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "critic/vf_loss" in r]
    assert len(rows) == 3 and all(r["critic/vf_loss"] > 0 for r in rows)
    values = [r["critic/values"] for r in rows]
    assert abs(values[0]) < 1e-3 and abs(values[-1]) > 1e-3, values  # a zero head at first, then it learns
    meta = FileSystemReader(str(tmp_path / "checkpoints" / "step_000003")).read_metadata().state_dict_metadata
    critic = [k for k in meta if k.startswith("critic.model.")]
    assert any(".lora_A." in k for k in critic) and any("value_head" in k for k in critic), critic
    assert all(".lora_" in k or "value_head" in k for k in critic), [k for k in critic if ".lora_" not in k][:5]
    assert any("embed_tokens" in k for k in meta if k.startswith("app.model.")), "the actor (app) is a full fine-tune"
    p = run(tmp_path, "trainer.total_steps=4")
    assert "at step 3" in p.stderr + p.stdout
