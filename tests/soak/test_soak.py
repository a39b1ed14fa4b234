"""Soak (marker ``slow``; ``make soak``): a long GRPO run and a thousand sandboxed executions must
leave memory, file descriptors, threads and processes flat. Excluded from ``make test``."""

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
STEPS = 110


def window(rows: list[dict], key: str, lo: int, hi: int) -> float:
    xs = sorted(r[key] for r in rows if lo <= r["step"] <= hi)
    return xs[len(xs) // 2]


@pytest.mark.timeout(3100)  # the run's own budget is 3,000 s
def test_long_grpo_run_stays_flat(tmp_path):
    cmd = [
        sys.executable, "-m", "hybrid_rl.main", "+recipe=grpo_math", "model.path=builtin:tiny",
        f"trainer.output_dir={tmp_path}", f"trainer.total_steps={STEPS}", "trainer.val_every=0",
        "trainer.val_before_train=false", "trainer.save_every=50", "trainer.keep_last=1", "logger.progress_bar=false",
        "data.train_batch_size=8", "rollout.n=4", "rollout.max_response_length=32", "rollout.val_pass_k=0",
        "algorithm.filter_groups.enable=false", "actor.micro_batch_size=32",
    ]  # fmt: skip
    start = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, timeout=3000)
    assert p.returncode == 0, p.stderr[-5000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "sys/rss_mib" in r]
    assert len(rows) == STEPS and rows[-1]["weights_version"] >= STEPS  # >= 2 * STEPS switches
    early, late = (45, 55), (STEPS - 10, STEPS)  # steady state: after allocator and cache warm-up
    figures = {
        k: (window(rows, k, *early), window(rows, k, *late))
        for k in ("sys/rss_mib", "sys/open_fds", "sys/threads", "sys/child_procs")
    }
    print(json.dumps({"seconds": time.perf_counter() - start, "steps": STEPS, "early_vs_late": figures}))
    rss0, rss1 = figures["sys/rss_mib"]
    assert rss1 - rss0 < max(64.0, 0.05 * rss0), figures
    assert figures["sys/open_fds"][1] <= figures["sys/open_fds"][0] + 2, figures
    assert figures["sys/threads"][1] <= figures["sys/threads"][0] + 2, figures
    assert figures["sys/child_procs"][1] <= figures["sys/child_procs"][0], figures


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed (make setup installs it)")
def test_thousand_sandboxed_runs_leave_nothing_behind():
    from hybrid_rl.rewards.sandbox import Sandbox, SandboxLimits

    sb = Sandbox(SandboxLimits(cpu_seconds=5, wall_seconds=60, memory_mb=256, processes=16, scratch_mb=8, tmp_mb=8))
    before = {p for p in os.listdir("/tmp") if p.startswith("hybrid_rl-sbx-")}
    cg_dirs = [d for d in (sb.mem_cg, sb.pids_cg) if d is not None]

    def cgroups() -> set[str]:
        return {f"{d}/{c}" for d in cg_dirs for c in os.listdir(d) if c.startswith("hybrid_rl-sbx-")}

    cg_before = cgroups()
    start = time.perf_counter()
    with ThreadPoolExecutor(64) as ex:
        results = list(ex.map(lambda i: sb.run(f"import os\nprint({i} * 3, len(os.listdir('.')))"), range(1000)))
    seconds = time.perf_counter() - start
    ok = sum(r.stdout.split()[:1] == [str(i * 3)] for i, r in enumerate(results))
    print(json.dumps({"runs": 1000, "concurrency": 64, "seconds": seconds, "ok": ok}))
    assert ok == 1000, [r for r in results if not r.ok][:3]
    time.sleep(0.5)
    assert {p for p in os.listdir("/tmp") if p.startswith("hybrid_rl-sbx-")} <= before
    ps = subprocess.run(["ps", "-u", "65534", "-o", "pid=,stat="], capture_output=True, text=True, check=False)
    assert not [x for x in ps.stdout.splitlines() if x.split() and not x.split()[1].startswith("Z")]
    assert not cgroups() - cg_before, cgroups() - cg_before
    print(json.dumps({"cgroup_dirs": [str(d) for d in cg_dirs]}))
