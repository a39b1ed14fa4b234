"""Export a checkpoint's policy as a Hugging Face model folder, streaming tensors out of the
distributed checkpoint (never a full fp32 copy of the model in memory)::

    python -m hybrid_rl.export <checkpoint dir> <out dir> [--dtype bfloat16] [--shard-mb 2048] [--adapter] [--overwrite]

Reads the checkpoint's metadata (names, shapes, dtypes), then loads the policy's tensors a shard at
a time with ``torch.distributed.checkpoint`` (a partial load of just those keys, no process
group), casts them and writes ``model-0000i-of-0000n.safetensors`` plus the index that
``transformers`` reads. Peak memory is about one shard in the saved dtype plus its cast copy.
``config.json`` (its ``dtype`` and ``torch_dtype`` set to the dtype written), the tokenizer files
and the chat template come from the model folder the run started from (recorded in the
checkpoint's manifest as ``model_dir``). The end of an RL run exports through this same function.

A folder that is not empty is refused unless ``--overwrite``: the new shards
(``model-0000i-of-0000n``) do not replace an older ``model.safetensors``, and ``transformers``
would load the old weights beside them. With ``--overwrite`` every weight file, index, adapter
file and ``config.json`` already there is removed first, so the folder holds one model.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import shutil
import sys
from pathlib import Path
from typing import Any

PREFIX = "app.model.lm."  # the policy's HF module inside the checkpoint (PolicyModule.lm)
DTYPES = {"float32", "bfloat16", "float16"}
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".distcp")
# What --overwrite removes from the output folder: any file that says which weights the folder
# holds (weights, their indexes, a PEFT adapter's files, the model config). The tokenizer and
# other files stay, or are replaced by the source model's.
STALE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
STALE_NAMES = ("config.json", "generation_config.json", "adapter_config.json")

log = logging.getLogger("hybrid_rl")


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


def is_stale(name: str) -> bool:
    """Whether ``--overwrite`` removes this file: it says which weights the folder holds."""
    return name.endswith(STALE_SUFFIXES) or name in STALE_NAMES or name.startswith("adapter_model.")


def prepare_out(out: Path, overwrite: bool, ckpt: Path, src: Path) -> list[str]:
    """Make ``out`` ready to hold exactly one export, before any tensor is read: refuse the
    checkpoint or the source model folder itself, refuse a non-empty folder unless ``overwrite``
    (new shard names would not replace an old ``model.safetensors``, so a mix would load), and with
    ``overwrite`` remove the stale model files. Returns the names removed."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out}: the output path is a file, not a folder")
    if out.resolve() in (ckpt.resolve(), src.resolve()):
        raise ValueError(f"{out}: the output folder is the checkpoint or the model folder it reads from; pick another")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not overwrite:
        shown = next((n for n in entries if n.endswith(STALE_SUFFIXES)), entries[0])  # the weights a mix would load
        raise FileExistsError(f"{out}: the output folder is not empty (holds {shown!r} and {len(entries) - 1} more); "
                              "pass --overwrite (overwrite=True) to replace the model in it")  # fmt: skip
    removed = [n for n in entries if (out / n).is_file() and is_stale(n)]
    for n in removed:
        (out / n).unlink()
    if removed:
        log.info("export: removed %d stale model files from %s (--overwrite): %s", len(removed), out, ", ".join(removed))
    out.mkdir(parents=True, exist_ok=True)
    return removed


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None, shard_mb: int = 2048,
                      model_dir: str | None = None, adapter_only: bool = False, overwrite: bool = False) -> dict[str, Any]:  # fmt: skip
    """Write the policy of ``checkpoint`` to ``out_dir`` as an HF folder; returns what was written
    (tensors, bytes, shards, peak RSS of this process, stale files removed). A LoRA run's
    checkpoint holds adapters only: it is written merged into the base (``W + s B A``), or with
    ``adapter_only`` as a PEFT adapter folder (:mod:`hybrid_rl.export_lora`). A non-empty
    ``out_dir`` is refused unless ``overwrite`` (:func:`prepare_out`)."""
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

    lora = lora_settings(manifest) is not None
    if adapter_only and not lora:
        raise ValueError(f"{ckpt}: a full fine-tune's checkpoint has no adapter to export (drop --adapter)")
    removed = prepare_out(out, overwrite, ckpt, src)
    if lora:
        info = export_lora(ckpt, out, src, manifest, dtype, shard_mb, adapter_only)
        if not adapter_only:
            write_index_and_files(out, src, config, info.pop("weight_map"), info["bytes"], info.pop("dtype"))
        return {**info, "removed": removed}
    reader = dcp.FileSystemReader(str(ckpt))
    meta = reader.read_metadata().state_dict_metadata
    names = sorted(k for k in meta if k.startswith(PREFIX))
    if config.get("tie_word_embeddings"):
        names = [n for n in names if n != PREFIX + "lm_head.weight"]  # HF re-ties it on load
    target = getattr(torch, dtype) if dtype else None
    elem = {n: (target or meta[n].properties.dtype).itemsize for n in names}
    sizes = {n: meta[n].size.numel() * elem[n] for n in names}
    buckets = _buckets(names, sizes, shard_mb << 20)
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
    return {"tensors": len(names), "bytes": total, "shards": len(buckets), "peak_rss_bytes": peak, "step": manifest.get("step"),
            "removed": removed}  # fmt: skip


def write_index_and_files(out: Path, src: Path, config: dict, weight_map: dict[str, str], total: int, dtype: str) -> None:
    """The shard index, ``config.json`` and every non-weight file of the source model folder
    (tokenizer, chat template, generation config). Both of the config's dtype keys name the dtype
    written: ``transformers`` writes ``dtype`` (older versions ``torch_dtype``) and reads either
    for ``dtype="auto"``, and vLLM takes its default dtype from it; a source value left beside a
    cast would load a bf16 export as fp32."""
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_FILES) and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps({**config, "dtype": dtype, "torch_dtype": dtype}, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid_rl.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="a checkpoint directory (outputs/<run>/checkpoints/step_XXXXXX)")
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast to this dtype (default: as saved, fp32)")
    ap.add_argument("--shard-mb", type=int, default=2048, help="safetensors shard size (MiB)")
    ap.add_argument("--model-dir", default=None, help="the model folder the run started from (default: from the manifest)")
    ap.add_argument("--adapter", action="store_true", help="LoRA runs: write the PEFT adapter folder instead of the merged model")
    ap.add_argument("--overwrite", action="store_true", help="replace the model files already in out_dir")
    args = ap.parse_args(argv)
    if not (Path(args.checkpoint) / "manifest.json").is_file():
        print(f"error: {args.checkpoint!r} is not a finished checkpoint (no manifest.json)", file=sys.stderr)
        return 2
    try:
        a = args
        info = export_checkpoint(a.checkpoint, a.out_dir, a.dtype, a.shard_mb, a.model_dir, a.adapter, a.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out_dir": args.out_dir, **info}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
