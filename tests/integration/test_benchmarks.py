"""Every benchmark script runs end to end at toy sizes and writes its JSON and PNG (the figures
themselves come from `make bench`; these runs only guard the scripts against rot)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import need

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "agentic_errors": ["--models", "builtin:micro", "--n", "2", "--samples", "1"],
    "prefix_cache": ["--groups", "1,4", "--lengths", "40", "--prompts", "2", "--max-tokens", "4", "--preset", "micro"],
    "rollout_throughput": ["--presets", "micro", "--prompts", "2", "--group", "2", "--max-tokens", "4", "--repeats", "1"],
    "train_throughput": [
        "--preset",
        "micro",
        "--rows",
        "8",
        "--micro",
        "4",
        "--token-budget",
        "256",
        "--max-response",
        "24",
        "--repeats",
        "1",
    ],
    "switch_overhead": ["--presets", "micro", "--repeats", "1"],
    "shared_prefix": ["--preset", "micro", "--groups", "2", "--n", "4", "--micro", "8", "--response", "16", "--ratios", "0.5,1",
                      "--repeats", "1"],
    "split_pool": ["--preset", "micro", "--prompts", "2", "--group", "2", "--max-tokens", "4", "--steps", "1"],
    "sandbox_latency": ["--runs", "4", "--concurrency", "1,2"],
    "checkpoint_cost": ["--presets", "micro", "--repeats", "1"],
    "memory_scaling": ["--preset", "micro", "--worlds", "1,2", "--steps", "1"],
}
SLOW = {
    "real_size_grpo": ["--preset", "micro", "--steps", "2", "--prompts", "2", "--group", "2", "--new-tokens", "4", "--name", "real_size_grpo"],
    "preload": ["--steps", "3", "--repeats", "1", "--modes", "none,auto", "--extra", "+overlay=ci_tiny", "model.preset=micro", "algorithm.filter_groups=false"],
    "vs_trl": ["--preset", "micro", "--prompts", "2", "--group", "2", "--max-tokens", "4", "--steps", "2", "--trl-precision", "fp32",
               "--name", "vs_trl"],
    "precision": ["--steps", "3", "--repeats", "1", "--gemm", "256", "--extra", "+overlay=ci_tiny", "model.preset=micro",
                  "algorithm.filter_groups=false"],
    "compare_algorithms": [
        "--steps",
        "1",
        "--recipes",
        "grpo_math,rloo_math",
        "model.path=builtin:tiny",
        "model.preset=micro",
        "data.train_batch_size=4",
        "rollout.max_response_length=8",
        "data.val_size=8",
    ],
}


def run(name: str, args: list[str], out: Path) -> dict:
    env = {**os.environ, "HYBRID_RL_BENCH_RESULTS": str(out)}
    p = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    assert (out / f"{name}.png").stat().st_size > 0
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_benchmark_runs(name, tmp_path):
    if name == "sandbox_latency":
        need("bwrap", shutil.which("bwrap") is not None, "bubblewrap not installed (make setup installs it)")
    d = run(name, CASES[name], tmp_path)
    assert d["machine"]["torch"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_slow_benchmark_runs(name, tmp_path):
    run(name, SLOW[name], tmp_path)


def test_gpu_train_check_runs_on_cpu(tmp_path):
    """The GPU check's training side (benchmarks/gpu_train_check.py) on 2 gloo ranks and the micro
    preset: the script a GPU node runs, kept from rotting where CI runs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "benchmarks/gpu_train_check.py"]
    cmd += ["--out", str(tmp_path), "--device", "cpu", "--presets", "micro", "--rows", "4", "--micro-batch", "2"]
    cmd += ["--prompt", "16", "--response", "32", "--gen-tokens", "16", "--param-dtype", "float32", "--rollout-dtype", "float32"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads((tmp_path / "gpu_train_micro.json").read_text())
    assert "error" not in r, r.get("traceback")
    assert r["sharded_init_max_abs_diff"] == 0.0 and r["head_max_abs_diff"] < 1e-4
    assert r["master_dtypes"] == ["torch.float32"] and r["adam_state_dtypes"] == ["torch.float32"]
    assert r["params_changed_fraction"] > 0.9 and r["generated_tokens"] > 0
