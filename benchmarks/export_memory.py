"""Peak host memory of exporting a checkpoint as an HF folder, against the model's bytes.

    python -m benchmarks.export_memory [--preset base] [--shard-mb 256]

Writes a real checkpoint of the preset (a 1-rank FSDP2 engine through the trainer's own
save_checkpoint, optimizer state included), then exports it with ``hybrid_rl.export`` in a fresh
process (torch imported first) and records the memory the export adds: its RSS high-water mark
(sampled every 5 ms) minus the RSS right before it. The full-gather path it replaces
(``FSDPEngine.iter_full_params`` into one dict) held the whole fp32 model on every rank, 1.0x the
model per rank on top of the rank's shard, optimizer and engine. Writes
results/export_memory_<preset>_<shard>mb.json and .png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, figure, machine_info, save_figure, write_json

# Measured inside each process: the RSS right before the operation, and its high-water mark while
# it runs (a thread samples every 5 ms; ru_maxrss would include the transient peak of imports).
PROBE = """
import threading, time, psutil
class Probe:
    def __enter__(self):
        self.p = psutil.Process(); self.before = self.peak = self.p.memory_info().rss; self.run = True
        self.t = threading.Thread(target=self.loop, daemon=True); self.t.start(); return self
    def loop(self):
        while self.run:
            self.peak = max(self.peak, self.p.memory_info().rss); time.sleep(0.005)
    def __exit__(self, *a):
        self.run = False; self.t.join(); self.peak = max(self.peak, self.p.memory_info().rss)
"""
STREAM = PROBE + """
import sys
import torch, torch.distributed.checkpoint, safetensors.torch  # imported before the measurement
from hybrid_rl.export import export_checkpoint
with Probe() as m:
    export_checkpoint(sys.argv[1], sys.argv[2], shard_mb=int(sys.argv[3]))
print(m.before, m.peak)
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
    before, stream = (int(x) for x in python(STREAM, ckpt, str(work / "hf"), str(args.shard_mb)))
    gib = 2**30
    payload = {
        "machine": machine_info(), "preset": args.preset, "shard_mb": args.shard_mb, "model_fp32_bytes": model_bytes,
        "rss_before_bytes": before, "peak_bytes": stream, "added_bytes": stream - before,
        "added_over_model": (stream - before) / model_bytes,
        # the full-gather path it replaces held the whole fp32 model on every rank: 1.0 x the model per rank
        "full_gather_added_over_model_per_rank": 1.0,
    }  # fmt: skip
    write_json(f"export_memory_{args.preset}_{args.shard_mb}mb", payload)
    print(json.dumps({k: v for k, v in payload.items() if k != "machine"}, indent=1))
    fig, ax = figure((7, 3.5))
    bars = {"model (fp32)": model_bytes, f"streamed export, {args.shard_mb} MiB shards: added peak": stream - before}
    ax.barh(list(bars), [v / gib for v in bars.values()], color=["tab:gray", "tab:green"])
    ax.set_xlabel("GiB")
    ax.set_title(f"Exporting a checkpoint ({args.preset}, {args.shard_mb} MiB shards): host memory")
    save_figure(fig, f"export_memory_{args.preset}_{args.shard_mb}mb", grid_axis="x")


if __name__ == "__main__":
    main()
