"""Every benchmark script runs end to end at toy sizes and writes its JSON and PNG (the figures
themselves come from `make bench`; these runs only guard the scripts against rot).

Beyond the exit status and the PNG, each JSON must hold real measurements, so a benchmark that
writes 0 or NaN for its figures fails: the key figures of every benchmark (FIGURES: the seconds,
tokens/s, MiB and speedups it exists to measure, in every row it writes) are finite numbers > 0
(>= 0 only where 0 is a legitimate reading, said where), every number anywhere in the JSON
outside its "machine" block is finite (no NaN/inf), and no row records an error."""

import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
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
    "split_pool": ["--preset", "micro", "--prompts", "2", "--group", "2", "--max-tokens", "4", "--steps", "1", "--timeout", "300"],
    "sandbox_latency": ["--runs", "4", "--concurrency", "1,2"],
    "checkpoint_cost": ["--presets", "micro", "--repeats", "1"],
    "memory_scaling": ["--preset", "micro", "--worlds", "1,2", "--steps", "1"],
    "profile_update": ["--preset", "micro", "--prompts", "2", "--group", "2", "--new-tokens", "20", "--repeats", "1",
                       "--levers", "reshard,rs,reduce", "--name", "profile_update"],
}
SLOW = {
    "real_size_grpo": ["--preset", "micro", "--steps", "2", "--prompts", "2", "--group", "2", "--new-tokens", "4", "--name", "real_size_grpo"],
    "preload": ["--steps", "3", "--repeats", "1", "--modes", "none,auto", "--extra", "+overlay=ci_tiny", "model.preset=micro", "algorithm.filter_groups.enable=false"],
    "vs_trl": ["--preset", "micro", "--prompts", "2", "--group", "2", "--max-tokens", "4", "--steps", "2", "--trl-precision", "fp32",
               "--name", "vs_trl"],
    "precision": ["--steps", "3", "--repeats", "1", "--gemm", "256", "--extra", "+overlay=ci_tiny", "model.preset=micro",
                  "algorithm.filter_groups.enable=false"],
    "lora": ["--presets", "micro", "--steps", "3", "--prompts", "2", "--group", "2", "--new-tokens", "4", "--kv-cache-gib", "0.125"],
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


# (label, value, strict): a figure that must be a finite number > 0 (strict) or >= 0.
Figure = tuple[str, object, bool]


def at(d, path: str):
    """``d``'s value at a dotted ``path`` ("" is ``d`` itself)."""
    for key in filter(None, path.split(".")):
        d = d[key]
    return d


def each(d: dict, where: str, *paths: str, zero_ok: tuple[str, ...] = ()) -> list[Figure]:
    """The figures at ``paths`` (default: the entry itself) of every entry of the list or dict at
    ``where``: > 0, or >= 0 for those in ``zero_ok``."""
    rows = at(d, where)
    assert rows, f"{where}: nothing measured"
    items = rows.items() if isinstance(rows, dict) else enumerate(rows)
    return [(f"{where}[{i}]{'.' * bool(p)}{p}", at(r, p), p not in zero_ok) for i, r in items for p in paths or ("",)]


def one(d: dict, *paths: str) -> list[Figure]:
    return [(p, at(d, p), True) for p in paths]


def agentic_errors(d: dict) -> list[Figure]:
    classed = [(f"rows[{i}] episodes classed", r["right"] + r["wrong_code"] + r["wrong_copy"], True) for i, r in enumerate(d["rows"])]
    # the sampled accuracy (--samples K): the untrained micro model may never box the right product, 0 is a real reading
    meank = f"mean@{d['args']['samples']}"
    return classed + each(d, "rows", meank, zero_ok=(meank,))


FIGURES: dict[str, Callable[[dict], list[Figure]]] = {
    "agentic_errors": agentic_errors,
    "prefix_cache": lambda d: [*each(d, "rows", "seconds", "computed_prefill_tokens"), *each(d, "summary", "time_off_over_on")],
    "rollout_throughput": lambda d: each(d, "rows", "vllm_tokens_per_s", "hf_tokens_per_s", "vllm_over_hf"),
    "train_throughput": lambda d: each(d, "result.rows", "tokens_per_s", "speedup_over_padded"),
    "switch_overhead": lambda d: each(d, "rows", "hybrid.to_rollout_median_s", "sync_over_memcpy", "naive_over_switch"),
    "shared_prefix": lambda d: each(d, "result.rows", "packed_tokens_per_s", "shared_prefix_tokens_per_s", "gain"),
    "split_pool": lambda d: [*each(d, "median_s", "total"), *one(d, "split_over_hybrid")],
    "sandbox_latency": lambda d: [*each(d, "rows", "median_s", "runs_per_s"), *one(d, "bare_python_median_s")],
    "checkpoint_cost": lambda d: each(d, "rows", "save_median_s", "load_median_s", "write_mib_per_s"),
    "memory_scaling": lambda d: [*each(d, "rows", "peak_mib_max", "ratio_to_model"), *each(d, "tradeoffs", "peak_mib_max")],
    "real_size_grpo": lambda d: [*one(d, "steps_done", "median_step_s"), *each(d, "peak_rss_per_rank_mib")],
    "lora": lambda d: [
        *each(d, "rows", "to_rollout_median_s", "sync_median_s", "sync_mib", "step_median_s", "peak_rss_per_rank_mib"),
        *each(d, "summary", "switch_speedup", "bytes_ratio"),
    ],
    "profile_update": lambda d: [
        *one(d, "result.median_update_s", "result.update_tflops_per_s", "result.gemm_peak_tflops", "result.mfu", "result.buckets_s.gemm"),
        *each(d, "result.levers", "median_s", "speedup"),
        *each(d, "result.interleaved_ab", "ratio"),
        *each(d, "result.copies_by_caller", "self_s"),
    ],
    "preload": lambda d: each(d, "summary", "median_step_s", "median_update_s", "step_speedup_vs_none"),
    "vs_trl": lambda d: [*each(d, "median_step_s"), *each(d, "trl_over_hybrid")],
    "precision": lambda d: each(d, "summary", "median_step_s", "update_tflops_per_s", "step_speedup_vs_fp32"),
    # one step of an untrained micro model: a held-out accuracy of 0 is a real reading
    "compare_algorithms": lambda d: each(
        d, "rows", "step_s_median", "wall_s_mean", "val_after.mean", zero_ok=("val_after.mean",)
    ),
}


def nonfinite(x, path: str = "") -> list[str]:
    """The paths of the NaN/inf numbers anywhere in ``x``."""
    if isinstance(x, dict):
        return [p for k, v in x.items() for p in nonfinite(v, f"{path}.{k}")]
    if isinstance(x, list):
        return [p for i, v in enumerate(x) for p in nonfinite(v, f"{path}[{i}]")]
    return [path] if isinstance(x, float) and not math.isfinite(x) else []


def check(name: str, d: dict) -> None:
    """The JSON holds real measurements (the module docstring says what that means)."""
    assert d["machine"]["torch"]
    bad = nonfinite({k: v for k, v in d.items() if k != "machine"})
    assert not bad, f"{name}: NaN/inf at {bad}"
    errors = [r["error"] for r in d.get("rows", []) if "error" in r]
    assert not errors, f"{name}: rows with errors: {errors}"
    wrong = [
        f"{label} = {v!r} (want a finite number {'>' if strict else '>='} 0)"
        for label, v, strict in FIGURES[name](d)
        if not (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 if strict else v >= 0))
    ]
    assert not wrong, f"{name}: " + "; ".join(wrong)


def test_every_benchmark_has_figures():
    assert set(FIGURES) == set(CASES) | set(SLOW)


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
    check(name, run(name, CASES[name], tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_slow_benchmark_runs(name, tmp_path):
    check(name, run(name, SLOW[name], tmp_path))


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
