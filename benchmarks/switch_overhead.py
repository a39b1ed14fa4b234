"""Benchmark: the cost of switching modes, per phase, against the memcpy floor and the naive path.

    python -m benchmarks.switch_overhead [--presets tiny,small,base] [--ranks 2] [--dtype bfloat16]

For each model size: the hybrid switch under torchrun (FSDP2 shards -> all-gather -> vLLM
in-process reload), a raw memcpy of the same bytes (the floor), and the naive path (save the
model to disk, start a new vLLM engine, first token). Writes results/switch_overhead.json and
results/switch_overhead.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, figure, machine_info, save_figure, write_json

HERE = Path(__file__).resolve().parent


def run_worker(mode: str, preset: str, dtype: str, ranks: int, repeats: int) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    if mode == "hybrid":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            "-m",
            "benchmarks.switch_worker",
            "hybrid",
        ]
    else:
        cmd = [sys.executable, "-m", "benchmarks.switch_worker", "naive"]
    cmd += ["--preset", preset, "--dtype", dtype, "--repeats", str(repeats), "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent, check=False, timeout=1800)
    if p.returncode != 0 or out.stat().st_size == 0:
        raise RuntimeError(f"{mode} {preset} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(out.read_text())


def plot(rows: list[dict], path: Path) -> None:
    labels = [f"{r['preset']}\n{r['hybrid']['params'] / 1e6:.1f}M" for r in rows]
    series = {
        "memcpy floor": [r["hybrid"]["memcpy_floor"]["median_s"] for r in rows],
        "sync weights": [r["hybrid"]["phases_median_s"]["to_rollout/sync_weights"] for r in rows],
        "to_rollout (all phases)": [r["hybrid"]["to_rollout_median_s"] for r in rows],
        "naive: save + new engine": [r["naive"]["total_s"] for r in rows],
    }
    fig, ax = figure((8, 4.5))
    width = 0.2
    for i, (name, ys) in enumerate(series.items()):
        xs = [j + (i - 1.5) * width for j in range(len(rows))]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log)")
    ax.set_title(f"Switch to rollout: hybrid vs floor vs naive ({rows[0]['hybrid']['world_size']} ranks, {rows[0]['dtype']})")
    ax.legend(fontsize=8)
    save_figure(fig, path.stem)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", default="tiny,small,base,large")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for preset in args.presets.split(","):
        h = run_worker("hybrid", preset, args.dtype, args.ranks, args.repeats)
        n = run_worker("naive", preset, args.dtype, 1, args.repeats)
        sync = h["phases_median_s"]["to_rollout/sync_weights"]
        row = {
            "preset": preset,
            "dtype": args.dtype,
            "hybrid": h,
            "naive": n,
            "sync_over_memcpy": sync / h["memcpy_floor"]["median_s"],
            "naive_over_switch": n["total_s"] / (h["to_rollout_median_s"] + h["to_train_median_s"]),
        }
        rows.append(row)
        print(
            f"{preset:>5} {h['params'] / 1e6:7.1f}M  sync {sync:.3f}s  memcpy {h['memcpy_floor']['median_s']:.4f}s "
            f"({row['sync_over_memcpy']:.1f}x)  switch {h['to_rollout_median_s'] + h['to_train_median_s']:.3f}s  "
            f"naive {n['total_s']:.2f}s ({row['naive_over_switch']:.0f}x)",
            flush=True,
        )
    payload = {
        "benchmark": "switch_overhead",
        "machine": machine_info(),
        "settings": vars(args),
        "rows": rows,
        "targets": {"sync_over_memcpy_max": 3.0, "naive_over_switch_min": 20.0},
    }
    path = write_json("switch_overhead", payload)
    plot(rows, RESULTS / "switch_overhead.png")
    print(f"wrote {path} and {RESULTS / 'switch_overhead.png'}")


if __name__ == "__main__":
    main()
