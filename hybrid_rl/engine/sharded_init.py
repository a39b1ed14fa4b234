"""Sharded initialisation: build the model with its parameters on the meta device, shard it with
FSDP2, then read each rank's rows of every parameter straight from the safetensors files.

No rank ever holds the full model (the old path loaded the whole checkpoint on every rank, moved
it to the device and only then sharded it: a transient full copy per rank, and on one GPU node
eight copies at once). Peak host memory while loading is one rank's shard plus one tensor's rows.

Only parameters go to the meta device; buffers (rotary ``inv_freq`` ...) are computed on the host
at construction as usual and restored after ``to_empty``. FSDP2 shards dim 0 the way
``torch.chunk`` does (rank r holds rows ``[r*c, (r+1)*c)`` with ``c = ceil(rows / world)``, the
last ranks fewer or none); the global offset comes from the DTensor's own placement. The rows
are read with ``pread`` straight into the shard (:class:`SafetensorsRows`), not through an mmap
(mapped pages count in a process's RSS: a rank would look as if it held the file).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

# name -> full tensor for a parameter the checkpoint does not have (a fresh value or score head);
# every rank must return the same values (seeded), each keeps its own rows.
MissingInit = Callable[[str, torch.Size], Tensor]


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no init cost);
    buffers stay real. (The technique of accelerate's ``init_empty_weights(include_buffers=False)``.)"""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def has_meta_params(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of an HF folder (one file, or a sharded index)."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: folder / v for k, v in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(
            f"{folder}: no model.safetensors or model.safetensors.index.json (sharded init reads safetensors)"
        )
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


# safetensors dtype names -> torch dtypes (the format's own spelling).
ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class SafetensorsRows:
    """Reads row ranges of tensors from one safetensors file with ``pread`` into the caller's
    buffer: no mmap, so a rank's resident memory grows by its own rows only (``safe_open``'s
    slices map the file, and every page touched counts in the process's RSS).

    Format (safetensors' spec): an 8-byte little-endian header length, a JSON header
    ``{name: {dtype, shape, data_offsets: [begin, end]}}``, then the data, row-major.
    """

    def __init__(self, path: Path) -> None:
        import os
        import struct

        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        (n,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        self.header = {k: v for k, v in json.loads(os.pread(self.fd, n, 8)).items() if k != "__metadata__"}
        self.base = 8 + n

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.header[key]["shape"])

    def read_rows(self, key: str, start: int, stop: int, out: Tensor) -> int:
        """Rows ``[start, stop)`` of ``key`` into ``out`` (any dtype: cast after reading). Returns bytes read."""
        import os

        meta = self.header[key]
        dtype = ST_DTYPES[meta["dtype"]]
        shape = meta["shape"]
        row = dtype.itemsize
        for d in shape[1:]:
            row *= d
        if not shape:
            start, stop, row = 0, 1, dtype.itemsize
        nbytes = (stop - start) * row
        same = out.dtype == dtype and out.is_contiguous() and out.device.type == "cpu"
        buf = out if same else torch.empty(out.shape, dtype=dtype)
        view = memoryview(buf.view(torch.uint8).numpy()).cast("B") if nbytes else None
        done, offset = 0, self.base + meta["data_offsets"][0] + start * row
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{self.path}: short read of {key} ({done} of {nbytes} bytes)")
            done += got
        if not same:
            out.copy_(buf)
        return nbytes

    def close(self) -> None:
        import os

        os.close(self.fd)


def _rows(param: Tensor) -> tuple[Tensor, int]:
    """This rank's local tensor of a parameter and the global index of its first row."""
    if not isinstance(param, DTensor):
        return param, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return param.to_local(), int(offset[0]) if offset else 0


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate the (sharded) meta parameters on ``device``, keeping the real buffers' values."""
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    module.to_empty(device=device)
    with torch.no_grad():
        for n, b in module.named_buffers():
            b.copy_(buffers[n])


@torch.no_grad()
def load_sharded(
    module: nn.Module,
    path: str | Path,
    key_of: Callable[[str], str],
    missing: dict[str, MissingInit] | None = None,
) -> dict[str, int]:
    """Fill every parameter's local rows from the checkpoint at ``path``.

    ``key_of`` maps a module parameter name to the checkpoint's tensor name; ``missing`` gives
    the parameters the checkpoint lacks (anything else missing is an error naming it). Returns
    ``{"tensors": read, "bytes_read": ..., "initialised": ...}``.
    """
    files = checkpoint_files(path)
    missing = missing or {}
    stats = {"tensors": 0, "bytes_read": 0, "initialised": 0}
    with ExitStack() as stack:
        readers: dict[Path, SafetensorsRows] = {}
        for name, param in module.named_parameters():
            local, start = _rows(param)
            stop = start + (local.shape[0] if local.dim() else 1)
            key = key_of(name)
            if key in files:
                f = files[key]
                if f not in readers:
                    readers[f] = SafetensorsRows(f)
                    stack.callback(readers[f].close)
                shape = readers[f].shape(key)
                if shape != tuple(param.shape):
                    raise ValueError(f"{path}: tensor {key} has shape {shape}, the model's {name} {tuple(param.shape)}")
                if local.numel() == 0:
                    continue
                if local.device.type == "cpu":
                    stats["bytes_read"] += readers[f].read_rows(key, start, stop, local)
                else:  # read into host memory, then one copy to the device
                    host = torch.empty(local.shape, dtype=local.dtype)
                    stats["bytes_read"] += readers[f].read_rows(key, start, stop, host)
                    local.copy_(host, non_blocking=False)
                stats["tensors"] += 1
            elif name in missing:
                full = missing[name](name, param.shape)
                if local.numel():
                    local.copy_(full[start:stop] if local.dim() else full)
                stats["initialised"] += 1
            else:
                raise KeyError(f"{path}: the checkpoint has no tensor {key!r} (for parameter {name})")
    return stats
