"""The launcher's supervision (``hybrid_rl.launch.Launcher.wait``) on plain processes: a rank
that fails ends the run, the others are stopped after ``failure_grace_s``, and the exit status
is the failing rank's."""

import subprocess
import sys
import time

import pytest

from hybrid_rl.launch import Launcher

pytestmark = pytest.mark.unit


def launcher_of(*scripts: str, grace: float = 1.0) -> Launcher:
    la = Launcher(len(scripts), [], shutdown_grace_s=30.0, failure_grace_s=grace)
    la.procs = [subprocess.Popen([sys.executable, "-c", s]) for s in scripts]
    return la


def test_a_failed_rank_stops_the_others_after_the_grace():
    """One rank exits 3 while the other sleeps outside any collective (it would never notice):
    the launcher SIGKILLs it after the 1 s grace and returns 3, instead of waiting 60 s."""
    la = launcher_of("import sys; sys.exit(3)", "import time; time.sleep(60)")
    start = time.monotonic()
    code = la.wait()
    elapsed = time.monotonic() - start
    assert code == 3
    assert elapsed < 15, f"the launcher waited {elapsed:.1f} s for a rank that would never finish"
    assert la.procs[1].returncode == -9 and la.killed


def test_a_rank_killed_by_a_signal_maps_to_128_plus_the_signal():
    la = launcher_of("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "import time; time.sleep(60)")
    assert la.wait() == 137


def test_all_ranks_succeeding_is_zero_and_kills_nothing():
    la = launcher_of("pass", "import time; time.sleep(0.5)")
    assert la.wait() == 0 and not la.killed
