"""Scoring responses in a pool of worker processes, with a per-response timeout.

Policy for a reward function that misbehaves (stated once, applied everywhere):

- raises, times out (the worker is killed and replaced), returns None/NaN/inf, a non-number, or
  a dict without a numeric ``score`` -> that function scores ``reward.failure_score`` for that
  response; the failure is counted (``reward/failed``, ``reward/timeouts``) and training goes on.
- every failure is said on the console and in main.log (logger ``hybrid_rl``): the first of each
  kind (function and exception type, or kind of bad return) in full, with the traceback from the
  worker; repeats as counts in one line at most every ``FailureLog.every_s`` seconds. Timeouts get
  one line per scoring call, and a call still waiting after ``RewardPool.slow_report_s`` says so.
- if *every* response of ``reward.max_failed_steps`` consecutive steps failed, the run stops with
  :class:`RewardFailure` naming the function and the last error: a reward that never works is a
  bug, not noise. A step is all of its generation rounds (DAPO's refills, see
  :meth:`RewardPool.check_failures`).

Workers are started with ``spawn``: the trainer process holds threads (torch, vLLM) that do
not survive ``fork``.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import numbers
import time
import traceback
from collections import Counter
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from pebble import ProcessPool

from hybrid_rl.errors import ConfigError, RewardFailure  # RewardFailure re-exported
from hybrid_rl.rewards.functions import resolve

FnSpec = tuple[str, str | None, str | None, float]  # name, path, function, weight

log = logging.getLogger("hybrid_rl")


@dataclass
class ScoredResponse:
    score: float
    components: dict[str, float]
    extra: dict[str, float] = field(default_factory=dict)
    failed: int = 0
    timed_out: bool = False
    error: str = ""


def _score_in_worker(specs: list[FnSpec], item: tuple[str, str, Any, dict]) -> list[Any]:
    """Runs in a worker: each function's ``("ok", result, "")`` or ``("error", description,
    traceback)``. The traceback is taken here: the exception happens in this process, and only
    text comes back to the trainer."""
    out = []
    for name, path, function, _ in specs:
        try:
            out.append(("ok", resolve(name, path, function)(*item), ""))
        except Exception as e:
            out.append(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
    return out


def _as_score(raw: Any) -> tuple[float | None, dict[str, float], str, dict[str, str]]:
    """Validate one function's return value: (score or None if invalid, numeric extras, error,
    the extras left out and why). Any real number counts (numpy's too): verl's reward
    functions often return ``np.float32``."""
    extra: dict[str, float] = {}
    left_out: dict[str, str] = {}
    value = raw
    if isinstance(raw, dict):
        if "score" not in raw:
            return None, {}, "returned a dict without 'score'", {}
        value = raw["score"]
        for k, v in raw.items():
            if k == "score":
                continue
            if isinstance(v, numbers.Real) and math.isfinite(v):
                extra[str(k)] = float(v)
            else:
                left_out[str(k)] = f"{v!r}" if isinstance(v, numbers.Real) else f"a {type(v).__name__}"
    if not isinstance(value, numbers.Real):
        return None, {}, f"returned {type(value).__name__}, not a number", {}
    if not math.isfinite(value):
        return None, {}, f"returned {value}", {}
    return float(value), extra, "", left_out


class FailureLog:
    """Says why rewards fail, where the user looks (logger ``hybrid_rl``: console and main.log).

    A reward that raised on most answers used to leave nothing but a count in ``reward/failed``.
    Now the first failure of each kind (function, exception type or kind of bad return) is
    logged in full, with the worker's traceback; repeats are counted and said in one line at
    most every ``every_s`` seconds, and at :meth:`summarize` with ``force`` (the pool's close),
    so none is swallowed and a reward failing on every answer does not flood the log."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self.seen: set[tuple[str, str]] = set()
        self.repeats: Counter[tuple[str, str]] = Counter()
        self.since = time.monotonic()

    def failed(self, fn: str, kind: str, message: str, tb: str = "") -> None:
        if (fn, kind) in self.seen:
            self.repeats[fn, kind] += 1
            return
        self.seen.add((fn, kind))
        log.warning(
            "reward function %s failed: %s (the response scores reward.failure_score; more failures of this kind "
            "are counted in reward/failed and summed up here at most every %.0f s)%s",
            fn, message, self.every_s, "\n" + tb.rstrip() if tb else "",
        )  # fmt: skip

    def once(self, key: tuple[str, str], message: str) -> None:
        """A note about a function's output, said the first time only."""
        if key not in self.seen:
            self.seen.add(key)
            log.warning(message)

    def summarize(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.repeats and (force or now - self.since >= self.every_s):
            counts = ", ".join(f"{fn}: {kind} x{n}" for (fn, kind), n in sorted(self.repeats.items()))
            log.warning(
                "reward failures in the last %.0f s (each kind shown in full the first time): %s", now - self.since, counts
            )
            self.repeats.clear()
            self.since = now


class PoolSettings(Protocol):
    """The part of the ``reward`` config the pool reads (``RewardConfig`` has it): ``functions``
    holds items with ``name``, ``path``, ``function`` and ``weight``."""

    functions: list[Any]
    timeout_s: float
    failure_score: float
    max_failed_steps: int
    num_workers: int


def _checked(cfg: PoolSettings) -> tuple[int, float]:
    """``reward.num_workers`` and ``reward.timeout_s``, refused where pebble would quietly do
    something else: fewer than one worker, a timeout of 0 (no timeout at all: a hung reward
    hangs the run) or below (every response times out)."""
    workers, timeout = int(cfg.num_workers), float(cfg.timeout_s)
    if workers < 1:
        raise ConfigError(f"reward.num_workers={cfg.num_workers} must be >= 1")
    if not timeout > 0:
        raise ConfigError(f"reward.timeout_s={cfg.timeout_s} must be > 0 (seconds a response may take to score)")
    return workers, timeout


def _keys(specs: list[FnSpec]) -> list[str]:
    """Each function's name in ``reward/<name>`` and ``components``: the builtin's name or the
    custom function's. A second function of the same name gets ``_<index>`` (two ``score``
    functions from different files would otherwise share one metric and one component)."""
    keys: list[str] = []
    for i, (name, path, function, _) in enumerate(specs):
        key = function if name == "custom" and function else name
        if name != "custom" and (path or function):
            log.warning("reward.functions[%d]: path/function are ignored for the builtin %r (use name: custom)", i, name)
        if key in keys:
            first = keys.index(key)
            key = f"{key}_{i}"
            log.warning("reward.functions[%d] is reported as reward/%s: reward/%s is [%d]'s", i, key, keys[first], first)
        keys.append(key)
    return keys


class RewardPool:
    """Scores (data_source, response, ground_truth, extra_info) items with the configured functions."""

    slow_report_s = 30.0  # a scoring call still waiting this long says so, and again each time as long

    def __init__(self, cfg: PoolSettings) -> None:
        self.specs: list[FnSpec] = [(f.name, f.path, f.function, float(f.weight)) for f in cfg.functions]
        if not self.specs and not getattr(getattr(cfg, "reward_model", None), "path", None):
            raise ValueError("reward.functions is empty and no reward.reward_model.path: nothing would score the rollouts")
        for name, path, function, _ in self.specs:
            resolve(name, path, function)  # fail at start, in the main process, with a clear message
        self.num_workers, self.timeout_s = _checked(cfg)
        self.keys = _keys(self.specs)
        self.failure_score = float(cfg.failure_score)
        self.max_failed_steps = int(cfg.max_failed_steps)
        self.failed_steps = 0
        self.last_error = ""
        self.failures = FailureLog()
        self.pool = ProcessPool(max_workers=self.num_workers, context=mp.get_context("spawn"))

    def score(self, items: list[tuple[str, str, Any, dict]]) -> list[ScoredResponse]:
        if not self.specs:
            return [ScoredResponse(0.0, {}) for _ in items]
        start = time.monotonic()
        futures = [self.pool.schedule(_score_in_worker, args=(self.specs, item), timeout=self.timeout_s) for item in items]
        self._wait(futures, start)
        results = []
        for fut in futures:
            try:
                raw, timed_out, error = fut.result(), False, ""
            except FutureTimeout:
                raw, timed_out, error = None, True, f"timed out after {self.timeout_s}s"
            except Exception as e:  # the worker died, or the result did not pickle: every function failed
                raw, timed_out, error = None, False, f"{type(e).__name__}: {e}"
                self.failures.failed(", ".join(self.keys), type(e).__name__, error, getattr(e, "traceback", ""))
            results.append(self._combine(raw, timed_out, error))
        self._say_timeouts(sum(r.timed_out for r in results), len(results), time.monotonic() - start)
        self.failures.summarize()
        return results

    def _wait(self, futures: list[Any], start: float) -> None:
        """Wait for every response, saying so every ``slow_report_s`` while it takes long: each
        response that hangs holds a worker for the whole ``timeout_s``, one after another when
        there are more of them than workers, and the run otherwise looks stalled."""
        while True:
            _, pending = wait(futures, timeout=self.slow_report_s)
            if not pending:
                return
            log.warning(
                "reward: still scoring after %.0f s, %d of %d responses done (reward.num_workers=%d; a response "
                "that hangs holds a worker for reward.timeout_s=%g s)",
                time.monotonic() - start, len(futures) - len(pending), len(futures), self.num_workers, self.timeout_s,
            )  # fmt: skip

    def _say_timeouts(self, timeouts: int, total: int, seconds: float) -> None:
        if timeouts:
            log.warning(
                "reward: %d of %d responses timed out after reward.timeout_s=%g s in %s and score reward.failure_score "
                "(reward/timeouts); scoring took %.0f s: each one held one of the reward.num_workers=%d workers for the "
                "whole timeout",
                timeouts, total, self.timeout_s, ", ".join(self.keys), seconds, self.num_workers,
            )  # fmt: skip

    def _combine(self, raw: list[Any] | None, timed_out: bool, error: str) -> ScoredResponse:
        total, components, extra, failed = 0.0, {}, {}, 0
        for i, ((_, _, _, weight), key) in enumerate(zip(self.specs, self.keys, strict=True)):
            value = None
            if raw is not None:
                status, payload, tb = raw[i]
                value, why = self._value(key, status, payload, tb, extra)
                if value is None:
                    error = f"{key}: {why}"
            if value is None:
                value, failed = self.failure_score, failed + 1
            components[key] = value
            total += weight * value
        if error:
            self.last_error = error
        return ScoredResponse(total, components, extra, failed, timed_out, error)

    def _value(self, key: str, status: str, payload: Any, tb: str, extra: dict[str, float]) -> tuple[float | None, str]:
        """One function's score (None when it failed, and why), its numeric extras added to
        ``extra``; failures and extras that cannot be logged are said (first of each kind)."""
        if status != "ok":
            self.failures.failed(key, payload.split(":", 1)[0], payload, tb)
            return None, payload
        value, fn_extra, why, left_out = _as_score(payload)
        if value is None:
            self.failures.failed(key, why, why)
            return None, why
        for k, what in left_out.items():
            self.failures.once(
                (key, f"extra {k}"),
                f"reward function {key} returned {k!r} = {what}: not a finite number, so not logged as reward/{k}",
            )
        for k in fn_extra.keys() & extra.keys():
            self.failures.once(("extra", k), f"reward functions return the extra {k!r} more than once; reward/{k} is {key}'s")
        extra.update(fn_extra)
        return value, ""

    def check_failures(self, results: list[ScoredResponse]) -> None:
        """Call once per step with every response the step scored (all its generation rounds:
        with DAPO's dynamic sampling a step scores several; counted per round, a reward failing
        everywhere stopped the run inside its first step). A step where every response failed
        counts; ``max_failed_steps`` of them in a row stop the run."""
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
        self.failures.summarize(force=True)
        self.pool.stop()
        self.pool.join(timeout=10)
