"""``actor.optimizer_impl=bf16_moments`` on the real stack (2 ranks, FSDP2, vLLM): the moments are
bf16 DTensors sharded like their parameters, torch.distributed.checkpoint saves them as bf16 (a
resumed run's later checkpoints too), and a resumed run continues exactly (the rounding noise is
seeded by the step, not by a generator's history)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
BASE = [
    "+recipe=grpo_math",
    "+overlay=ci_tiny",
    "algorithm.filter_groups.enable=false",
    "trainer.nproc_per_node=2",
    "trainer.save_every=1",
    "actor.lr=1e-3",
    "actor.optimizer_impl=bf16_moments",
    f"reward.functions=[{{name: custom, weight: 1.0, path: {ROOT / 'tests' / 'e2e' / 'length_reward.py'}, function: score}}]",
]
COMPARED = ["critic/score/mean", "actor/loss", "actor/grad_norm", "actor/entropy", "response_length/mean", "weights_version"]


def run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hybrid_rl.main", *BASE, f"trainer.output_dir={out}", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-5000:]
    return p


def rows(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "actor/loss" in r}


def test_bf16_moments_checkpoint_as_bf16_and_resume_exactly(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    run(tmp_path / "full", "trainer.total_steps=3")
    run(tmp_path / "resumed", "trainer.total_steps=2")
    p = run(tmp_path / "resumed", "trainer.total_steps=3")
    assert "at step 2" in p.stderr + p.stdout
    got, want = rows(tmp_path / "resumed"), rows(tmp_path / "full")
    assert sorted(got) == [1, 2, 3] and all(want[s]["actor/grad_norm"] > 0 for s in want)
    for step in got:
        for key in COMPARED:
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
    # the resumed run's own step 3 too: torch's optimizer load cast the moments to fp32 for good
    for run_dir in ("full", "resumed"):
        meta = FileSystemReader(str(tmp_path / run_dir / "checkpoints" / "step_000003")).read_metadata().state_dict_metadata
        moments = {k: m.properties.dtype for k, m in meta.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
        weights = {k: m.properties.dtype for k, m in meta.items() if k.endswith("weight") and "exp_avg" not in k}
        assert moments and {str(d) for d in moments.values()} == {"torch.bfloat16"}, (run_dir, moments)
        assert weights and {str(d) for d in weights.values()} == {"torch.float32"}
