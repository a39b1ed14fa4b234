"""The sandbox under attack: every probe must be blocked (real bubblewrap, real limits)."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hybrid_rl.rewards.sandbox import Sandbox, SandboxLimits, SandboxUnavailable, check_available
from tests.conftest import need

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _bwrap():
    need("bwrap", shutil.which("bwrap") is not None, "bubblewrap not installed (make setup installs it)")


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(
        SandboxLimits(
            cpu_seconds=3, wall_seconds=8, memory_mb=256, processes=16, file_size_mb=4, scratch_mb=16, tmp_mb=8, output_bytes=4096
        )
    )


def nobody_processes() -> list[str]:
    """Live processes of the sandbox uid (zombies awaiting their reaper hold nothing but a pid)."""
    p = subprocess.run(["ps", "-u", "65534", "-o", "pid=,stat=,args="], capture_output=True, text=True, check=False)
    return [line for line in p.stdout.splitlines() if line.split() and not line.split()[1].startswith("Z")]


def test_runs_code_and_reports(sandbox):
    r = sandbox.run("import sys; print(sum(range(10))); print('err', file=sys.stderr)", stdin="")
    assert r.ok and r.stdout == "45\n" and "err" in r.stderr


def test_cannot_read_a_secret_file(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    r = sandbox.run(f"print(open({str(secret)!r}).read())")
    assert "TOP-SECRET" not in r.stdout and r.returncode != 0
    r = sandbox.run("import os; print(open('/etc/shadow').read()); print(os.listdir('/root'))")
    assert r.returncode != 0 and "root:" not in r.stdout


def test_cannot_write_outside(sandbox, tmp_path):
    target = tmp_path / "pwned"
    r = sandbox.run(f"open({str(target)!r}, 'w').write('x')\nopen('/usr/pwned', 'w').write('x')")
    assert r.returncode != 0
    assert not target.exists() and not os.path.exists("/usr/pwned")


def test_cannot_reach_a_tcp_listener_on_localhost(sandbox):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.5)
    port = srv.getsockname()[1]
    r = sandbox.run(f"import socket; s = socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')")
    with pytest.raises(TimeoutError):
        srv.accept()  # nobody knocked
    srv.close()
    assert "connected" not in r.stdout and r.returncode != 0


def test_cannot_reach_an_abstract_unix_socket(sandbox):
    name = f"\0hybrid_rl_test_{os.getpid()}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(name)
    srv.listen(1)
    r = sandbox.run(f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({name!r}); print('connected')")
    srv.close()
    assert "connected" not in r.stdout and r.returncode != 0


def test_cannot_see_or_signal_host_processes(sandbox):
    r = sandbox.run(
        f"import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\nprint(len(pids))\nos.kill({os.getpid()}, 0)\n"
    )
    assert int(r.stdout.split()[0]) <= 3  # its own namespace: init + itself
    assert r.returncode != 0 and "ProcessLookupError" in r.stderr


def test_fork_bomb_is_contained(sandbox):
    before = len(nobody_processes())
    start = time.time()
    r = sandbox.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    assert time.time() - start < 15
    assert r.timed_out or r.returncode != 0
    time.sleep(0.5)
    assert len(nobody_processes()) <= before


def test_memory_is_limited(sandbox):
    r = sandbox.run("x = bytearray(4 * 1024**3); print('allocated')")
    assert "allocated" not in r.stdout and "MemoryError" in r.stderr


def test_infinite_loop_is_killed(sandbox):
    start = time.time()
    r = sandbox.run("while True:\n    pass\n")
    assert time.time() - start < 12
    assert r.timed_out or r.returncode != 0


def test_double_forked_orphan_does_not_outlive_the_call(sandbox, tmp_path):
    r = sandbox.run(
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    assert "parent done" in r.stdout
    time.sleep(0.5)
    assert not [p for p in nobody_processes() if "sleep" in p or "main.py" in p]


def test_huge_output_is_capped(sandbox):
    start = time.time()
    r = sandbox.run("import sys\nchunk = 'x' * 1_000_000\nfor _ in range(100):\n    sys.stdout.write(chunk)\n")
    assert time.time() - start < 15
    assert len(r.stdout) <= 4096 and r.truncated


def test_disk_fill_is_bounded(sandbox):
    free_before = shutil.disk_usage("/").free
    r = sandbox.run(
        "n = 0\n"
        "try:\n"
        "    for i in range(1000):\n"
        "        with open(f'/work/f{i}', 'wb') as f:\n"
        "            f.write(b'x' * 3_000_000)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('stopped', n, e.errno)\n"
    )
    assert "stopped" in r.stdout
    assert int(r.stdout.split()[1]) < 10  # 16 MiB scratch tmpfs
    assert abs(shutil.disk_usage("/").free - free_before) < 64 << 20


def test_no_silent_fallback(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        check_available("bwrap")
    with pytest.raises(SandboxUnavailable, match="unknown sandbox backend"):
        check_available("docker")


def test_no_leftovers_after_many_concurrent_runs(sandbox):
    from concurrent.futures import ThreadPoolExecutor

    before_tmp = {p for p in os.listdir("/tmp") if p.startswith("hybrid_rl-sbx-")}
    with ThreadPoolExecutor(16) as ex:
        results = list(ex.map(lambda i: sandbox.run(f"print({i} * 2)"), range(48)))
    assert [r.stdout.strip() for r in results] == [str(i * 2) for i in range(48)]
    after_tmp = {p for p in os.listdir("/tmp") if p.startswith("hybrid_rl-sbx-")}
    assert after_tmp <= before_tmp
    assert not nobody_processes()


def test_code_reward_scores_fraction_of_tests_passed():
    from hybrid_rl.rewards.functions import code_reward

    tests = [{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6"}, {"input": "1 1\n", "output": "3"}]
    good = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code_reward("code", good, tests) == pytest.approx(2 / 3)
    assert code_reward("code", "```python\nwhile True: pass\n```", tests) == 0.0
    assert code_reward("code", "```python\nimport socket; socket.create_connection(('8.8.8.8', 53))\n```", tests) == 0.0


# ---------------------------------------------------------------- isolation gaps closed (attack run 2)
def test_dev_shm_is_size_limited_and_dev_is_read_only(sandbox):
    """bwrap's own /dev is an unsized tmpfs: 248 MiB were written to /dev/shm before."""
    r = sandbox.run(
        "import os\n"
        "n = 0\n"
        "try:\n"
        "    with open('/dev/shm/fill', 'wb') as f:\n"
        "        for n in range(1, 200):\n"
        "            f.write(b'x' * (1 << 20)); f.flush()\n"
        "except OSError as e:\n"
        "    print('stopped', n, e.errno)\n"
        "for path in ('/dev/fill', '/dev/x/y'):\n"
        "    try:\n"
        "        open(path, 'w').write('x'); print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
        "open('/dev/null', 'w').write('ok'); print('null ok')\n"
    )
    assert "stopped" in r.stdout and int(r.stdout.split()[1]) <= 8, r  # shm_mb = 8 (and fsize 4 MiB here)
    assert "wrote" not in r.stdout and "null ok" in r.stdout


