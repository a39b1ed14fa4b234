"""Sharded initialisation: build the model with its parameters on the meta device, shard it with
FSDP2, then read each rank's rows of every parameter straight from the safetensors files.

No rank ever holds the full model (the old path loaded the whole checkpoint on every rank, moved
it to the device and only then sharded it: a transient full copy per rank, and on one GPU node
eight copies at once). Peak host memory while loading is one rank's shard plus one tensor's rows.

Only parameters go to the meta device; buffers (rotary ``inv_freq`` ...) are computed on the host
at construction as usual and restored after ``to_empty``. FSDP2 shards dim 0 the way
``torch.chunk`` does (rank r holds rows ``[r*c, (r+1)*c)`` with ``c = ceil(rows / world)``, the
last ranks fewer or none); the global offset comes from the DTensor's own placement.
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
    from safetensors import safe_open

    files = checkpoint_files(path)
    missing = missing or {}
    stats = {"tensors": 0, "bytes_read": 0, "initialised": 0}
    with ExitStack() as stack:
        handles: dict[Path, object] = {}
        for name, param in module.named_parameters():
            local, start = _rows(param)
            stop = start + (local.shape[0] if local.dim() else 1)
            key = key_of(name)
            if key in files:
                f = files[key]
                if f not in handles:
                    handles[f] = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
                sl = handles[f].get_slice(key)
                shape = tuple(sl.get_shape())
                if shape != tuple(param.shape):
                    raise ValueError(f"{path}: tensor {key} has shape {shape}, the model's {name} {tuple(param.shape)}")
                if local.numel() == 0:
                    continue
                rows = sl[start:stop] if local.dim() else sl[:]
                local.copy_(rows)
                stats["tensors"] += 1
                stats["bytes_read"] += rows.numel() * rows.element_size()
            elif name in missing:
                full = missing[name](name, param.shape)
                if local.numel():
                    local.copy_(full[start:stop] if local.dim() else full)
                stats["initialised"] += 1
            else:
                raise KeyError(f"{path}: the checkpoint has no tensor {key!r} (for parameter {name})")
    return stats
