"""Phase timers with memory readings: every phase of a step and of the mode switch is measured.

Each phase records the RSS after it and its peak RSS (``peak_rss_mib``: the kernel's VmHWM,
reset when a phase starts, with nested phases folded into the enclosing ones) and, on CUDA,
allocated / reserved / peak-allocated device memory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil
import torch

_PROC = psutil.Process(os.getpid())


def memory_reading(device: torch.device | None = None) -> dict[str, float]:
    """Resident set size of this process (MiB) and, on CUDA, allocated/reserved MiB."""
    out = {"rss_mib": _PROC.memory_info().rss / 2**20}
    if device is not None and device.type == "cuda":
        out["cuda_alloc_mib"] = torch.cuda.memory_allocated(device) / 2**20
        out["cuda_reserved_mib"] = torch.cuda.memory_reserved(device) / 2**20
    return out


_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
# Running peaks of the phases now open (innermost last): resetting the kernel's peak for an inner
# phase must not lose the outer phases' peak so far.
_OPEN_PEAKS: list[list[float]] = []


def _hwm_mib() -> float | None:
    """The process's peak RSS since the last reset (VmHWM), MiB; None where /proc lacks it."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> None:
    """Reset VmHWM to the current RSS (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        pass


def _enter_peak() -> list[float]:
    h = _hwm_mib()
    if h is not None:
        for peak in _OPEN_PEAKS:
            peak[0] = max(peak[0], h)
    _reset_hwm()
    box = [_hwm_mib() or 0.0]
    _OPEN_PEAKS.append(box)
    return box


def _exit_peak(box: list[float]) -> float:
    h = _hwm_mib() or 0.0
    box[0] = max(box[0], h)
    if box in _OPEN_PEAKS:
        _OPEN_PEAKS.remove(box)
    for peak in _OPEN_PEAKS:
        peak[0] = max(peak[0], h)
    return box[0]


def process_stats() -> dict[str, float]:
    """What a long run must keep flat: resident memory, open file descriptors, threads, and
    live child processes (reward workers, sandboxes) of this process."""
    kids = 0
    for c in _PROC.children(recursive=True):
        try:
            kids += c.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:  # exited meanwhile
            pass
    return {
        "sys/rss_mib": _PROC.memory_info().rss / 2**20,
        "sys/open_fds": float(_PROC.num_fds()),
        "sys/threads": float(_PROC.num_threads()),
        "sys/child_procs": float(kids),
    }


# The RL step's phases under verl's metric names (timing_s/gen, timing_s/old_log_prob, ...), so a
# verl user's dashboards carry over; the switch's phases are this project's own.
STEP_PREFIX = "timing_s"
VERL_PHASES = {"generate": "gen", "logprobs": "old_log_prob", "advantage": "adv", "update": "update_actor", "validate": "testing"}


def phase_key(phase: str) -> str:
    """The metric an RL step's ``phase`` (as the trainer names it: generate, update, ...) is logged under."""
    return f"{STEP_PREFIX}/{VERL_PHASES.get(phase, phase)}"


def memory_key(phase: str, reading: str) -> str:
    """The metric of a memory ``reading`` (rss_mib, peak_rss_mib, ...) taken after an RL step's ``phase``."""
    return f"memory/{phase_key(phase)}/{reading}"


@dataclass
class PhaseTimer:
    """Accumulates seconds (and memory after each phase) under ``<prefix>/<phase>`` (phases of the
    RL step under their verl names, :func:`phase_key`)."""

    prefix: str = STEP_PREFIX
    device: torch.device | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    memory: dict[str, dict[str, float]] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        cuda = self.device is not None and self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        peak = _enter_peak()
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase/{name}"):  # a label in trainer.profile_steps traces
                yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            reading = memory_reading(self.device)
            # The phase's peak RSS (all of its calls this step, and what nested phases reached).
            reading["peak_rss_mib"] = max(_exit_peak(peak), self.memory.get(name, {}).get("peak_rss_mib", 0.0))
            if cuda:
                reading["cuda_peak_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
            self.memory[name] = reading

    def metrics(self) -> dict[str, float]:
        names = VERL_PHASES if self.prefix == STEP_PREFIX else {}
        out = {f"{self.prefix}/{names.get(k, k)}": v for k, v in self.seconds.items()}
        for k, mem in self.memory.items():
            for mk, mv in mem.items():
                out[f"memory/{self.prefix}/{names.get(k, k)}/{mk}"] = mv
        return out
