"""Resuming is safe: another model or a setting the checkpoint overrides is refused in one line
before anything starts; other changed settings are printed and the run goes on from the checkpoint."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_recipes import FAST

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hybrid_rl.main", "+recipe=grpo_math", *FAST, f"trainer.output_dir={out}", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)


def steps_logged(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def refused_line(p: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stdout + p.stderr[-3000:]
    return lines[0]


def test_resume_refuses_another_model_and_ignored_settings_and_reports_the_rest(tmp_path):
    first = run(tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    manifest = json.loads(next((tmp_path / "checkpoints").glob("step_*/manifest.json")).read_text())
    assert manifest["model"] == {"path": "builtin:tiny", "preset": "tiny"} and manifest["config"]["actor"]["lr"] == 5e-05

    # another model: was a raw size-mismatch traceback from torch.distributed.checkpoint
    line = refused_line(run(tmp_path, "trainer.total_steps=3", "model.preset=micro"))
    assert "was made from model path=builtin:tiny preset=tiny, this run uses path=builtin:tiny preset=micro" in line
    # a learning rate the restored optimizer and schedule would have silently ignored
    line = refused_line(run(tmp_path, "trainer.total_steps=3", "actor.lr=1e-3"))
    assert "actor.lr: 5e-05 -> 0.001 (the optimizer and LR schedule come from the checkpoint" in line
    assert "trainer.resume=never" in line
    # fewer or more training rows: the sampler's position would index other prompts
    line = refused_line(run(tmp_path, "trainer.total_steps=3", "data.train_size=512"))
    assert "data.train_size: 1024 -> 512 (the data position in the checkpoint refers to the old rows)" in line

    # a safe change: said on the console and in main.log (it was stderr only), and the run
    # continues from step 2
    go = run(tmp_path, "trainer.total_steps=3", "rollout.temperature=0.9")
    assert go.returncode == 0, go.stderr[-4000:]
    changed = "resuming with changed settings: rollout.temperature: 1.0 -> 0.9; trainer.total_steps: 2 -> 3"
    assert changed in go.stdout + go.stderr and changed in (tmp_path / "main.log").read_text()
    assert steps_logged(tmp_path) == [1, 2, 3]

    # must: fails where there is no checkpoint
    line = refused_line(run(tmp_path / "fresh", "trainer.resume=must"))
    assert "trainer.resume=must: no checkpoint in" in line


def test_starting_over_moves_the_earlier_run_aside_and_resuming_continues_the_new_one(tmp_path):
    """Run A to step 3, B with trainer.resume=never to step 2, C again with resume=auto. B used
    to write into A's folder without a word: A's step_000003 stayed beside B's step_000002, C
    resumed the discarded A at step 3 and pruned B's step, and metrics.jsonl read steps
    1,2,3,1,2,4. Now B moves A's files (main.log too) to previous/<time>/ first and says where."""
    a = run(tmp_path, "trainer.total_steps=3", "trainer.save_every=1")
    assert a.returncode == 0, a.stderr[-4000:]
    b = run(tmp_path, "trainer.resume=never")
    assert b.returncode == 0, b.stderr[-4000:]
    (old,) = (tmp_path / "previous").iterdir()
    moved = (
        f"trainer.resume=never: starting over; the earlier run's files in {tmp_path} (checkpoints up to step_000003, "
        f"metrics.jsonl, generations, tensorboard) were moved to {old}"
    )
    main_log = (tmp_path / "main.log").read_text()
    assert moved in b.stdout and moved in main_log.splitlines()[0], b.stdout[-3000:]
    assert "resumed from" not in main_log and steps_logged(tmp_path) == [1, 2]
    assert steps_logged(old) == [1, 2, 3]
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert "resumed from" not in (old / "main.log").read_text()  # A's own log went with it

    c = run(tmp_path, "trainer.total_steps=3")
    assert c.returncode == 0, c.stderr[-4000:]
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_000002'} at step 2" in c.stdout + c.stderr
    assert steps_logged(tmp_path) == [1, 2, 3]
