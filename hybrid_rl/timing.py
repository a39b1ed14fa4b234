"""Phase timers with memory readings: every phase of a step and of the mode switch is measured."""

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


@dataclass
class PhaseTimer:
    """Accumulates seconds (and memory after each phase) under names like ``timing/rollout``."""

    prefix: str = "timing"
    device: torch.device | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    memory: dict[str, dict[str, float]] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.memory[name] = memory_reading(self.device)

    def metrics(self) -> dict[str, float]:
        out = {f"{self.prefix}/{k}": v for k, v in self.seconds.items()}
        for k, mem in self.memory.items():
            for mk, mv in mem.items():
                out[f"memory/{self.prefix}/{k}/{mk}"] = mv
        return out

    def reset(self) -> None:
        self.seconds.clear()
        self.memory.clear()
