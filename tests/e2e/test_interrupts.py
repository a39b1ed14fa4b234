"""Interrupting a 2-rank run: SIGTERM or SIGINT (Ctrl-C) to the whole process group, or a second
SIGTERM to the launcher. Each is followed by ``trainer.resume=auto``: the resumed run continues
from the saved step, every step appears once in metrics.jsonl, and the metrics equal an
uninterrupted run's, the learning rate of a warm-up + cosine schedule among them."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybrid_rl.engine.optim import OptimConfig, lr_lambda
from tests.e2e import step_rows

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
BASE = [
    "+recipe=grpo_math",
    "+overlay=ci_tiny",
    "algorithm.filter_groups.enable=false",
    "trainer.nproc_per_node=2",
    "trainer.save_every=1",
    "trainer.keep_last=3",
    "actor.lr=1e-3",
    # A schedule that moves every step (one optimizer step per RL step here): a resume that
    # restarted it, or shifted it by a step, changes the LR the next updates use.
    "actor.lr_schedule=cosine",
    "actor.warmup_steps=2",
    "actor.min_lr_ratio=0.1",
    f"trainer.total_steps={STEPS}",
    f"reward.functions=[{{name: custom, weight: 1.0, path: {ROOT / 'tests' / 'e2e' / 'length_reward.py'}, function: score}}]",
]
COMPARED = ["critic/score/mean", "actor/loss", "actor/grad_norm", "actor/entropy", "response_length/mean", "weights_version"]
COMPARED += ["actor/lr"]
SCHEDULE = OptimConfig(1e-3, 0.0, (0.9, 0.999), 2, schedule="cosine", min_lr_ratio=0.1, total_steps=STEPS, grad_clip=1.0)


def cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "hybrid_rl.main", *BASE, f"trainer.output_dir={out}"]


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    metrics = out / "metrics.jsonl"
    while time.time() < deadline:
        if metrics.exists() and sum('"actor/loss"' in ln for ln in metrics.read_text().splitlines()) >= step:
            return
        assert proc.poll() is None, "the run ended before it was interrupted"
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def schedule_state(out: Path, step: int) -> dict:
    """The actor's LR-scheduler state in the step-``step`` checkpoint, as rank 0 wrote it."""
    state = torch.load(out / "checkpoints" / f"step_{step:06d}" / "trainer_rank0.pt", weights_only=False)
    return state["actor_engine"]["scheduler"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    p = subprocess.run(cmd(out), capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-5000:]
    rows = step_rows(out)
    # the uninterrupted run really used the warm-up + cosine schedule, one value per update
    assert [rows[s]["actor/lr"] for s in sorted(rows)] == pytest.approx([1e-3 * lr_lambda(SCHEDULE)(k) for k in range(STEPS)])
    return rows, schedule_state(out, STEPS)


# sigterm_to_group is slow-only (make test-all): the ranks' handler treats SIGINT and SIGTERM
# alike, sigint_to_group covers a signal reaching the ranks twice (from the group and forwarded
# by the launcher), and second_sigterm_to_launcher covers the launcher forwarding SIGTERM.
@pytest.mark.parametrize(
    "how", [pytest.param("sigterm_to_group", marks=pytest.mark.slow), "sigint_to_group", "second_sigterm_to_launcher"]
)
def test_interrupt_then_resume_matches_uninterrupted(reference, tmp_path, how):
    # A new session: the launcher leads its own process group, as a shell job would.
    proc = subprocess.Popen(
        cmd(tmp_path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        wait_for_step(tmp_path, 2, proc)
        if how == "sigterm_to_group":
            os.killpg(proc.pid, signal.SIGTERM)
        elif how == "sigint_to_group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGTERM)
            time.sleep(0.2)  # well inside the step the ranks are finishing
            os.kill(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith("."))
    assert ckpts, output[-3000:]
    saved = int(ckpts[-1].split("_")[1])
    if how == "second_sigterm_to_launcher":
        assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
        assert "second SIGTERM: stopping the ranks now" in output
    else:
        assert proc.returncode == 0, output[-3000:]
        assert "checkpoint after the current step" in output
        assert saved < STEPS, "the run was not stopped early"
        assert max(step_rows(tmp_path)) == saved  # it stopped right after the checkpointed step
        # save_every=1: that step was saved on schedule, and the stop does not write it again
        # (replacing the one good copy opened a window in which a kill left it without a shard)
        assert output.count(f"saved checkpoint {tmp_path / 'checkpoints' / ckpts[-1]}") == 1, output[-3000:]
    # the checkpoint the resume starts from holds the schedule after its `saved` updates
    assert schedule_state(tmp_path, saved)["last_epoch"] == saved
    p = subprocess.run(cmd(tmp_path), capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-5000:]
    assert f"at step {saved}" in p.stderr + p.stdout  # resumed from the saved step
    want, want_schedule = reference
    got = step_rows(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:  # actor/lr included: every update after the resume used the uninterrupted run's LR
        for key in COMPARED:
            assert got[step][key] == want[step][key], (how, step, key, got[step][key], want[step][key])
    schedule = schedule_state(tmp_path, STEPS)
    assert (schedule["last_epoch"], schedule["_last_lr"]) == (want_schedule["last_epoch"], want_schedule["_last_lr"])
    assert schedule["last_epoch"] == STEPS and schedule["_last_lr"] == pytest.approx([1e-3 * lr_lambda(SCHEDULE)(STEPS)])
