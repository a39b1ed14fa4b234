"""Export of a LoRA run's checkpoint (adapters and their optimizer only; the base is the model
folder the run started from, recorded in the manifest):

- ``adapter_only``: a PEFT adapter folder, ``adapter_config.json`` + ``adapter_model.safetensors``
  (``peft.PeftModel.from_pretrained(base, folder)`` and vLLM's ``LoRARequest`` load it);
- otherwise a merged HF model: each base tensor is streamed from the model folder, one shard at a
  time, and every adapted weight becomes ``W + (alpha / r) B A`` (computed in fp32), so the result
  loads anywhere a full fine-tune's export does.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path
from typing import Any

from hybrid_rl.engine.lora import ADAPTER, adapter_config, is_lora, merged, peft_name

PREFIX = "app.model.lm."  # the policy's HF module inside the checkpoint (PolicyModule.lm)


def lora_settings(manifest: dict) -> dict | None:
    """The run's ``actor.lora`` settings when the checkpoint is a LoRA run's, else None."""
    lora = manifest.get("config", {}).get("actor", {}).get("lora", {})
    return lora if int(lora.get("rank", 0) or 0) > 0 else None


def read_adapters(ckpt: Path) -> dict[str, Any]:
    """The adapters' full tensors from the checkpoint, by trainer name (``...lora_A.default.weight``)."""
    import torch
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(ckpt))
    meta = reader.read_metadata().state_dict_metadata
    part = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in meta if k.startswith(PREFIX) and is_lora(k)}
    if not part:
        raise ValueError(f"{ckpt}: the manifest says LoRA but the checkpoint holds no adapter tensors")
    dcp.load(part, storage_reader=reader, no_dist=True)
    return {k[len(PREFIX) :]: t for k, t in part.items()}


def export_lora(ckpt: Path, out: Path, src: Path, manifest: dict, dtype: str | None, shard_mb: int, adapter_only: bool) -> dict:
    """Write the adapter folder, or the merged model's shards (returning their ``weight_map``);
    returns what was written."""
    from types import SimpleNamespace

    settings = SimpleNamespace(**lora_settings(manifest))
    adapters = read_adapters(ckpt)
    out.mkdir(parents=True, exist_ok=True)
    if adapter_only:
        info = _write_adapter(out, adapters, adapter_config(settings, str(src)), dtype)
    else:
        info = _write_merged(out, src, adapters, settings.alpha / settings.rank, dtype, shard_mb)
    info.update(step=manifest.get("step"), peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return info


def _write_adapter(out: Path, adapters: dict, config: dict, dtype: str | None) -> dict:
    import torch
    from safetensors.torch import save_file

    target = getattr(torch, dtype) if dtype else None
    tensors = {peft_name(n): (t.to(target) if target else t).contiguous() for n, t in adapters.items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "shards": 1}


def _base_tensors(src: Path, adapters: dict, scale: float, target: Any):
    """``(name, tensor)`` of the base model folder, one file open at a time, adapted weights merged."""
    from safetensors import safe_open

    from hybrid_rl.engine.sharded_init import checkpoint_files

    for file in sorted(set(checkpoint_files(src).values())):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                stem = key.removesuffix(".weight")
                a, b = adapters.get(f"{stem}.lora_A.{ADAPTER}.weight"), adapters.get(f"{stem}.lora_B.{ADAPTER}.weight")
                adapted = a is not None and b is not None
                if adapted:
                    t = merged(t, a, b, scale)
                yield key, (t.to(target) if target is not None else t).contiguous(), adapted


def _write_merged(out: Path, src: Path, adapters: dict, scale: float, dtype: str | None, shard_mb: int) -> dict:
    """Merge and write shards of about ``shard_mb`` as they fill (peak: one shard and one base
    file's tensor); returns what was written, with the ``weight_map`` for the index."""
    import torch
    from safetensors.torch import save_file

    target = getattr(torch, dtype) if dtype else None
    parts: list[list[str]] = []
    shard: dict[str, Any] = {}
    used = total = n_merged = 0
    saved_dtype = dtype

    def write() -> None:
        parts.append(list(shard))
        save_file(shard, str(out / f".part-{len(parts):05d}.safetensors"), metadata={"format": "pt"})
        shard.clear()

    for key, t, was_merged in _base_tensors(src, adapters, scale, target):
        size = t.numel() * t.element_size()
        if shard and used + size > shard_mb << 20:
            write()
            used = 0
        shard[key], used, total, n_merged = t, used + size, total + size, n_merged + was_merged
        saved_dtype = saved_dtype or str(t.dtype).removeprefix("torch.")
    if shard:
        write()
    if n_merged != len(adapters) // 2:
        raise ValueError(f"{src}: merged {n_merged} of the {len(adapters) // 2} adapted weights (base and adapter names differ)")
    weight_map = {}
    for i, keys in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        (out / f".part-{i + 1:05d}.safetensors").rename(out / name)
        weight_map.update(dict.fromkeys(keys, name))
    # the caller writes the index, config.json and the tokenizer files (as for a full fine-tune)
    return {"tensors": len(weight_map), "bytes": total, "shards": len(parts), "merged": n_merged,
            "weight_map": weight_map, "dtype": saved_dtype or "float32"}  # fmt: skip
