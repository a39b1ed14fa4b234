"""torch.distributed plumbing: one process group for every mode (1 rank included), with timeouts.

The training engine, the weight sync and the trainer's reductions all use the default group. On
CPU it is gloo, on CUDA NCCL. A single process without torchrun still gets a 1-rank group so
there is one code path. Collectives carry a timeout (``trainer.collective_timeout_s``): if a
rank dies, the others fail with an error instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybrid_rl.errors import RankFailure  # re-exported


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(kind: str = "auto") -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but torch sees no CUDA device")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device_kind: str = "auto", timeout_s: int = 600) -> DistContext:
    """Initialise (or reuse) the default process group; works with and without torchrun."""
    device = resolve_device(device_kind)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # On CUDA: NCCL for device tensors and gloo for the small host-tensor collectives (metric
    # sums, micro-batch counts, stop flags), which NCCL alone refuses.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, timeout=timeout)
    return DistContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), device)


def shutdown_distributed() -> None:
    """Destroy the default group if it still exists (an in-process vLLM engine may have done it)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (ValueError, RuntimeError):
            pass


def finish_rank(code: int = 0) -> None:
    """End a run's process (a torchrun rank, or a single-process run): destroy the group, flush
    stdio and logging, then ``os._exit(code)``.

    Interpreter teardown after ``destroy_process_group()`` sometimes aborts with "terminate called
    without an active exception" (SIGABRT: gloo's worker threads outlive the interpreter;
    pytorch/pytorch#190489 and its fix, pytorch/pytorch#179291), and an in-process vLLM engine's atexit hook tears the group down
    mid-exit. Either turns a finished rank's exit status into a failure, so torchrun reports a run
    that completed as failed. Everything a run must keep (checkpoints, metrics files, the tracker)
    is written and closed before this is called; only the teardown is skipped.
    """
    import logging
    import sys

    shutdown_distributed()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


def all_reduce_sum(values: list[float], device: torch.device | None = None) -> list[float]:
    """Sum a list of floats over ranks (one collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device or "cpu")
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max_list(values: list[float]) -> list[float]:
    """Element-wise max of a list of floats over ranks (one collective)."""
    if not values or not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_reduce_max(value: float) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Average a dict of scalars over ranks; every rank must pass the same keys."""
    keys = sorted(metrics)
    sums = all_reduce_sum([float(metrics[k]) for k in keys])
    w = dist.get_world_size() if dist.is_initialized() else 1
    return {k: s / w for k, s in zip(keys, sums, strict=True)}


def all_gather_objects(obj: object) -> list[object]:
    """Every rank's ``obj``, in rank order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, src: int = 0) -> object:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def gather_rows(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], slice]:
    """Concatenate every rank's rows (dim 0), right-padding dim 1 to the widest rank.

    Returns the global tensors (same on every rank) and the slice of this rank's rows. Uses
    ``all_gather_object`` on CPU tensors: simple and exact for the per-step tensors the advantage
    needs (``[B, R]`` floats), which are small next to the model.
    """
    local = {k: v.detach().cpu() for k, v in tensors.items()}
    parts = all_gather_objects(local)
    rank = dist.get_rank() if dist.is_initialized() else 0
    start = sum(next(iter(p.values())).shape[0] for p in parts[:rank]) if local else 0
    n_local = next(iter(local.values())).shape[0] if local else 0
    out = {}
    for k in local:
        pieces = [p[k] for p in parts]
        if pieces[0].dim() == 2:
            width = max(t.shape[1] for t in pieces)
            pieces = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in pieces]
        out[k] = torch.cat(pieces)
    return out, slice(start, start + n_local)


def raise_if_any_failed(error: BaseException | None, what: str) -> None:
    """Collective: share each rank's error (or None); if any rank failed, raise on all of them."""
    errors = all_gather_objects(None if error is None else f"{type(error).__name__}: {error}")
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise RankFailure(f"{what} failed ({detail})") from error
