"""Running model-written code in a bubblewrap sandbox (no network, no host files, hard limits).

Per call (see :meth:`Sandbox.run`):

- a fresh root with only ``/usr`` (read-only; ``/bin``, ``/lib`` as links into it), ``/proc``,
  a minimal ``/dev`` remounted read-only with a size-limited ``/dev/shm``, a size-limited tmpfs
  scratch directory ``/work`` holding the program (bound read-only), and a size-limited tmpfs
  ``/tmp``: every writable mount has a size, and tmpfs pages count against the call's memory
  cgroup (bwrap's own ``/dev`` is an unsized tmpfs: 248 MiB were written to ``/dev/shm``
  before); every namespace unshared (no network,
  no host PIDs, no abstract unix sockets, no IPC), a new session, no nested user namespaces,
  an empty environment;
- launched as an unprivileged uid (``setpriv``) even when the trainer is root: as root the
  process-count limit is never enforced;
- limits set *inside* the sandbox with ``prlimit`` (CPU seconds, address space, processes, file
  size, open files, no core dumps): limits set outside are shared by every sandbox of the uid;
- a seccomp filter (built with libseccomp through ``pyseccomp``, handed to bwrap) that refuses
  the kernel keyring (a channel between calls, and a per-uid quota one call could exhaust),
  io_uring, userfaultfd, ptrace, perf, bpf, mounts and namespaces, module and kexec calls, and
  every socket family but unix/inet/inet6 (AF_VSOCK shares the VM's port space: the network
  namespace does not cover it); see :func:`seccomp_filter`;
- a memory + pids cgroup per call (RLIMIT_AS is not a resident-memory limit): cgroup v1
  controllers where writable, else a cgroup v2 subtree delegated to this process; where neither
  exists the sandbox refuses to start (``require_cgroup=False`` accepts rlimits only). The
  launcher moves itself into the cgroups before it execs, so nothing escapes them;
- a wall-clock timeout that SIGKILLs bwrap, whose ``--die-with-parent`` init takes the whole
  PID namespace (double-forked orphans included) down with it;
- output written to a file capped by the file-size limit and read back truncated to
  ``output_bytes``;
- a process killed outright (SIGKILL) mid-call runs no clean-up, so cgroups and scratch folders
  are named ``hybrid_rl-sbx-<pid>-<random>`` after their maker, and each new sandbox removes those
  of dead processes (:func:`sweep_leftovers`); a live one's, another run's included, stay.

If bwrap (or the uid, setpriv, prlimit) is missing, :func:`check_available` raises at start.
There is no silent fallback: ``backend="none"`` runs code unsandboxed only when asked for
explicitly, and says so loudly on every call (trusted code only).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from hybrid_rl.errors import SandboxUnavailable  # re-exported
from hybrid_rl.rewards.seccomp import seccomp_filter

log = logging.getLogger("hybrid_rl")

UNPRIVILEGED_UID = 65534  # nobody
PREFIX = "hybrid_rl-sbx-"  # + "<pid of the process that made it>-<random>": cgroups and scratch folders
_OWNED = re.compile(re.escape(PREFIX) + r"(\d+)-\w+")


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
    shm_mb: int = 8


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


def _v2_cgroup_dir() -> Path | None:
    """This process's cgroup v2 directory if it delegates memory and pids to children we may create."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        path = next(ln.split(":", 2)[2] for ln in lines if ln.startswith("0::"))
        d = Path("/sys/fs/cgroup") / path.lstrip("/")
        enabled = set((d / "cgroup.subtree_control").read_text().split())
    except (OSError, StopIteration):
        return None
    return d if {"memory", "pids"} <= enabled and os.access(d, os.W_OK) else None


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
    try:
        seccomp_filter()
    except (ImportError, OSError, RuntimeError) as e:
        raise SandboxUnavailable(
            f"sandbox needs a seccomp filter: pip install pyseccomp and the libseccomp2 library ({type(e).__name__}: {e})"
        ) from e
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
        require_cgroup: bool = True,
    ) -> None:
        check_available(backend)
        self.limits = limits or SandboxLimits()
        self.backend = backend
        self.python = python
        self.slots = threading.BoundedSemaphore(max_concurrency)
        self.mem_cg = _own_cgroup_dir("memory")
        self.pids_cg = _own_cgroup_dir("pids")
        self.v2_cg = None if (self.mem_cg and self.pids_cg) else _v2_cgroup_dir()
        if backend == "bwrap" and not (self.mem_cg and self.pids_cg) and self.v2_cg is None and require_cgroup:
            raise SandboxUnavailable(
                "sandbox: no cgroup for the memory and process limits (cgroup v1 memory/pids not writable, and this "
                "process's cgroup v2 does not delegate memory and pids in cgroup.subtree_control); run the trainer in a "
                "delegated cgroup (e.g. systemd-run --scope -p Delegate=yes ...) or pass require_cgroup=False to rely "
                "on rlimits alone (RLIMIT_AS is not a resident-memory limit)"
            )
        if backend == "bwrap":
            sweep_leftovers([d for d in (self.mem_cg, self.pids_cg, self.v2_cg) if d is not None], Path(tempfile.gettempdir()))

    # -------------------------------------------------------------- public
    def run(self, code: str, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
        """Run ``code`` with ``python3 -I`` inside a fresh sandbox; never raises for the program's faults."""
        lim = limits or self.limits
        with self.slots:
            if self.backend == "none":
                return self._run_unsandboxed(code, stdin, lim)
            return self._run_bwrap(code, stdin, lim)

    # -------------------------------------------------------------- bwrap
    def _bwrap_argv(self, prog: Path, lim: SandboxLimits, seccomp_fd: int) -> list[str]:
        """bwrap's command line: namespaces, the filesystem (every writable mount sized), the
        environment, then prlimit's limits around ``python3 -I -S /work/main.py``."""
        return [
            "bwrap", "--seccomp", str(seccomp_fd),
            "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--disable-userns", "--clearenv",
            "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
            "--proc", "/proc",
            "--dev", "/dev", "--size", str(lim.shm_mb << 20), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
            "--size", str(lim.tmp_mb << 20), "--tmpfs", "/tmp",
            "--size", str(lim.scratch_mb << 20), "--tmpfs", "/work",
            "--ro-bind", str(prog), "/work/main.py", "--chdir", "/work",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work", "--setenv", "LANG", "C.UTF-8",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--",
            "prlimit", f"--cpu={lim.cpu_seconds}", f"--as={lim.memory_mb << 20}", f"--nproc={lim.processes}",
            f"--fsize={lim.file_size_mb << 20}", f"--nofile={lim.open_files}", "--core=0",
            "--",
            self.python, "-I", "-S", "/work/main.py",
        ]  # fmt: skip

    def _make_cgroups(self, lim: SandboxLimits) -> list[Path]:
        made = []
        name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        mem = lim.memory_mb << 20
        if self.v2_cg is not None:
            plan = [(self.v2_cg, {"memory.max": mem, "memory.swap.max": 0, "pids.max": lim.processes})]
        else:
            plan = [
                (self.mem_cg, {"memory.limit_in_bytes": mem, "memory.memsw.limit_in_bytes": mem}),
                (self.pids_cg, {"pids.max": lim.processes}),
            ]
        for base, settings in plan:
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
        host_dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        cgroups: list[Path] = []
        notes: list[str] = []
        seccomp_fd = -1
        try:
            prog = host_dir / "main.py"
            # surrogatepass: a lone surrogate reaches Python as invalid UTF-8, which the program's
            # own SyntaxError reports (str.write_text raised UnicodeEncodeError here before).
            prog.write_bytes(code.encode("utf-8", "surrogatepass"))
            prog.chmod(0o644)
            host_dir.chmod(0o755)
            out_path, err_path, in_path = host_dir / "stdout", host_dir / "stderr", host_dir / "stdin"
            in_path.write_bytes(stdin.encode("utf-8", "surrogatepass"))
            bpf = host_dir / "seccomp.bpf"
            bpf.write_bytes(seccomp_filter())
            seccomp_fd = os.open(bpf, os.O_RDONLY)
            cgroups = self._make_cgroups(lim)
            argv = self._launcher_argv(cgroups, prog, lim, seccomp_fd)
            rc, timed_out = _wait_capped(argv, in_path, out_path, err_path, seccomp_fd, lim.wall_seconds)
            stdout, t1 = _read_capped(out_path, lim.output_bytes)
            stderr, t2 = _read_capped(err_path, lim.output_bytes)
            if rc is not None and rc < 0:
                notes.append(f"killed by signal {-rc}")
            if rc in (-9, 137) and _oom_killed(cgroups):
                # The OOM killer leaves no output: say why, so the model is told.
                notes.append("killed: memory limit")
                stderr = (stderr + f"\nkilled: memory limit ({lim.memory_mb} MiB)").lstrip("\n")
            return SandboxResult(
                stdout, stderr, None if timed_out else rc, timed_out, time.perf_counter() - start, t1 or t2, notes
            )
        finally:
            if seccomp_fd >= 0:
                os.close(seccomp_fd)
            for d in cgroups:
                _remove_cgroup(d)
            shutil.rmtree(host_dir, ignore_errors=True)

    def _launcher_argv(self, cgroups: list[Path], prog: Path, lim: SandboxLimits, seccomp_fd: int) -> list[str]:
        """The launcher (still root) joins the cgroups, then becomes the unprivileged uid and execs bwrap."""
        join = " ".join(f'echo $$ > "{d}/cgroup.procs";' for d in cgroups)
        drop = []
        if os.geteuid() == 0:
            uid = UNPRIVILEGED_UID
            drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"]
        return ["sh", "-c", f'{join} exec "$@"', "sandbox", *drop, *self._bwrap_argv(prog, lim, seccomp_fd)]

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


def _wait_capped(
    argv: list[str], stdin: Path, stdout: Path, stderr: Path, seccomp_fd: int, wall_s: float
) -> tuple[int | None, bool]:
    """Run the launcher with files for its streams; SIGKILL its whole session after ``wall_s``.
    Returns (exit status, timed out)."""
    with open(stdin, "rb") as fin, open(stdout, "wb") as fout, open(stderr, "wb") as ferr:
        # cwd "/": bwrap's init (pid 1 in the sandbox) keeps the launcher's environment, and sh
        # exports PWD; the trainer's working directory must not show there.
        proc = subprocess.Popen(
            argv, stdin=fin, stdout=fout, stderr=ferr, start_new_session=True, close_fds=True,
            pass_fds=(seccomp_fd,), cwd="/", env={"PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        try:
            return proc.wait(timeout=wall_s), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            return proc.wait(), True


def _read_capped(path: Path, cap: int) -> tuple[str, bool]:
    with open(path, "rb") as fh:
        data = fh.read(cap + 1)
    return data[:cap].decode("utf-8", errors="replace"), len(data) > cap


def _oom_killed(cgroups: list[Path]) -> bool:
    """Whether the kernel's OOM killer acted in any of the call's cgroups (v1 memory.oom_control,
    v2 memory.events: ``oom_kill N``)."""
    for d in cgroups:
        for name in ("memory.oom_control", "memory.events"):
            try:
                fields = dict(line.split() for line in (d / name).read_text().splitlines() if line.strip())
            except (OSError, ValueError):
                continue
            if int(fields.get("oom_kill", "0")) > 0:
                return True
    return False


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


def _owner_gone(name: str) -> bool:
    """A sandbox's name whose maker is certainly dead (no pid in it, or a live one even if reused: kept)."""
    m = _OWNED.fullmatch(name)
    if m is None:
        return False
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, another user's
        pass
    return False


def sweep_leftovers(cgroup_bases: list[Path], tmp_dir: Path) -> list[Path]:
    """Remove what killed processes left: their cgroups under ``cgroup_bases`` (only when empty:
    ``cgroup.procs`` lists no process) and their scratch folders in ``tmp_dir``. One log line when
    it removed or had to keep anything; returns what was removed."""
    swept, kept = [], []
    for d in [d for base in cgroup_bases for d in base.glob(PREFIX + "*")] + list(tmp_dir.glob(PREFIX + "*")):
        if not (_owner_gone(d.name) and d.is_dir()):
            continue
        try:
            in_tmp = d.parent == tmp_dir
            if not in_tmp and (d / "cgroup.procs").read_text().strip():
                raise OSError("processes still inside")
            shutil.rmtree(d) if in_tmp else d.rmdir()
            swept.append(d)
        except FileNotFoundError:  # another sandbox swept it first
            pass
        except OSError as e:
            kept.append(f"{d} ({e.strerror or e})")
    if swept or kept:
        what = f"removed {len(swept)} leftovers of killed processes: {', '.join(map(str, swept)) or 'none'}"
        log.warning("sandbox: %s%s", what, f"; kept {len(kept)}: {', '.join(kept)}" if kept else "")
    return swept
