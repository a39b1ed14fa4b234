"""Running model-written code in a bubblewrap sandbox (no network, no host files, hard limits).

Per call (see :meth:`Sandbox.run`):

- a fresh root with only ``/usr`` (read-only; ``/bin``, ``/lib`` as links into it), ``/proc``,
  a minimal ``/dev``, a size-limited tmpfs scratch directory ``/work`` holding the program
  (bound read-only), and a size-limited tmpfs ``/tmp``; every namespace unshared (no network,
  no host PIDs, no abstract unix sockets, no IPC), a new session, no nested user namespaces,
  an empty environment;
- launched as an unprivileged uid (``setpriv``) even when the trainer is root: as root the
  process-count limit is never enforced;
- limits set *inside* the sandbox with ``prlimit`` (CPU seconds, address space, processes, file
  size, open files, no core dumps): limits set outside are shared by every sandbox of the uid;
- a v1 memory + pids cgroup per call where one is writable (RLIMIT_AS is not a resident-memory
  limit); the launcher moves itself into the cgroups before it execs, so nothing escapes them;
- a wall-clock timeout that SIGKILLs bwrap, whose ``--die-with-parent`` init takes the whole
  PID namespace (double-forked orphans included) down with it;
- output written to a file capped by the file-size limit and read back truncated to
  ``output_bytes``.

If bwrap (or the uid, setpriv, prlimit) is missing, :func:`check_available` raises at start.
There is no silent fallback: ``backend="none"`` runs code unsandboxed only when asked for
explicitly, and says so loudly on every call (trusted code only).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("hybrid_rl")

UNPRIVILEGED_UID = 65534  # nobody


class SandboxUnavailable(RuntimeError):
    """No working isolation mechanism is installed."""


@dataclass
class SandboxLimits:
    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_mb: int = 512
    processes: int = 32
    file_size_mb: int = 8
    open_files: int = 64
    scratch_mb: int = 64
    tmp_mb: int = 32
    output_bytes: int = 8192


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None
    timed_out: bool
    seconds: float
    truncated: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _own_cgroup_dir(controller: str) -> Path | None:
    """This process's v1 cgroup directory for ``controller`` if we may create children in it."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controller in controllers.split(","):
                d = Path("/sys/fs/cgroup") / controller / path.lstrip("/")
                return d if d.is_dir() and os.access(d, os.W_OK) else None
    except OSError:
        return None
    return None


def check_available(backend: str = "bwrap") -> None:
    """Raise :class:`SandboxUnavailable` with what to install, if the backend cannot run."""
    if backend == "none":
        return
    if backend != "bwrap":
        raise SandboxUnavailable(f"unknown sandbox backend {backend!r}; known: bwrap, none (trusted code only)")
    missing = [t for t in ("bwrap", "setpriv", "prlimit") if shutil.which(t) is None]
    if missing:
        raise SandboxUnavailable(
            f"sandbox needs {', '.join(missing)} (Debian: apt-get install bubblewrap util-linux); model-written "
            "code is never run unsandboxed unless sandbox.backend=none is set explicitly for trusted code"
        )
    if os.geteuid() != 0 and os.geteuid() != UNPRIVILEGED_UID:
        log.info("sandbox: not root, so code runs as the current uid %d (limits still apply inside)", os.geteuid())


