"""The single-node launcher that ``python -m hybrid_rl.main trainer.nproc_per_node=N`` starts.

It does what ``torchrun --standalone`` did (one process per rank, the same ``RANK`` /
``LOCAL_RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` environment) and one thing
torchrun does not: it lets the ranks finish when the run is interrupted.

- The ranks run in their own process group, so a terminal's Ctrl-C (SIGINT to the foreground
  group) or ``kill -TERM -PGID`` reaches the launcher only. The launcher forwards the first
  SIGINT / SIGTERM / SIGUSR1 to every rank exactly once; each rank then finishes its current
  step, writes a checkpoint and exits 0 (``RLTrainer`` handles the signal).
- It waits for them at most ``trainer.shutdown_grace_s`` seconds, then SIGKILLs them. A
  second SIGINT / SIGTERM to the launcher SIGKILLs them at once. Either way the newest
  *complete* checkpoint stays resumable (checkpoints are written to a temporary directory and
  renamed when whole), and ``trainer.resume=auto`` continues from it.
- torchrun's agent, given a second SIGTERM while shutting down (scancel, a second Ctrl-C, a
  ``timeout`` wrapper), died in its own handler with a SignalException and took the ranks with
  it before they could save. Nothing here raises from a signal handler.
- A rank that exits non-zero (an error, a kill) ends the run: the others get
  ``failure_grace_s`` seconds to print their own error, then are SIGKILLed; the launcher exits
  with the first failing rank's code (2 for a configuration or input error).
- Ranks die with the launcher: each asks Linux for SIGTERM when its parent dies
  (:func:`die_with_launcher`), so a SIGKILLed launcher leaves no orphans (they checkpoint and exit).

Multi-node runs keep torchrun's c10d rendezvous (``recipes/slurm/multi_node.sbatch``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_launcher() -> None:
    """Called by each rank at start: SIGTERM this process when the launcher dies (Linux
    ``PR_SET_PDEATHSIG``), so a SIGKILLed launcher leaves no orphans; they checkpoint and exit."""
    launcher = os.environ.get("HYBRID_RL_LAUNCHER_PID")
    if not launcher:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: no orphan protection, nothing else changes
        return
    if os.getppid() != int(launcher):  # it died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


def rank_env(rank: int, nproc: int, port: int, base: dict[str, str] | None = None, preload: list[str] | None = None) -> dict[str, str]:
    """The environment torchrun --standalone gives rank ``rank`` of ``nproc`` on this node, plus
    ``preload`` (``trainer.preload``'s libraries) in front of any ``LD_PRELOAD`` already set."""
    env = dict(os.environ if base is None else base)
    if preload:
        have = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
        env["LD_PRELOAD"] = ":".join([*[p for p in preload if p not in have], *have])
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), ROLE_NAME="default",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID=f"hybrid_rl-{os.getpid()}", HYBRID_RL_LAUNCHER_PID=str(os.getpid()),
    )  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


class Launcher:
    """Start ``nproc`` ranks of ``argv`` and supervise them (see the module docstring)."""

    def __init__(
        self, nproc: int, argv: list[str], shutdown_grace_s: float, failure_grace_s: float = 10.0, preload: list[str] | None = None
    ) -> None:
        self.nproc, self.argv, self.preload = nproc, argv, preload or []
        self.shutdown_grace_s, self.failure_grace_s = shutdown_grace_s, failure_grace_s
        self.procs: list[subprocess.Popen] = []
        self.signals: list[int] = []
        self.deadline: float | None = None
        self.killed = False

    def log(self, msg: str) -> None:
        print(f"[hybrid_rl launcher] {msg}", file=sys.stderr, flush=True)

    def on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)
        name = signal.Signals(signum).name
        if signum == signal.SIGUSR1:  # Slurm's warning: forward, no deadline of ours
            self._send(signum)
            return
        if sum(s != signal.SIGUSR1 for s in self.signals) == 1:
            self.log(
                f"{name}: asking the {self.nproc} ranks to checkpoint after their current step "
                f"(up to {self.shutdown_grace_s:.0f} s; send it again to stop at once)"
            )
            self._send(signum)
            self.deadline = time.monotonic() + self.shutdown_grace_s
        else:
            self.log(f"second {name}: stopping the ranks now; the last complete checkpoint is kept")
            self._kill()

    def _send(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    def _kill(self) -> None:
        self.killed = True
        self._send(signal.SIGKILL)

    def start(self) -> None:
        port = _free_port()
        for sig in FORWARDED:
            signal.signal(sig, self.on_signal)
        cmd = [sys.executable, "-m", "hybrid_rl.main", *self.argv]
        for rank in range(self.nproc):
            self.procs.append(subprocess.Popen(cmd, env=rank_env(rank, self.nproc, port, preload=self.preload), process_group=0))

    def wait(self) -> int:
        first_failure: int | None = None
        failure_deadline: float | None = None
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            failed = [c for c in codes if c not in (None, 0)]
            if failed and first_failure is None:
                first_failure = failed[0]
                failure_deadline = now + self.failure_grace_s
                self.log(f"a rank exited with {first_failure}; stopping the others")
            if failure_deadline is not None and now > failure_deadline and not self.killed:
                self._kill()
            if self.deadline is not None and now > self.deadline and not self.killed:
                self.log(f"the ranks did not finish within trainer.shutdown_grace_s={self.shutdown_grace_s:.0f} s; killing them")
                self._kill()
            time.sleep(0.1)
        codes = [p.returncode for p in self.procs]
        if all(c == 0 for c in codes):
            return 0
        interrupts = [s for s in self.signals if s != signal.SIGUSR1]
        if self.killed and interrupts:
            return 128 + interrupts[-1]
        bad = first_failure if first_failure is not None else next(c for c in codes if c != 0)
        return bad if bad > 0 else 128 - bad  # -9 (killed by SIGKILL) -> 137


def launch(nproc: int, argv: list[str], shutdown_grace_s: float, preload: list[str] | None = None) -> int:
    launcher = Launcher(nproc, argv, shutdown_grace_s, preload=preload)
    launcher.start()
    return launcher.wait()
