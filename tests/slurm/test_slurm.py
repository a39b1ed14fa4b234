"""The Slurm batch scripts against a real one-node Slurm: a 2-rank job, then checkpoint -> requeue -> resume."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import need

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "recipes" / "slurm" / "single_node.sbatch"
OVERRIDES = [
    "+overlay=ci_tiny",
    "algorithm.filter_groups.enable=false",
    "trainer.save_every=1",
]


@pytest.fixture(scope="module")
def cluster():
    need("root", os.geteuid() == 0, "a real Slurm needs root (CI runs as root)")
    from tests.slurm.cluster import Cluster

    c = Cluster()
    c.start()
    yield c
    c.shutdown()


def submit(workdir: Path, steps: int, name: str) -> str:
    env = {**os.environ, "PYTHON": sys.executable, "NPROC": "2", "RUN_NAME": name}
    p = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--job-name={name}",
            f"--chdir={workdir}",
            f"--output={workdir}/%x-%j.out",
            "--cpus-per-task=2",
            "--export=ALL",
            str(SCRIPT),
            "grpo_math",
            f"trainer.total_steps={steps}",
            *OVERRIDES,
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return p.stdout.strip().split(";")[0]


def steps_logged(run_dir: Path) -> list[int]:
    f = run_dir / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(line)["step"] for line in f.read_text().splitlines() if '"actor/loss"' in line]


TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def wait_for_restart(cluster, job: str, timeout: float) -> dict[str, str]:
    """Waits until the requeued job has run again and ended; returns its last record.

    Stops at any end state (a failed restart is reported at once, with its record, not after the
    timeout). A requeued job pending on its BeginTime is started now, and one that Slurm held
    (a failed launch is requeued held) is released: the scheduler's timing and holds are not the
    protocol under test, and the failure message then shows what went wrong.
    """
    deadline = time.time() + timeout
    info: dict[str, str] = {}
    while time.time() < deadline:
        info = cluster.job(job) or info
        state, reason = info.get("JobState", ""), info.get("Reason", "")
        if state in TERMINAL and int(info.get("Restarts", "0")) >= 1:
            return info
        if state == "PENDING" and reason == "BeginTime":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=False, capture_output=True)
        elif state in ("REQUEUE_HOLD", "SPECIAL_EXIT") or (state == "PENDING" and "held" in reason.lower()):
            subprocess.run(["scontrol", "release", job], check=False, capture_output=True)
        time.sleep(1)
    return info


def test_single_node_job_runs_two_ranks(cluster, tmp_path):
    job = submit(tmp_path, 3, "hrl-basic")
    info = cluster.wait(job, timeout=600)
    log = (tmp_path / f"hrl-basic-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    run_dir = tmp_path / "outputs" / "hrl-basic"
    assert steps_logged(run_dir) == [1, 2, 3]
    assert "2 ranks" in log
    assert (run_dir / "slurm_jobs.txt").read_text().startswith(job)
    assert (run_dir / "checkpoints" / "step_000003" / "manifest.json").exists()


def test_signal_checkpoints_requeues_and_resumes(cluster, tmp_path):
    job = submit(tmp_path, 10, "hrl-requeue")
    run_dir = tmp_path / "outputs" / "hrl-requeue"
    deadline = time.time() + 400
    while time.time() < deadline and len(steps_logged(run_dir)) < 2:
        time.sleep(1)
    assert len(steps_logged(run_dir)) >= 2, "the job never got going"
    # What Slurm sends before the time limit (--signal=B:USR1@N), sent now.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    info = wait_for_restart(cluster, job, timeout=420)
    log = (tmp_path / f"hrl-requeue-{job}.out").read_text()
    assert info.get("JobState") == "COMPLETED" and int(info.get("Restarts", "0")) >= 1, (
        f"job {job}: {info or 'no record'}\n--- slurmctld ---\n{cluster.log_tail('slurmctld')}"
        f"\n--- slurmd ---\n{cluster.log_tail('slurmd')}\n--- job output ---\n{log[-3000:]}"
    )
    assert "requeueing" in log and "restart 1" in log
    lines = (run_dir / "slurm_jobs.txt").read_text().splitlines()
    assert [re.search(r"restart=(\d+)", x).group(1) for x in lines] == ["0", "1"]
    # checkpointed at the signal, resumed right after it: every step exactly once
    assert steps_logged(run_dir) == list(range(1, 11))
    assert (run_dir / "checkpoints" / "step_000010" / "manifest.json").exists()
