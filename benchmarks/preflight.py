"""How long a bad config takes to be refused: each row of the README's fault table, run as a user
would (``python -m hybrid_rl.main ...``), wall time from the command to exit 2.

    python -m benchmarks.preflight [--repeats 3]

Writes results/preflight.json (machine, per-row median/min/max seconds, the one line printed) and
preflight.png. Target: every row under 5 s on an idle 2-core machine. Before the launcher-side
validation the same rows took 17-120 s (they were refused after ranks, a warm start or engines).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import ROOT, figure, machine_info, save_figure, write_json

ROWS = {
    "adv_estimator=foo": ["+recipe=grpo_math", "algorithm.adv_estimator=foo"],
    "temperature=0": ["+recipe=grpo_math", "rollout.temperature=0"],
    "model.path missing": ["+recipe=grpo_math", "model.path=/models/nope"],
    "custom reward file missing": ["+recipe=grpo_math", "reward.functions=[{name: custom, path: /nope/r.py, function: score}]"],
    "grpo_math_gpu without model.path": ["+recipe=grpo_math_gpu"],
    "sft: batch over ranks": ["+recipe=sft_math", "trainer.nproc_per_node=2", "data.train_batch_size=3"],
    "dpo: beta=0": ["+recipe=dpo_math", "preference.beta=0"],
    "rm: listwise of 1": ["+recipe=rm_math", "preference.rm_loss=listwise", "preference.list_size=1"],
    "enum value": ["+recipe=grpo_math", "data.truncation=chop"],
    "moved key": ["+recipe=grpo_math", "algorithm.use_kl_loss=true"],
    "+key the schema lacks": ["+recipe=grpo_math", "+actor.lrr=3"],
    "warm-start config": ["+recipe=grpo_math", "trainer.nproc_per_node=3", "data.train_batch_size=3", "actor.mini_batch_size=24"],
}
TARGET_S = 5.0


def time_row(overrides: list[str], repeats: int) -> dict:
    runs, line, code = [], "", None
    for _ in range(repeats):
        out = tempfile.mkdtemp(prefix="preflight_")
        t = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-m", "hybrid_rl.main", *overrides, f"trainer.output_dir={out}"],
            cwd=ROOT, capture_output=True, text=True, check=False, timeout=300,
        )  # fmt: skip
        runs.append(time.perf_counter() - t)
        code, line = p.returncode, (p.stdout + p.stderr).strip().splitlines()[-1][:300]
    return {"median_s": statistics.median(runs), "min_s": min(runs), "max_s": max(runs), "exit": code, "line": line}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = {}
    for name, overrides in ROWS.items():
        rows[name] = {"overrides": overrides, **time_row(overrides, args.repeats)}
        print(f"{name:34s} {rows[name]['median_s']:5.2f} s  exit {rows[name]['exit']}  {rows[name]['line'][:90]}")
    worst = max(r["max_s"] for r in rows.values())
    payload = {
        "machine": machine_info(),
        "repeats": args.repeats,
        "target_s": TARGET_S,
        "worst_s": worst,
        "met": worst < TARGET_S and all(r["exit"] == 2 for r in rows.values()),
        "rows": rows,
    }
    write_json("preflight", payload)
    fig, ax = figure((8, 4))
    names = list(rows)
    ax.barh(names, [rows[n]["median_s"] for n in names], color="tab:blue")
    ax.axvline(TARGET_S, color="tab:red", linestyle="--", label=f"target {TARGET_S:.0f} s")
    ax.set_xlabel("seconds from the command to exit 2 (median)")
    ax.set_title(f"A bad config is refused before anything starts ({payload['machine']['cpu_count']} cores)")
    ax.legend()
    save_figure(fig, "preflight", grid_axis="x")


if __name__ == "__main__":
    main()
