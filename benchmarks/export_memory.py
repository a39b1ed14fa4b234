"""Peak host memory of exporting a checkpoint as an HF folder, against the model's bytes.

    python -m benchmarks.export_memory [--preset base] [--shard-mb 256]

Writes a real checkpoint of the preset (a 1-rank FSDP2 engine through the trainer's own
save_checkpoint, optimizer state included), then, each in a fresh process:
- ``baseline``: the interpreter with torch and torch.distributed.checkpoint imported (the floor);
- ``stream``: ``hybrid_rl.export`` (loads one safetensors shard at a time from the checkpoint);
- ``gather``: what the end of a run did before (every rank materialised the full fp32 model:
  ``FSDPEngine.iter_full_params`` into one dict, then one file), the same checkpoint loaded first.
Peak RSS (ru_maxrss) of each; the export's own cost is its peak minus the baseline. Writes
results/export_memory.json and .png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, figure, machine_info, save_figure, write_json

BASELINE = "import resource, torch, torch.distributed.checkpoint; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
STREAM = (
    "import resource, sys; from hybrid_rl.export import export_checkpoint; "
    "export_checkpoint(sys.argv[1], sys.argv[2], shard_mb=int(sys.argv[3])); "
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
)
GATHER = """
import resource, sys
from hybrid_rl.env import setup_process_env
setup_process_env(threads_per_rank=2)
from benchmarks.common import actor_config, model_config
from hybrid_rl.dist import init_distributed
from hybrid_rl.engine.builders import build_policy_engine
from hybrid_rl.trainer.checkpoint import AppState, load_checkpoint
ctx = init_distributed("cpu")
engine = build_policy_engine(sys.argv[2], model_config(), actor_config(), ctx, total_steps=1)
load_checkpoint(sys.argv[1], {"app": AppState(engine)}, 0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
full = {n: t.cpu().contiguous() for n, t in engine.iter_full_params(dtype=None)}
print(before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""
WRITE = """
import sys
from hybrid_rl.env import setup_process_env
setup_process_env(threads_per_rank=2)
from benchmarks.common import actor_config, model_config
from hybrid_rl.dist import init_distributed
from hybrid_rl.engine.builders import build_policy_engine
from hybrid_rl.trainer.checkpoint import AppState, save_checkpoint
ctx = init_distributed("cpu")
engine = build_policy_engine(sys.argv[2], model_config(), actor_config(), ctx, total_steps=1)
path = save_checkpoint(sys.argv[1], 1, {"app": AppState(engine)}, {"step": 1}, 1, 0, 1, {"model_dir": sys.argv[2]})
print(path, sum(p.numel() for p in engine.module.parameters()) * 4)
"""


def python(code: str, *args: str) -> list[str]:
    p = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=1800)
    return p.stdout.strip().splitlines()[-1].split()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="base")
    ap.add_argument("--shard-mb", type=int, default=256)
    args = ap.parse_args()
    from hybrid_rl.models.tiny import tiny_model_path

    model = str(tiny_model_path(args.preset))
    work = Path(tempfile.mkdtemp(prefix="export_mem_"))
    ckpt, model_bytes = python(WRITE, str(work / "checkpoints"), model)
    model_bytes = int(model_bytes)
    baseline = int(python(BASELINE)[0])
    stream = int(python(STREAM, ckpt, str(work / "hf"), str(args.shard_mb))[0])
    loaded, gathered = (int(x) for x in python(GATHER, ckpt, model))
    gib = 2**30
    payload = {
        "machine": machine_info(), "preset": args.preset, "shard_mb": args.shard_mb, "model_fp32_bytes": model_bytes,
        "baseline_peak_bytes": baseline, "stream_peak_bytes": stream, "stream_over_baseline_bytes": stream - baseline,
        "gather_peak_bytes": gathered, "gather_over_loaded_engine_bytes": gathered - loaded,
        "stream_cost_over_model": (stream - baseline) / model_bytes, "gather_cost_over_model": (gathered - loaded) / model_bytes,
    }  # fmt: skip
    write_json(f"export_memory_{args.preset}", payload)
    print(json.dumps({k: v for k, v in payload.items() if k != "machine"}, indent=1))
    fig, ax = figure((7, 3.5))
    bars = {"model (fp32)": model_bytes, "stream export: peak - floor": stream - baseline, "full gather: added peak": gathered - loaded}
    ax.barh(list(bars), [v / gib for v in bars.values()], color=["tab:gray", "tab:green", "tab:red"])
    ax.set_xlabel("GiB")
    ax.set_title(f"Exporting a checkpoint ({args.preset}, {args.shard_mb} MiB shards): host memory")
    save_figure(fig, f"export_memory_{args.preset}", grid_axis="x")


if __name__ == "__main__":
    main()
