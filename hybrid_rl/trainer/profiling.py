"""``torch.profiler`` around chosen RL steps (``trainer.profile_steps``), and where their time went.

Each profiled step writes ``<output_dir>/profile/step_XXXXXX_rank<R>.json.gz``, a Chrome trace
(open it in Perfetto or ``chrome://tracing``; the step's phases are labelled ``phase/generate``,
``phase/update``, ..., the engine's ``hybrid_rl/forward``, ``hybrid_rl/backward``,
``hybrid_rl/optimizer`` and ``hybrid_rl/logprob_head``), and logs rank 0's seconds per bucket as
``profile/<bucket>_s``. Every op's own (self) time on the busiest thread goes to the first bucket
that matches (:func:`bucket_of`); what the ops leave of the wall time is Python and framework.
The buckets follow the questions a slow update raises (torchtitan and verl profile the same way:
a trace per rank for chosen steps, no always-on cost).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

BUCKETS = ("optimizer", "collectives", "logprob_head", "attention", "gemm", "casts", "other ops", "python/framework")
_GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::_addmm_activation"}
_CAST = {"aten::_to_copy", "aten::copy_", "aten::to", "aten::_copy_from", "aten::clone", "aten::contiguous"}
_COMM = ("gloo", "c10d", "nccl", "all_gather", "allgather", "reduce_scatter", "allreduce", "wait_tensor")
_RANGES = ("hybrid_rl/", "phase/", "FSDP::", "autograd::", "Optimizer.", "## ")


def bucket_of(name: str, ancestors: list[str]) -> str:
    """The bucket of an op named ``name`` inside the ranges ``ancestors`` (innermost first)."""
    if any(a.startswith(("hybrid_rl/optimizer", "Optimizer.")) for a in ancestors):
        return "optimizer"
    low = name.lower()
    if any(k in low for k in _COMM) or any("FSDP::all_gather" in a or "FSDP::post_backward_reduce" in a or "c10d" in a for a in ancestors):
        return "collectives"
    if any(a.startswith("hybrid_rl/logprob_head") for a in ancestors):
        return "logprob_head"
    if "scaled_dot_product" in low or "flash_attention" in low or "paged_attention" in low:
        return "attention"
    if name in _GEMM:
        return "gemm"
    return "casts" if name in _CAST else "other ops"


def busiest_thread(events) -> int | None:
    """The thread with the most op self time: the rank's compute thread (gloo and the profiler
    run their own)."""
    busy: dict[int, float] = {}
    for e in events:
        busy[e.thread] = busy.get(e.thread, 0.0) + e.self_cpu_time_total
    return max(busy, key=busy.get) if busy else None


def profile_buckets(prof: torch.profiler.profile, wall_s: float, device_time: bool = False) -> dict[str, float]:
    """Seconds per bucket of :data:`BUCKETS`: each op's self time on the busiest thread (its
    kernels' time on the accelerator with ``device_time``, as on CUDA, where host time is mostly
    launches); a range's own time (outside the ops it encloses) is Python unless it is the
    optimizer's or a collective's; ``python/framework`` also gets what no op accounts for (on
    CUDA: the accelerator idle)."""
    out = dict.fromkeys(BUCKETS, 0.0)
    events = prof.profiler.function_events
    main = busiest_thread(events)
    for e in events:
        if e.thread != main or e.self_cpu_time_total <= 0:
            continue
        ancestors, p = [], e.cpu_parent
        while p is not None:
            ancestors.append(p.name)
            p = p.cpu_parent
        if e.name.startswith(_RANGES):
            b = bucket_of(e.name, [e.name, *ancestors])
            b = b if b in ("optimizer", "collectives") else "python/framework"
        else:
            b = bucket_of(e.name, ancestors)
        out[b] += (e.self_device_time_total if device_time else e.self_cpu_time_total) / 1e6
    out["python/framework"] += max(wall_s - sum(out.values()), 0.0)
    return out


@contextmanager
def profiled(step: int, steps: list[int], out_dir: Path, rank: int, device: torch.device) -> Iterator[dict[str, float]]:
    """Run the body under ``torch.profiler`` when ``step`` is in ``steps``; the yielded dict then
    holds ``profile/<bucket>_s`` and ``profile/wall_s`` after the body, and the trace is written."""
    metrics: dict[str, float] = {}
    if step not in steps:
        yield metrics
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        yield metrics
        wall = time.perf_counter() - start
    folder = Path(out_dir) / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(folder / f"step_{step:06d}_rank{rank}.json.gz"))
    buckets = profile_buckets(prof, wall, device_time=device.type == "cuda")
    metrics.update({f"profile/{k.replace(' ', '_').replace('/', '_')}_s": v for k, v in buckets.items()})
    metrics["profile/wall_s"] = wall
