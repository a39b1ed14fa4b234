"""Full parameters out of FSDP2 shards, a flat bucket per collective (the weight sync's gather).

FSDP2 shards every parameter on dim 0 the way ``torch.chunk`` does: with ``R`` rows over ``W``
ranks, rank r holds rows ``[r c, min(R, (r+1) c))``, ``c = ceil(R / W)`` (only trailing ranks hold
fewer). A bucket of parameters is packed, on every rank, into one flat buffer of equal length
``L = sum_p c_p * cols_p`` (each shard cast to the sync dtype first, zero-padded to ``c_p`` rows);
one all-gather gives ``[W, L]``, and parameter p's full tensor is
``gathered[:, off_p : off_p + c_p cols_p].reshape(W c_p, *cols_p)[:R_p]`` (padding only ever
follows row ``R_p``). Transports:

``collective``  ``all_gather_into_tensor`` on the default group (gloo on CPU, NCCL on CUDA),
                issued asynchronously one bucket ahead, so the gather of bucket k+1 overlaps the
                consumer's load of bucket k. Before: one ``full_tensor()`` collective per
                parameter, synchronous.
``shm``         ranks on one host (CPU): each rank writes its packed shard into its row of a
                POSIX shared-memory buffer (``/dev/shm``, two slots, mapped once and kept
                between pushes), one barrier, then every rank reads the others' rows directly:
                a memcpy instead of TCP loopback (verl keeps such a shared-memory path too).

With one rank nothing is gathered: the local tensors are the full ones, yielded as they are
(no copy unless a cast to the sync dtype makes one), as are parameters FSDP2 left unsharded. So
what a consumer gets may be the trainer's live parameter: it must only read it, and copy what it
keeps and may modify (vLLM scales an adapter's ``B`` in place: rollout/vllm_engine.py copies).
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


@dataclass
class _Entry:
    name: str
    param: Tensor
    rows: int  # global rows (1 for a scalar)
    cols: tuple[int, ...]  # the other dims
    chunk: int  # rows per rank, padded (c)
    offset: int = 0  # in the packed buffer (elements)
    # Already full on every rank: FSDP2 leaves the root's parameters (embedding, final norm)
    # unsharded after a forward without backward, as plain tensors. Yielded as they are.
    full: bool = False

    @property
    def seg(self) -> int:
        return 0 if self.full else self.chunk * math.prod(self.cols)


def plan_buckets(named: list[tuple[str, Tensor]], world: int, bucket_bytes: int, itemsize: int) -> list[list[_Entry]]:
    """Consecutive parameters grouped until their full bytes reach ``bucket_bytes``."""
    buckets: list[list[_Entry]] = []
    bucket: list[_Entry] = []
    size = 0
    for name, p in named:
        shape = tuple(p.shape)
        rows, cols = (shape[0], shape[1:]) if shape else (1, ())
        e = _Entry(name, p, rows, cols, math.ceil(rows / world), full=not isinstance(p, DTensor))
        e.offset = sum(x.seg for x in bucket)
        bucket.append(e)
        size += math.prod(shape or (1,)) * itemsize
        if size >= bucket_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets


def pack(bucket: list[_Entry], dtype: torch.dtype, out: Tensor) -> Tensor:
    """This rank's shards of ``bucket``, cast to ``dtype``, into ``out[:L]`` (padding zeroed)."""
    length = sum(e.seg for e in bucket)
    flat = out[:length]
    for e in bucket:
        if e.full:
            continue
        local = e.param.detach()
        local = local.to_local() if isinstance(local, DTensor) else local
        n = local.numel()
        flat[e.offset : e.offset + n].copy_(local.reshape(-1))
        if n < e.seg:
            flat[e.offset + n : e.offset + e.seg].zero_()
    return flat