KERNEL_PROBES = (
    "import ctypes, errno, socket\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def sc(name, nr, *a):\n"
    "    rc = libc.syscall(nr, *a); print(name, rc, ctypes.get_errno())\n"
    "sc('add_key', 248, b'user', b'k', b'v', 1, -2)\n"  # KEY_SPEC_PROCESS_KEYRING... any keyring call
    "sc('keyctl', 250, 0, -3, 0, 0, 0)\n"
    "sc('io_uring_setup', 425, 1, 0)\n"
    "sc('userfaultfd', 323, 1)\n"
    "sc('ptrace', 101, 16, 1, 0, 0)\n"  # PTRACE_ATTACH to pid 1
    "sc('perf_event_open', 298, 0, 0, -1, -1, 0)\n"
    "for fam in (40, 16, 17):\n"  # AF_VSOCK, AF_NETLINK, AF_PACKET
    "    try:\n"
    "        socket.socket(fam, socket.SOCK_DGRAM if fam != 40 else socket.SOCK_STREAM); print('family', fam, 'open')\n"
    "    except OSError as e:\n"
    "        print('family', fam, 'refused', e.errno)\n"
    "socket.socket(socket.AF_INET); socket.socket(socket.AF_UNIX); print('inet unix ok')\n"
)


def test_seccomp_refuses_keyring_io_uring_userfaultfd_ptrace_and_foreign_sockets(sandbox):
    r = sandbox.run(KERNEL_PROBES)
    assert r.ok, r
    lines = dict(ln.split(" ", 1) for ln in r.stdout.splitlines() if " " in ln)
    for name in ("add_key", "keyctl", "io_uring_setup", "userfaultfd", "ptrace", "perf_event_open"):
        rc, err = lines[name].split()
        assert rc == "-1" and int(err) == 1, (name, lines[name])  # EPERM from the filter
    for fam in (40, 16, 17):
        assert f"family {fam} refused 97" in r.stdout, r.stdout  # EAFNOSUPPORT
    assert "inet unix ok" in r.stdout


