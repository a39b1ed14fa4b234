"""Crash-safe checkpoints with torch.distributed.checkpoint (DCP).

Layout under ``<output_dir>/checkpoints``::

    step_000010/            a finished checkpoint
      manifest.json         written last; its presence is what makes the checkpoint valid
      model+optim shards    DCP files, one per rank
      trainer_rank<r>.pt    step, data position, RNG states, controller state (per rank)
    .step_000012.tmp/       an unfinished one (a crash mid-save): never picked up, removed later
    .step_000004.old/       one being deleted (pruned or replaced): never picked up, removed later

A save writes into the temporary directory, then rank 0 writes the manifest, fsyncs and renames
the directory into place (atomic on POSIX), so a checkpoint is either whole or invisible.
Deleting one is the same in reverse: it is renamed out of sight first, then removed, so a kill
in the middle of the removal cannot leave a manifest next to missing shards. ``keep_last``
bounds how many are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from hybrid_rl.dist import barrier
from hybrid_rl.resume import MANIFEST, latest_checkpoint, list_checkpoints  # noqa: F401 (re-exported)


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: str | Path, step: int, app_state: dict[str, Any], trainer_state: dict[str, Any], keep_last: int, rank: int, world: int,
    made_from: dict[str, Any] | None = None,
) -> Path:
    """Collective: every rank calls it. ``app_state`` goes through DCP, ``trainer_state`` per rank;
    ``made_from`` (the model's identity and the resolved config, :mod:`hybrid_rl.resume`) goes
    into the manifest, where a resume reads it before loading anything."""
    root = Path(root)
    final = _step_dir(root, step)
    tmp = root / f".{final.name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    barrier()
    dcp.save(app_state, checkpoint_id=str(tmp))
    torch.save(trainer_state, tmp / f"trainer_rank{rank}.pt")
    barrier()
    if rank == 0:
        manifest = {"step": step, "world_size": world, "time": time.time(), "files": sorted(p.name for p in tmp.iterdir())}
        manifest.update(made_from or {})
        with (tmp / MANIFEST).open("w") as fh:
            json.dump(manifest, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again: out of sight first, removed by _prune
            _hide(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _prune(root, keep_last)
    barrier()
    return final


def _hide(ckpt_dir: Path) -> Path:
    """Rename a finished checkpoint out of sight (atomic) before it is removed."""
    hidden = ckpt_dir.with_name(f".{ckpt_dir.name}.old")
    if hidden.exists():
        shutil.rmtree(hidden)
    os.replace(ckpt_dir, hidden)
    _fsync_dir(ckpt_dir.parent)
    return hidden


def _prune(root: Path, keep_last: int) -> None:
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            _hide(old)
    for stale in [*root.glob(".step_*.tmp"), *root.glob(".step_*.old")]:
        shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(path: str | Path, app_state: dict[str, Any], rank: int) -> dict[str, Any]:
    """Load DCP state into ``app_state`` (in place) and return this rank's trainer state.

    A checkpoint written by a different number of ranks loads too (DCP reshards); the per-rank
    trainer state then comes from rank 0's file when this rank has none.
    """
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise FileNotFoundError(f"{path} is not a finished checkpoint (no {MANIFEST})")
    dcp.load(app_state, checkpoint_id=str(path))
    own = path / f"trainer_rank{rank}.pt"
    return torch.load(own if own.exists() else path / "trainer_rank0.pt", weights_only=False)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class AppState:
    """DCP ``Stateful`` for an engine's model and optimizer (sharded save, resharding load)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> dict:
        model_sd, optim_sd = self.engine.state_dicts()
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dicts(state["model"], state["optim"])


def rl_run_state(step: int, parts: Any, kl_coef: float, val_start_hits: torch.Tensor | None = None) -> dict[str, Any]:
    """What an RL run needs besides the weights to continue exactly: the step, the data position,
    the weights version, the KL coefficient, reward-failure count, RNG and engine counters, and
    the first validation's per-problem hits (what ``val/gain`` compares against)."""
    return {
        "step": step,
        "val_start_hits": val_start_hits,
        "sampler": parts.sampler.state_dict(),
        "weights_version": parts.switch.weights_version,
        "kl_coef": kl_coef,
        "reward_failed_steps": parts.reward_pool.failed_steps,
        "rng_torch": torch.get_rng_state(),
        "rng_python": random.getstate(),
        "actor_engine": parts.actor.extra_state(),
        "critic_engine": parts.critic.extra_state() if parts.critic is not None else None,
    }


def restore_rl_run_state(state: dict[str, Any], parts: Any) -> None:
    """The inverse of :func:`rl_run_state` (the caller restores the step, the KL coefficient and
    ``val_start_hits``, which it owns)."""
    parts.sampler.load_state_dict(state["sampler"])
    parts.reward_pool.failed_steps = int(state["reward_failed_steps"])
    torch.set_rng_state(state["rng_torch"])
    random.setstate(state["rng_python"])
    parts.actor.load_extra_state(state["actor_engine"])
    if parts.critic is not None and state.get("critic_engine") is not None:
        parts.critic.load_extra_state(state["critic_engine"])
    parts.switch.weights_version = int(state["weights_version"])


def record_scheduler_job(out_dir: Path, is_main: bool) -> None:
    """Append the Slurm job id (and restart count) to <output_dir>/slurm_jobs.txt."""
    if is_main and "SLURM_JOB_ID" in os.environ:
        out_dir.mkdir(parents=True, exist_ok=True)
        with (out_dir / "slurm_jobs.txt").open("a") as fh:
            fh.write(
                f"{os.environ['SLURM_JOB_ID']} restart={os.environ.get('SLURM_RESTART_COUNT', '0')} "
                f"time={time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
            )
