"""GRPO end to end through the main entry point: 2 torchrun ranks, a few steps, then a resume."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]

COMMON = [
    "+recipe=grpo_math",
    "+overlay=ci_tiny",
    "algorithm.filter_groups.enable=false",
    "trainer.export_hf=true",
    "trainer.val_before_train=true",
    "trainer.nproc_per_node=2",
    "rollout.max_response_length=24",
    "data.val_size=16",
    "trainer.val_every=2",
    "trainer.save_every=2",
    "rollout.val_pass_k=2",
    # a random-init model scores 0 on math everywhere (all-zero advantages, nothing trained):
    # train on a reward it has a spread on, the answer's length; validation still uses math
    f"reward.functions=[{{name: custom, weight: 1.0, path: {ROOT / 'tests' / 'e2e' / 'length_reward.py'}, function: score}}]",
]


def run_main(out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hybrid_rl.main", *COMMON, f"trainer.output_dir={out_dir}", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT, timeout=900)


def rows(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    p = run_main(out, "trainer.total_steps=3")
    assert p.returncode == 0, p.stderr[-6000:]
    return out


def test_steps_are_finite_and_bump_weights_version(first_run):
    steps = [r for r in rows(first_run) if "actor/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        for key in ("actor/loss", "actor/grad_norm", "critic/score/mean", "actor/entropy", "rollout/logprob_diff_mean"):
            assert key in r and r[key] == r[key]  # present and not NaN
        # a real update: non-zero advantages and gradients
        assert r["advantage/abs_mean"] > 0 and r["actor/grad_norm"] > 0 and r["reward/std"] > 0
        assert 0 < r["reward/informative_groups"] <= 1  # the length reward differs inside groups
    assert [r["weights_version"] for r in steps] == [1.0, 2.0, 3.0]
    val = [r for r in rows(first_run) if "val/accuracy" in r]
    assert val[0]["step"] == 0 and "val/pass@2" in val[0]
    # the end-of-run export: streamed from the last checkpoint as sharded safetensors with their index
    index = json.loads((first_run / "hf" / "model.safetensors.index.json").read_text())
    assert all((first_run / "hf" / f).exists() for f in set(index["weight_map"].values()))
    assert (first_run / "hf" / "config.json").exists() and (first_run / "hf" / "tokenizer_config.json").exists()
    assert (first_run / "tensorboard").is_dir()


def test_checkpoint_resumes(first_run):
    ckpts = sorted(p.name for p in (first_run / "checkpoints").iterdir())
    assert ckpts == ["step_000002", "step_000003"]
    p = run_main(first_run, "trainer.total_steps=4")
    assert p.returncode == 0, p.stderr[-6000:]
    assert "resumed from" in p.stderr + p.stdout
    steps = [r["step"] for r in rows(first_run) if "actor/loss" in r]
    assert steps == [1, 2, 3, 4]


def test_skipped_weight_sync_is_caught_by_the_stale_weight_guard(tmp_path):
    """Fault injection: the sync after step 1's update is skipped, so step 2's rollout comes from
    version 0 weights while the trainer is at version 1; the update must refuse it."""
    import os

    env = {**os.environ, "HYBRID_RL_FAULT": "skip_sync@1"}
    cmd = [sys.executable, "-m", "hybrid_rl.main", *COMMON, f"trainer.output_dir={tmp_path}", "trainer.total_steps=3"]
    cmd += ["trainer.val_every=0", "trainer.val_before_train=false", "trainer.save_every=0"]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT, timeout=900, env=env)
    assert p.returncode != 0, p.stderr[-4000:]  # each rank exits 2; torchrun reports 1
    assert "error (rank 0): rollout was generated with weights version 0 but the trainer is at 1" in p.stderr
    steps = [r["step"] for r in rows(tmp_path) if "actor/loss" in r]
    assert steps == [1]


def test_a_reward_failure_on_one_rank_stops_every_rank_with_its_message(tmp_path):
    """Before, the failing rank raised alone and the other waited in its next collective until
    the timeout; now the failure goes through the same collective as rollout errors."""
    import time

    failing = ROOT / "tests" / "e2e" / "failing_reward.py"
    cmd = [sys.executable, "-m", "hybrid_rl.main", *COMMON, f"trainer.output_dir={tmp_path}", "trainer.total_steps=3"]
    cmd += ["trainer.val_every=0", "trainer.val_before_train=false", "trainer.collective_timeout_s=120"]
    cmd += ["reward.max_failed_steps=1", f"reward.functions=[{{name: custom, weight: 1.0, path: {failing}, function: score}}]"]
    start = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT, timeout=900)
    assert p.returncode == 2, p.stderr[-4000:]
    assert time.perf_counter() - start < 100, "a rank waited for the collective timeout"
    assert "error (rank 0): rollout at step 1 failed (rank 1: RewardFailure" in p.stderr, p.stderr[-3000:]
