"""A real one-node Slurm cluster for the tests: Debian's slurmctld + slurmd + munge on localhost.

Installs the packages if missing (root + apt), writes a slurm.conf, starts the daemons, waits
until the node is idle, and tears everything down. It uses proctrack/linuxproc
(no cgroup plugin on a hybrid cgroup host), batch_sched_delay=0 so jobs start at once, and
MinJobAge=3600 so a finished or failed job's record is still there for a failing test's message.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

CONF = """\
ClusterName=hybridrl
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerParameters=batch_sched_delay=0
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
MinJobAge=3600
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurmctld.log
SlurmdLogFile=/var/log/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=16000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def run(*cmd: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check, timeout=timeout)


def ensure_installed() -> None:
    if all(shutil.which(t) for t in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0:
        raise RuntimeError("Slurm is not installed and installing it needs root (apt-get)")
    pkgs = ["slurmctld", "slurmd", "slurm-client", "munge"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    p = subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *pkgs],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )
    if p.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, check=False, timeout=600)
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", *pkgs],
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=600,
        )


class Cluster:
    def __init__(self) -> None:
        self.host = socket.gethostname().split(".")[0]

    def start(self) -> None:
        ensure_installed()
        self.stop()
        for d in ("/run/munge", "/var/spool/slurmctld", "/var/spool/slurmd", "/etc/slurm"):
            Path(d).mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        if not Path("/etc/munge/munge.key").exists():
            run("mungekey", "--create", check=False)
        run("runuser", "-u", "munge", "--", "/usr/sbin/munged", check=False)
        Path("/etc/slurm/slurm.conf").write_text(CONF.format(host=self.host, cpus=os.cpu_count() or 2))
        run("slurmctld", "-c", "-i")
        run("slurmd", "-N", self.host)
        deadline = time.time() + 60
        while time.time() < deadline:
            p = run("sinfo", "-h", "-o", "%T", check=False)
            if p.returncode == 0 and p.stdout.strip() in ("idle", "mixed"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"slurm node never became idle: {run('sinfo', check=False).stdout}")

    def stop(self) -> None:
        run("scancel", "--full", "-u", "root", check=False)
        for pidfile in ("/run/slurmd.pid", "/run/slurmctld.pid"):
            try:
                os.kill(int(Path(pidfile).read_text().strip()), 15)
            except (OSError, ValueError):
                pass
        run("pkill", "-x", "slurmd", check=False)
        run("pkill", "-x", "slurmctld", check=False)
        time.sleep(0.5)

    def shutdown(self) -> None:
        self.stop()
        run("pkill", "-x", "munged", check=False)

    @staticmethod
    def log_tail(daemon: str, lines: int = 40) -> str:
        """The last lines of slurmctld's or slurmd's log (for a failing test's message)."""
        try:
            return "\n".join(Path(f"/var/log/{daemon}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"({e})"

    @staticmethod
    def job(job_id: str) -> dict[str, str]:
        p = run("scontrol", "show", "job", "-o", job_id, check=False)
        fields = {}
        for tok in p.stdout.split():
            if "=" in tok:
                k, _, v = tok.partition("=")
                fields[k] = v
        return fields

    def wait(
        self,
        job_id: str,
        timeout: float = 600,
        states: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"),
    ) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(1)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout}s")
