"""The long-tailed task's recipe (grpo_longtail) runs through the main entry point on CPU, with its
long prompts and its 1,024-token answer budget, on the builtin tiny-long model at random init (the
recipe's own warm start takes minutes to build; the e2e suite does not build it)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
LENGTH_REWARD = ROOT / "tests" / "e2e" / "length_reward.py"


def test_the_longtail_recipe_trains_with_its_long_answer_budget(tmp_path):
    cmd = [
        sys.executable, "-m", "hybrid_rl.main", "+recipe=grpo_longtail", "+overlay=ci_tiny", "trainer.nproc_per_node=1",
        "trainer.total_steps=2", "rollout.max_response_length=1024", f"trainer.output_dir={tmp_path}",
        # 2 prompts x 2 answers: a random-init model's answers run to ~600 tokens on average
        "data.train_batch_size=2", "rollout.n=2",
        # a random-init model gets no sum right; a length reward gives the groups some variance
        f"reward.functions=[{{name: custom, weight: 1.0, path: {LENGTH_REWARD}, function: score}}]",
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "weights_version" in r]
    assert [r["step"] for r in steps] == [1, 2] and all("actor/loss" in r for r in steps)
    for r in steps:
        # answers run past what any earlier recipe allowed, up to the budget and never over it
        assert 0 < r["response_length/mean"] and 256 < r["response_length/max"] <= 1024, r
    # the random model often runs to the budget: cut there, exactly
    assert any(r["response_length/clip_ratio"] > 0 and r["response_length/max"] == 1024 for r in steps), steps
    log = (tmp_path / "main.log").read_text()
    # the running sums' prompts (up to 227 tokens) all fit data.max_prompt_length=256
    assert "1024 rows read (train.parquet 1024), 1024 kept, 0 skipped and 0 truncated" in log