def unpack(bucket: list[_Entry], gathered: Tensor, reused: bool) -> Iterator[tuple[str, Tensor]]:
    """Full tensors from the ``[W, L]`` gathered buffer; copied out of it when the buffer is
    ``reused`` (the shared-memory ring), else views where the layout allows."""
    world = gathered.shape[0]
    for e in bucket:
        if e.full:
            yield e.name, e.param.detach().to(gathered.dtype)
            continue
        full = gathered[:, e.offset : e.offset + e.seg].reshape(world * e.chunk, *e.cols)[: e.rows].contiguous()
        if reused and full.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr():
            full = full.clone()
        yield e.name, full.reshape(e.param.shape)


class ShmRing:
    """Two slots of ``[W, L_max]`` in one ``/dev/shm`` file mapped by every rank of the host."""

    def __init__(self, world: int, rank: int, capacity: int, dtype: torch.dtype) -> None:
        from hybrid_rl.dist import barrier, broadcast_object

        self.world, self.rank, self.capacity, self.dtype = world, rank, capacity, dtype
        nbytes = 2 * world * capacity * dtype.itemsize
        path = broadcast_object(f"/dev/shm/hybrid_rl_sync_{uuid.uuid4().hex}" if rank == 0 else None)
        if rank == 0:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        barrier()
        buf = torch.from_file(path, shared=True, size=nbytes // dtype.itemsize, dtype=dtype)
        barrier()
        if rank == 0:
            os.unlink(path)  # the mappings stay valid; nothing is left behind if a rank dies
        self.slots = buf.view(2, world, capacity)

    def gather(self, bucket: list[_Entry], slot: int) -> Tensor:
        from hybrid_rl.dist import barrier

        length = sum(e.seg for e in bucket)
        pack(bucket, self.dtype, self.slots[slot, self.rank])
        barrier()  # every rank's shard is in place
        return self.slots[slot, :, :length]


def iter_full_params(
    named: list[tuple[str, Tensor]], bucket_bytes: int, dtype: torch.dtype | None, transport: str = "collective", state: dict | None = None
) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, full tensor)`` for every parameter, gathered a flat bucket at a time.

    Collective: every rank must consume the iterator fully. ``dtype`` (None: the parameters'
    own) is the dtype on the wire and of the yielded tensors. ``state`` keeps the shared-memory
    ring between calls (the caller owns it).
    """
    if not named:
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    dtypes = {p.dtype for _, p in named}
    dtype = dtype or (dtypes.pop() if len(dtypes) == 1 else torch.float32)
    if world == 1 or not any(isinstance(p, DTensor) for _, p in named):
        for name, p in named:
            t = p.detach()
            t = t.to_local() if isinstance(t, DTensor) else t
            yield name, t.to(dtype) if t.dtype != dtype else t
        return
    device = named[0][1].device
    buckets = plan_buckets(named, world, bucket_bytes, dtype.itemsize)
    if transport == "shm":
        capacity = max([1] + [sum(e.seg for e in b) for b in buckets])
        ring = (state or {}).get("ring")
        if ring is None or ring.capacity < capacity or ring.dtype != dtype:
            ring = ShmRing(world, dist.get_rank(), capacity, dtype)
            if state is not None:
                state["ring"] = ring
        for k, bucket in enumerate(buckets):
            yield from unpack(bucket, ring.gather(bucket, k % 2), reused=True)
        return

    def launch(bucket: list[_Entry]) -> tuple[Tensor, object]:
        length = sum(e.seg for e in bucket)
        flat = pack(bucket, dtype, torch.empty(length, dtype=dtype, device=device))
        out = torch.empty(world * length, dtype=dtype, device=device)
        return out, dist.all_gather_into_tensor(out, flat, async_op=True) if length else None

    pending = launch(buckets[0])
    for k, bucket in enumerate(buckets):
        out, work = pending
        if work is not None:
            work.wait()
        if k + 1 < len(buckets):
            pending = launch(buckets[k + 1])  # in flight while the consumer loads bucket k
        yield from unpack(bucket, out.view(world, -1), reused=False)
