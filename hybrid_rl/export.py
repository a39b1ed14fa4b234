"""Export a checkpoint's policy as a Hugging Face model folder, streaming tensors out of the
distributed checkpoint (never a full fp32 copy of the model in memory)::

    python -m hybrid_rl.export <checkpoint dir> <out dir> [--dtype bfloat16] [--shard-mb 2048] [--adapter]

Reads the checkpoint's metadata (names, shapes, dtypes), then loads the policy's tensors a shard at
a time with ``torch.distributed.checkpoint`` (a partial load of just those keys, no process
group), casts them and writes ``model-0000i-of-0000n.safetensors`` plus the index that
``transformers`` reads. Peak memory is about one shard in the saved dtype plus its cast copy.
``config.json`` (with ``torch_dtype``), the tokenizer files and the chat template come from the
model folder the run started from (recorded in the checkpoint's manifest as ``model_dir``).
The end of an RL run exports through this same function.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
from pathlib import Path
from typing import Any

PREFIX = "app.model.lm."  # the policy's HF module inside the checkpoint (PolicyModule.lm)
DTYPES = {"float32", "bfloat16", "float16"}
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".distcp")


def _buckets(names: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    out: list[list[str]] = [[]]
    used = 0
    for n in names:
        if out[-1] and used + sizes[n] > limit:
            out.append([])
            used = 0
        out[-1].append(n)
        used += sizes[n]
    return out


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None, shard_mb: int = 2048,
                      model_dir: str | None = None, adapter_only: bool = False) -> dict[str, Any]:  # fmt: skip
    """Write the policy of ``checkpoint`` to ``out_dir`` as an HF folder; returns what was written
    (tensors, bytes, shards, peak RSS of this process). A LoRA run's checkpoint holds adapters
    only: it is written merged into the base (``W + s B A``), or with ``adapter_only`` as a PEFT
    adapter folder (:mod:`hybrid_rl.export_lora`)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    ckpt, out = Path(checkpoint), Path(out_dir)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    src = Path(model_dir or manifest.get("model_dir", ""))
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{ckpt}: the model folder it was made from ({src}) has no config.json; pass --model-dir")
    config = json.loads((src / "config.json").read_text())
    from hybrid_rl.export_lora import export_lora, lora_settings

    if lora_settings(manifest) is not None:
        info = export_lora(ckpt, out, src, manifest, dtype, shard_mb, adapter_only)
        if not adapter_only:
            write_index_and_files(out, src, config, info.pop("weight_map"), info["bytes"], info.pop("dtype"))
        return info
    if adapter_only:
        raise ValueError(f"{ckpt}: a full fine-tune's checkpoint has no adapter to export (drop --adapter)")
    reader = dcp.FileSystemReader(str(ckpt))
    meta = reader.read_metadata().state_dict_metadata
    names = sorted(k for k in meta if k.startswith(PREFIX))
    if config.get("tie_word_embeddings"):
        names = [n for n in names if n != PREFIX + "lm_head.weight"]  # HF re-ties it on load
    target = getattr(torch, dtype) if dtype else None
    elem = {n: (target or meta[n].properties.dtype).itemsize for n in names}
    sizes = {n: meta[n].size.numel() * elem[n] for n in names}
    buckets = _buckets(names, sizes, shard_mb << 20)
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for i, bucket in enumerate(buckets):
        part = {n: torch.empty(meta[n].size, dtype=meta[n].properties.dtype) for n in bucket}
        dcp.load(part, storage_reader=reader, no_dist=True)  # only these keys are read
        file = f"model-{i + 1:05d}-of-{len(buckets):05d}.safetensors"
        tensors = {n[len(PREFIX) :]: (t.to(target) if target else t).contiguous() for n, t in part.items()}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del part, tensors
    total = sum(sizes.values())
    write_index_and_files(out, src, config, weight_map, total, dtype or str(meta[names[0]].properties.dtype).removeprefix("torch."))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tensors": len(names), "bytes": total, "shards": len(buckets), "peak_rss_bytes": peak, "step": manifest.get("step")}


def write_index_and_files(out: Path, src: Path, config: dict, weight_map: dict[str, str], total: int, dtype: str) -> None:
    """The shard index, ``config.json`` (with ``torch_dtype``) and every non-weight file of the
    source model folder (tokenizer, chat template, generation config)."""
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_FILES) and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid_rl.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a checkpoint directory (outputs/<run>/checkpoints/step_XXXXXX)")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast to this dtype (default: as saved, fp32)")
    ap.add_argument("--shard-mb", type=int, default=2048, help="safetensors shard size (MiB)")
    ap.add_argument("--model-dir", default=None, help="the model folder the run started from (default: from the manifest)")
    ap.add_argument("--adapter", action="store_true", help="LoRA runs: write the PEFT adapter folder instead of the merged model")
    args = ap.parse_args(argv)
    if not (Path(args.checkpoint) / "manifest.json").is_file():
        print(f"error: {args.checkpoint!r} is not a finished checkpoint (no manifest.json)", file=sys.stderr)
        return 2
    try:
        info = export_checkpoint(args.checkpoint, args.out_dir, args.dtype, args.shard_mb, args.model_dir, args.adapter)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out_dir": args.out_dir, **info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
