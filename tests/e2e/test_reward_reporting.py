"""What a reward reports, end to end on 2 torchrun ranks with DAPO's refills: the extras a
reward function returns reach metrics.jsonl as ``reward/<key>`` (also a key only one rank's
answers carry), and a reward that raises leaves its traceback in main.log, once."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_reward_extras_reach_the_metrics_and_a_failure_its_traceback_the_log(tmp_path):
    reward = ROOT / "tests" / "e2e" / "extras_reward.py"
    cmd = [sys.executable, "-m", "hybrid_rl.main", "+recipe=grpo_math", "+overlay=ci_tiny", "trainer.nproc_per_node=2",
           f"trainer.output_dir={tmp_path}", "trainer.total_steps=2", "trainer.val_every=0", "trainer.val_before_train=false",
           "trainer.save_every=0", "rollout.max_response_length=24", "algorithm.filter_groups.enable=true",
           "algorithm.filter_groups.max_gen_rounds=2",
           f"reward.functions=[{{name: custom, weight: 1.0, path: {reward}, function: score}}]"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stderr[-6000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "actor/loss" in r or "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["reward/chars"] > 0 and r["reward/rank1_only"] == 1.0
    assert [r["reward/failed"] for r in steps] == [2.0, 0.0]  # each rank's one worker's first answer
    log = (tmp_path / "main.log").read_text()
    assert log.count("reward function score failed: ValueError: first answer this worker scored") == 2, log[-4000:]
    assert log.count('raise ValueError("first answer this worker scored")') == 2  # the traceback, once per rank
