"""Nothing silent on a real run: steps without an update are announced and can stop the run, and
validation scores held-out answers with the run's own reward."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
CONSTANT = f"reward.functions=[{{name: custom, weight: 1.0, path: {ROOT / 'tests' / 'e2e' / 'constant_reward.py'}, function: score}}]"


def test_steps_without_update_are_said_and_stop_the_run(tmp_path):
    """A reward of 1.0 for everything: dynamic sampling keeps no group, so no step updates. Each
    step says so on the console and in main.log; with no_update_action=stop the run checkpoints
    and exits 2 after no_update_patience steps. Validation scores with that same reward: 1.0."""
    cmd = [sys.executable, "-m", "hybrid_rl.main", "+recipe=grpo_math", "+overlay=ci_tiny", CONSTANT,
           "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_gen_rounds=2", "trainer.total_steps=5",
           "trainer.no_update_patience=2", "trainer.no_update_action=stop", "trainer.val_before_train=true",
           "data.val_size=4", "trainer.nproc_per_node=1", f"trainer.output_dir={tmp_path}"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert p.returncode == 2, p.stderr[-5000:]
    said = p.stdout + p.stderr
    for text in ("step 1: no update", "step 2: no update", "2 steps in a row without an update"):
        assert text in said and text in (tmp_path / "main.log").read_text(), text
    assert "step 3:" not in said
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "trainer/no_update" in r]
    assert [(r["step"], r["trainer/no_update"], r["trainer/no_update_streak"]) for r in steps] == [(1, 1.0, 1.0), (2, 1.0, 2.0)]
    assert all("actor/loss" not in r and r["response_length/mean"] > 0 for r in steps)  # what was generated, still logged
    assert rows[0]["step"] == 0 and rows[0]["val/accuracy"] == 1.0  # the run's own reward, not the math verifier
    assert (tmp_path / "checkpoints" / "step_000002" / "manifest.json").is_file()
