"""The multi-node batch script's c10d rendezvous, for real, across two node agents on one machine.

Debian's Slurm is built without multiple-slurmd support (one slurmd per host), so two Slurm nodes
cannot run here. Instead ``recipes/slurm/multi_node.sbatch`` itself runs under two shims: ``srun``
starts its command once per node (two processes, as ``--ntasks-per-node=1`` on 2 nodes would),
and ``scontrol`` names the nodes and records a requeue. Everything else is real: the script's
own torchrun command line, c10d rendezvous on localhost between two agents (one hosts the
store, the other joins), 2 ranks over gloo, the USR1 -> checkpoint -> requeue protocol (the
signal goes to the batch shell, as ``--signal=B:USR1`` does), and the requeued job's resume.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "recipes" / "slurm" / "multi_node.sbatch"
OVERRIDES = ["+overlay=ci_tiny", "algorithm.filter_groups.enable=false", "trainer.save_every=1", "trainer.total_steps=4"]

SRUN = """#!/bin/bash
# srun shim: run the command once per node (SLURM_NNODES), like --ntasks-per-node=1.
while [[ $# -gt 0 && $1 == --* ]]; do shift; done
pids=()
for ((i = 0; i < ${SLURM_NNODES:-1}; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
SCONTROL = """#!/bin/bash
# scontrol shim: node names, and a requeue that is recorded (the test starts the job again).
case "$1" in
  show) for ((i = 0; i < ${SLURM_NNODES:-1}; i++)); do echo localhost; done ;;
  requeue) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
esac
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steps_logged(run_dir: Path) -> list[int]:
    f = run_dir / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(line)["step"] for line in f.read_text().splitlines() if '"actor/loss"' in line]


def start(tmp_path: Path, restart: int) -> subprocess.Popen:
    shims = tmp_path / "shims"
    shims.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{shims}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "NPROC": "1",
        "RUN_NAME": "multi",
        "PORT": str(free_port()),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "hybrid_rl",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[0-1]",
        "SLURM_RESTART_COUNT": str(restart),
        "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
        "OMP_NUM_THREADS": "1",
    }
    log = open(tmp_path / f"job-{restart}.out", "w")
    return subprocess.Popen(["bash", str(SCRIPT), "grpo_math", *OVERRIDES], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)


def test_two_node_agents_rendezvous_checkpoint_requeue_and_resume(tmp_path):
    run_dir = tmp_path / "outputs" / "multi"
    job = start(tmp_path, 0)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and len(steps_logged(run_dir)) < 2 and job.poll() is None:
            time.sleep(0.5)
        log = (tmp_path / "job-0.out").read_text()
        assert len(steps_logged(run_dir)) >= 2, f"the two-node job never got going:\n{log[-4000:]}"
        assert "2 nodes x 1 ranks" in log
        job.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@N, to the batch shell
        assert job.wait(timeout=300) == 0, (tmp_path / "job-0.out").read_text()[-4000:]
    finally:
        if job.poll() is None:
            job.kill()
    first = steps_logged(run_dir)
    assert (tmp_path / "slurm.log").read_text().strip() == "requeue 4242"
    assert 2 <= len(first) < 4, f"stopped after the signal, before the end: {first}"
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert len(list(ckpt.rglob("*.distcp"))) == 2  # one shard per rank: two ranks really trained

    # Slurm starts the requeued job again (same job id, restart 1): it resumes.
    again = start(tmp_path, 1)
    assert again.wait(timeout=400) == 0, (tmp_path / "job-1.out").read_text()[-4000:]
    assert steps_logged(run_dir) == [1, 2, 3, 4]  # every step exactly once across the requeue
    assert "restart 1" in (tmp_path / "job-1.out").read_text()