class Sandbox:
    """Runs Python programs under bubblewrap with the limits above; thread-safe, bounded concurrency."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        backend: str = "bwrap",
        python: str = "/usr/bin/python3",
        max_concurrency: int = 8,
    ) -> None:
        check_available(backend)
        self.limits = limits or SandboxLimits()
        self.backend = backend
        self.python = python
        self.slots = threading.BoundedSemaphore(max_concurrency)
        self.mem_cg = _own_cgroup_dir("memory")
        self.pids_cg = _own_cgroup_dir("pids")

    # -------------------------------------------------------------- public
    def run(self, code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
        """Run ``code`` with ``python3 -I`` inside a fresh sandbox; never raises for the program's faults."""
        lim = limits or self.limits
        with self.slots:
            if self.backend == "none":
                return self._run_unsandboxed(code, stdin, lim)
            return self._run_bwrap(code, stdin, lim)

    # -------------------------------------------------------------- bwrap
    def _bwrap_argv(self, prog: Path, lim: SandboxLimits) -> list[str]:
        argv = [
            "bwrap",
            "--unshare-all",
            "--unshare-user",
            "--die-with-parent",
            "--new-session",
            "--disable-userns",
            "--clearenv",
            "--ro-bind",
            "/usr",
            "/usr",
            "--symlink",
            "usr/bin",
            "/bin",
            "--symlink",
            "usr/lib",
            "/lib",
            "--symlink",
            "usr/lib64",
            "/lib64",
            "--symlink",
            "usr/sbin",
            "/sbin",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(lim.tmp_mb << 20),
            "--tmpfs",
            "/tmp",
            "--size",
            str(lim.scratch_mb << 20),
            "--tmpfs",
            "/work",
            "--ro-bind",
            str(prog),
            "/work/main.py",
            "--chdir",
            "/work",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "HOME",
            "/work",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--setenv",
            "PYTHONDONTWRITEBYTECODE",
            "1",
            "--",
            "prlimit",
            f"--cpu={lim.cpu_seconds}",
            f"--as={lim.memory_mb << 20}",
            f"--nproc={lim.processes}",
            f"--fsize={lim.file_size_mb << 20}",
            f"--nofile={lim.open_files}",
            "--core=0",
            "--",
            self.python,
            "-I",
            "-S",
            "/work/main.py",
        ]
        return argv

    def _make_cgroups(self, lim: SandboxLimits) -> list[Path]:
        made = []
        name = f"hybrid_rl-sbx-{uuid.uuid4().hex[:12]}"
        for base, settings in (
            (self.mem_cg, {"memory.limit_in_bytes": lim.memory_mb << 20, "memory.memsw.limit_in_bytes": lim.memory_mb << 20}),
            (self.pids_cg, {"pids.max": lim.processes}),
        ):
            if base is None:
                continue
            d = base / name
            try:
                d.mkdir()
                for k, v in settings.items():
                    try:
                        (d / k).write_text(str(v))
                    except OSError:
                        pass  # memsw needs swap accounting; memory.limit alone still holds RSS
                made.append(d)
            except OSError:
                continue
        return made

    def _run_bwrap(self, code: str, stdin: str, lim: SandboxLimits) -> SandboxResult:
        start = time.perf_counter()
        host_dir = Path(tempfile.mkdtemp(prefix="hybrid_rl-sbx-"))
        cgroups: list[Path] = []
        notes: list[str] = []
        try:
            prog = host_dir / "main.py"
            prog.write_text(code)
            prog.chmod(0o644)
            host_dir.chmod(0o755)
            out_path, err_path, in_path = host_dir / "stdout", host_dir / "stderr", host_dir / "stdin"
            in_path.write_text(stdin)
            cgroups = self._make_cgroups(lim)
            # The launcher (still root) joins the cgroups, then becomes the unprivileged uid and execs bwrap.
            join = " ".join(f'echo $$ > "{d}/cgroup.procs";' for d in cgroups)
            drop = []
            if os.geteuid() == 0:
                drop = [
                    "setpriv",
                    f"--reuid={UNPRIVILEGED_UID}",
                    f"--regid={UNPRIVILEGED_UID}",
                    "--clear-groups",
                    "--no-new-privs",
                    "--",
                ]
            argv = ["sh", "-c", f'{join} exec "$@"', "sandbox", *drop, *self._bwrap_argv(prog, lim)]
            with open(in_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr:
                proc = subprocess.Popen(
                    argv,
                    stdin=fin,
                    stdout=fout,
                    stderr=ferr,
                    start_new_session=True,
                    close_fds=True,
                    env={"PATH": "/usr/bin:/bin"},
                )
                timed_out = False
                try:
                    rc = proc.wait(timeout=lim.wall_seconds)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    os.killpg(proc.pid, 9)
                    rc = proc.wait()
            stdout, t1 = _read_capped(out_path, lim.output_bytes)
            stderr, t2 = _read_capped(err_path, lim.output_bytes)
            if rc is not None and rc < 0:
                notes.append(f"killed by signal {-rc}")
            return SandboxResult(
                stdout, stderr, None if timed_out else rc, timed_out, time.perf_counter() - start, t1 or t2, notes
            )
        finally:
            for d in cgroups:
                _remove_cgroup(d)
            shutil.rmtree(host_dir, ignore_errors=True)

    # -------------------------------------------------------------- opt-out
    def _run_unsandboxed(self, code: str, stdin: str, lim: SandboxLimits) -> SandboxResult:
        log.warning("SANDBOX DISABLED (sandbox.backend=none): running model-written code unsandboxed; trusted code only")
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="hybrid_rl-unsafe-") as d:
            try:
                p = subprocess.run(
                    [self.python, "-I", "-c", code],
                    input=stdin,
                    capture_output=True,
                    text=True,
                    cwd=d,
                    timeout=lim.wall_seconds,
                    check=False,
                )
                return SandboxResult(
                    p.stdout[: lim.output_bytes],
                    p.stderr[: lim.output_bytes],
                    p.returncode,
                    False,
                    time.perf_counter() - start,
                    len(p.stdout) > lim.output_bytes,
                    ["UNSANDBOXED"],
                )
            except subprocess.TimeoutExpired:
                return SandboxResult("", "", None, True, time.perf_counter() - start, False, ["UNSANDBOXED"])


def _read_capped(path: Path, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as fh:
        data = fh.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def _remove_cgroup(d: Path) -> None:
    """Kill anything left in the cgroup, then remove it (retrying while the kernel reaps)."""
    for _ in range(50):
        try:
            pids = [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        try:
            d.rmdir()
            return
        except OSError:
            time.sleep(0.02)
    log.warning("sandbox: could not remove cgroup %s", d)