def test_keyring_is_not_a_channel_between_calls(sandbox):
    add = "import ctypes; l = ctypes.CDLL(None, use_errno=True); print(l.syscall(248, b'user', b'chan', b'secret', 6, -4))"
    read = "import ctypes; l = ctypes.CDLL(None, use_errno=True); print(l.syscall(250, 10, -4, 0, 0, 0), ctypes.get_errno())"
    assert sandbox.run(add).stdout.strip() == "-1"
    assert "secret" not in sandbox.run(read).stdout


def test_lone_surrogate_and_nul_in_code_never_raise(sandbox):
    r = sandbox.run("print('\ud800')")
    assert r.returncode != 0 and "SyntaxError" in r.stderr
    r = sandbox.run("print(1)\x00")
    assert r.returncode is not None
    r = sandbox.run("print(input())", stdin="\udcff ok")
    assert r.returncode is not None


def test_a_call_killed_for_memory_says_so(sandbox):
    """tmpfs pages count against the call's memory cgroup; the OOM kill is reported by name."""
    if sandbox.mem_cg is None and sandbox.v2_cg is None:
        pytest.skip("no memory cgroup on this host")
    big = Sandbox(SandboxLimits(memory_mb=96, tmp_mb=64, file_size_mb=64, wall_seconds=20))
    r = big.run(
        "f = open('/tmp/x', 'wb')\n"
        "for _ in range(60): f.write(b'x' * (1 << 20))\n"
        "f.close()\n"
        "x = bytearray(80 << 20)\n"
        "for i in range(0, len(x), 4096): x[i] = 1\n"
        "print('survived')\n"
    )
    assert "survived" not in r.stdout
    assert "killed: memory limit" in r.stderr and "killed: memory limit" in r.notes


def test_the_trainers_working_directory_is_not_visible(sandbox):
    r = sandbox.run(
        "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        print(open(f'/proc/{p}/environ').read())"
    )
    assert os.getcwd() not in r.stdout and "/root" not in r.stdout


def test_without_a_cgroup_the_sandbox_refuses_to_start(monkeypatch):
    """A cgroup-v2-only host without a delegated subtree: no silent loss of the memory limit."""
    from hybrid_rl.rewards import sandbox as sb

    monkeypatch.setattr(sb, "_own_cgroup_dir", lambda controller: None)
    monkeypatch.setattr(sb, "_v2_cgroup_dir", lambda: None)
    with pytest.raises(SandboxUnavailable, match="no cgroup for the memory and process limits"):
        Sandbox()
    assert Sandbox(require_cgroup=False).run("print(3)").stdout == "3\n"


def test_python_tool_runs_as_many_calls_at_once_as_configured():
    import asyncio

    from hybrid_rl.rollout.tools import PythonTool

    tool = PythonTool(timeout_s=10, max_concurrency=8)
    code = "import time; time.sleep(1.0); print('ok')"

    async def many():
        t = time.perf_counter()
        out = await asyncio.gather(*(tool.execute({"code": code}) for _ in range(8)))
        return time.perf_counter() - t, out

    seconds, out = asyncio.run(many())
    assert all(r.text == "ok" for r in out)
    assert seconds < 1.9, f"8 one-second calls took {seconds:.2f} s: fewer than 8 ran at once"


# ---------------------------------------------------------------- what a killed process leaves behind
def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()  # reaped: the pid names no process now
    return p.pid


