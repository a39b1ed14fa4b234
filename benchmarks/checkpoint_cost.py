"""Benchmark: what a checkpoint costs (the price of periodic checkpoints), per model size.

    python -m benchmarks.checkpoint_cost [--presets small,base] [--ranks 2] [--repeats 3]

Under real torchrun ranks: an FSDP2 actor (fp32 masters + AdamW state after one step) is saved
with the trainer's own ``save_checkpoint`` (DCP, sharded, written to a temporary directory and
renamed) and loaded back. Reports seconds per save and load, bytes on disk, and the write rate.
Writes results/checkpoint_cost.json and results/checkpoint_cost.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import figure, machine_info, save_figure, write_json

HERE = Path(__file__).resolve().parent


def worker(args: argparse.Namespace) -> None:
    from hybrid_rl.env import setup_process_env

    setup_process_env(threads_per_rank=1)

    from benchmarks.common import actor_config, model_config
    from hybrid_rl.algorithms.losses import agg_weights, make_sft_loss
    from hybrid_rl.batch import Sample, collate
    from hybrid_rl.dist import barrier, finish_rank, init_distributed
    from hybrid_rl.engine.builders import build_policy_engine
    from hybrid_rl.models.tiny import tiny_model_path
    from hybrid_rl.trainer import checkpoint as ckpt

    ctx = init_distributed("cpu")
    path = str(tiny_model_path(args.preset)) if ctx.rank == 0 else None
    barrier()
    path = str(tiny_model_path(args.preset))
    actor = build_policy_engine(path, model_config(), actor_config(micro_batch_size=4), ctx, total_steps=10)
    samples = [Sample([5, 6, 7], list(range(10, 26)), [0.0] * 16, [1] * 16, "stop", i) for i in range(4)]
    batch = collate(samples, 0)
    batch.loss_weights = agg_weights(batch.response_mask, "token-mean", float(batch.response_mask.sum()) * ctx.world_size, 8.0)
    actor.train_batch(batch, make_sft_loss())  # AdamW state exists, as in a real run
    root = Path(args.dir)
    saves, loads = [], []
    for i in range(args.repeats):
        barrier()
        t = time.perf_counter()
        final = ckpt.save_checkpoint(root, i + 1, {"app": ckpt.AppState(actor)}, {"step": i + 1}, 2, ctx.rank, ctx.world_size)
        saves.append(time.perf_counter() - t)
        barrier()
        t = time.perf_counter()
        ckpt.load_checkpoint(final, {"app": ckpt.AppState(actor)}, ctx.rank)
        loads.append(time.perf_counter() - t)
    if ctx.rank == 0:
        size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        params = sum(p.numel() for p in actor.module.parameters())  # DTensor numel is the global size
        out = {"preset": args.preset, "params": params, "ranks": ctx.world_size, "bytes": size, "save_s": saves, "load_s": loads}
        Path(args.out).write_text(json.dumps(out))
    barrier()
    finish_rank(0)


def run_preset(preset: str, ranks: int, repeats: int) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    with tempfile.TemporaryDirectory(dir=os.environ.get("HYBRID_RL_BENCH_TMP")) as d:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        cmd += ["-m", "benchmarks.checkpoint_cost", "--worker", "--preset", preset, "--repeats", str(repeats)]
        cmd += ["--dir", d, "--out", str(out)]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent, check=False, timeout=1800)
    if p.returncode != 0 or out.stat().st_size == 0:
        raise RuntimeError(f"checkpoint_cost {preset} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="small,base")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--preset", default="base")
    ap.add_argument("--dir", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for preset in args.presets.split(","):
        r = run_preset(preset, args.ranks, args.repeats)
        r["save_median_s"] = sorted(r["save_s"])[len(r["save_s"]) // 2]
        r["load_median_s"] = sorted(r["load_s"])[len(r["load_s"]) // 2]
        r["write_mib_per_s"] = r["bytes"] / 2**20 / r["save_median_s"]
        rows.append(r)
        print(
            f"{preset}: {r['params'] / 1e6:.1f}M params, {r['bytes'] / 2**20:.0f} MiB on disk, save {r['save_median_s']:.2f} s, "
            f"load {r['load_median_s']:.2f} s ({r['write_mib_per_s']:.0f} MiB/s) on {r['ranks']} ranks"
        )
    write_json("checkpoint_cost", {"machine": machine_info(), "rows": rows})
    fig, ax = figure((6, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["save_median_s"] for r in rows], 0.4, label="save (model + AdamW, DCP)")
    ax.bar([x + 0.2 for x in xs], [r["load_median_s"] for r in rows], 0.4, label="load")
    ax.set_xticks(list(xs), [f"{r['preset']}\n{r['params'] / 1e6:.0f}M, {r['bytes'] / 2**20:.0f} MiB" for r in rows])
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"Checkpoint cost on {rows[0]['ranks']} ranks (CPU)")
    ax.legend()
    save_figure(fig, "checkpoint_cost")


if __name__ == "__main__":
    main()
