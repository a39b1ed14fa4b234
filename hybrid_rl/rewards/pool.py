"""Scoring responses in a pool of worker processes, with a per-response timeout.

Policy for a reward function that misbehaves (stated once, applied everywhere):

- raises, times out (the worker is killed and replaced), returns None/NaN/inf, a non-number, or
  a dict without a numeric ``score`` -> that function scores ``reward.failure_score`` for that
  response; the failure is counted (``reward/failed``, ``reward/timeouts``) and training goes on.
- if *every* response of ``reward.max_failed_steps`` consecutive steps failed, the run stops with
  :class:`RewardFailure` naming the function and the last error: a reward that never works is a
  bug, not noise.

Workers are started with ``spawn``: the trainer process holds threads (torch, vLLM) that do
not survive ``fork``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

from pebble import ProcessPool

from hybrid_rl.errors import RewardFailure  # re-exported
from hybrid_rl.rewards.functions import resolve

FnSpec = tuple[str, str | None, str | None, float]  # name, path, function, weight


@dataclass
class ScoredResponse:
    score: float
    components: dict[str, float]
    extra: dict[str, float] = field(default_factory=dict)
    failed: int = 0
    timed_out: bool = False
    error: str = ""


def _score_in_worker(specs: list[FnSpec], item: tuple[str, str, Any, dict]) -> list[Any]:
    """Runs in a worker: each function's raw result, or an exception description."""
    out = []
    for name, path, function, _ in specs:
        try:
            out.append(("ok", resolve(name, path, function)(*item)))
        except Exception as e:
            out.append(("error", f"{type(e).__name__}: {e}"))
    return out


def _as_score(raw: Any) -> tuple[float | None, dict[str, float], str]:
    """Validate one function's return value: (score or None if invalid, extra metrics, error)."""
    extra: dict[str, float] = {}
    value = raw
    if isinstance(raw, dict):
        if "score" not in raw:
            return None, {}, "returned a dict without 'score'"
        value = raw["score"]
        extra = {k: float(v) for k, v in raw.items() if k != "score" and isinstance(v, int | float) and math.isfinite(v)}
    if isinstance(value, bool):
        value = float(value)
    if not isinstance(value, int | float):
        return None, {}, f"returned {type(value).__name__}, not a number"
    if not math.isfinite(value):
        return None, {}, f"returned {value}"
    return float(value), extra, ""


class PoolSettings(Protocol):
    """The part of the ``reward`` config the pool reads (``RewardConfig`` has it): ``functions``
    holds items with ``name``, ``path``, ``function`` and ``weight``."""

    functions: list[Any]
    timeout_s: float
    failure_score: float
    max_failed_steps: int
    num_workers: int


class RewardPool:
    """Scores (data_source, response, ground_truth, extra_info) items with the configured functions."""

    def __init__(self, cfg: PoolSettings) -> None:
        self.specs: list[FnSpec] = [(f.name, f.path, f.function, float(f.weight)) for f in cfg.functions]
        if not self.specs and not getattr(getattr(cfg, "reward_model", None), "path", None):
            raise ValueError("reward.functions is empty and no reward.reward_model.path: nothing would score the rollouts")
        for name, path, function, _ in self.specs:
            resolve(name, path, function)  # fail at start, in the main process, with a clear message
        self.timeout_s = float(cfg.timeout_s)
        self.failure_score = float(cfg.failure_score)
        self.max_failed_steps = int(cfg.max_failed_steps)
        self.failed_steps = 0
        self.last_error = ""
        self.pool = ProcessPool(max_workers=max(1, int(cfg.num_workers)), context=mp.get_context("spawn"))

    def score(self, items: list[tuple[str, str, Any, dict]]) -> list[ScoredResponse]:
        if not self.specs:
            return [ScoredResponse(0.0, {}) for _ in items]
        futures = [self.pool.schedule(_score_in_worker, args=(self.specs, item), timeout=self.timeout_s) for item in items]
        results = []
        for fut in futures:
            try:
                raw, timed_out, error = fut.result(), False, ""
            except FutureTimeout:
                raw, timed_out, error = None, True, f"timed out after {self.timeout_s}s"
            except Exception as e:
                raw, timed_out, error = None, False, f"{type(e).__name__}: {e}"
            results.append(self._combine(raw, timed_out, error))
        return results

    def _combine(self, raw: list[Any] | None, timed_out: bool, error: str) -> ScoredResponse:
        total, components, extra, failed = 0.0, {}, {}, 0
        for i, (name, _, function, weight) in enumerate(self.specs):
            key = function if name == "custom" and function else name
            value = None
            if raw is not None:
                status, payload = raw[i]
                if status == "ok":
                    value, fn_extra, why = _as_score(payload)
                    extra.update(fn_extra)
                else:
                    why = payload
                if value is None:
                    error = f"{key}: {why}"
            if value is None:
                value, failed = self.failure_score, failed + 1
            components[key] = value
            total += weight * value
        if error:
            self.last_error = error
        return ScoredResponse(total, components, extra, failed, timed_out, error)

    def check_failures(self, results: list[ScoredResponse]) -> None:
        """Count a step where every response failed; stop after ``max_failed_steps`` in a row."""
        if results and self.specs and all(r.failed for r in results):
            self.failed_steps += 1
            if self.failed_steps >= self.max_failed_steps:
                raise RewardFailure(
                    f"reward functions failed on every response for {self.failed_steps} consecutive steps "
                    f"(reward.max_failed_steps={self.max_failed_steps}); last error: {self.last_error}"
                )
        else:
            self.failed_steps = 0

    def close(self) -> None:
        self.pool.stop()
        self.pool.join(timeout=10)