def _cgroup_bases(sandbox) -> list:
    return [d for d in (sandbox.mem_cg, sandbox.pids_cg, sandbox.v2_cg) if d is not None]


def test_a_new_sandbox_sweeps_what_dead_processes_left_and_keeps_a_live_ones(sandbox, tmp_path, monkeypatch, caplog):
    """Only entries named for a pid that no longer exists go: another run on the same machine (a
    live pid) keeps its cgroups and scratch folders."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live = subprocess.Popen(["sleep", "60"])
    dead = _dead_pid()
    made = []
    try:
        for pid in (dead, live.pid):
            scratch = tmp_path / f"hybrid_rl-sbx-{pid}-ab12cd_3"
            scratch.mkdir()
            (scratch / "main.py").write_text("print(1)")
            made.append(scratch)
            for base in _cgroup_bases(sandbox):
                (base / f"hybrid_rl-sbx-{pid}-0123456789ab").mkdir()
                made.append(base / f"hybrid_rl-sbx-{pid}-0123456789ab")
        (tmp_path / "hybrid_rl-sbx-k3j2h1g0").mkdir()  # the old name, without a pid: the owner is unknown
        with caplog.at_level("WARNING", logger="hybrid_rl"):
            Sandbox(SandboxLimits(wall_seconds=5))
        gone = [d for d in made if not d.exists()]
        assert gone == [d for d in made if f"-{dead}-" in d.name], gone
        assert len(gone) == 1 + len(_cgroup_bases(sandbox))
        assert (tmp_path / "hybrid_rl-sbx-k3j2h1g0").is_dir()
        lines = [r.getMessage() for r in caplog.records if "leftovers" in r.getMessage()]
        assert len(lines) == 1 and all(str(d) in lines[0] for d in gone), lines
    finally:
        live.kill()
        live.wait()
        for d in made:
            if d.exists() and d.parent != tmp_path:
                d.rmdir()


KILLED_CHILD = """
from hybrid_rl.rewards import sandbox as sb
make = sb.Sandbox._make_cgroups
def announce(self, lim):
    made = make(self, lim)
    print("CGROUPS", *made, flush=True)
    return made
sb.Sandbox._make_cgroups = announce
sb.Sandbox(sb.SandboxLimits(wall_seconds=60, cpu_seconds=60)).run("import time; print('started', flush=True); time.sleep(60)")
"""


@pytest.fixture
def open_tmp():
    """A temp dir the sandbox's uid can reach (pytest's tmp_path is under a 0700 folder of root's)."""
    d = Path(tempfile.mkdtemp(prefix="hybrid_rl-test-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_process_killed_mid_call_leaves_nothing_after_the_next_sandbox_starts(open_tmp, monkeypatch):
    """SIGKILL runs no ``finally``: the call's cgroups and scratch folder stayed for good."""
    tmp_path = open_tmp
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD], stdout=subprocess.PIPE, text=True, env=env)
    cgroups = []
    try:
        line = child.stdout.readline()
        assert line.startswith("CGROUPS"), line
        cgroups = [Path(p) for p in line.split()[1:]]
        scratch = [d for d in tmp_path.iterdir() if d.name.startswith("hybrid_rl-sbx-")]
        deadline = time.time() + 30
        while not any((d / "stdout").is_file() and (d / "stdout").read_text() for d in scratch) and time.time() < deadline:
            time.sleep(0.1)
        assert [(d / "stdout").read_text() for d in scratch] == ["started\n"]  # mid-call
        child.kill()
        child.wait()
        deadline = time.time() + 10  # bwrap --die-with-parent takes the sandbox down with the child
        while any((d / "cgroup.procs").read_text().strip() for d in cgroups) and time.time() < deadline:
            time.sleep(0.1)
        assert cgroups and all(d.is_dir() for d in cgroups) and scratch[0].is_dir()  # what the kill left
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        Sandbox(SandboxLimits(wall_seconds=5))
        assert not [d for d in cgroups if d.exists()]
        assert not [d for d in tmp_path.iterdir() if d.name.startswith("hybrid_rl-sbx-")]
        assert not [p for p in nobody_processes() if "main.py" in p]
    finally:
        child.kill()
        for d in cgroups:
            if d.exists():
                d.rmdir()
