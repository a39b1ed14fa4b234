"""Benchmark: the default GRPO step with and without the preloaded allocator and OpenMP runtime.

    python -m benchmarks.preload [--steps 12] [--repeats 2] [--modes none,tcmalloc,auto]

vLLM's CPU backend asks for tcmalloc and Intel's OpenMP runtime in ``LD_PRELOAD``; the launcher
sets them for the ranks (``trainer.preload``: ``auto`` = both, ``none`` = glibc malloc and torch's
own GNU OpenMP). Each mode runs the default recipe (``+recipe=grpo_math``: the tiny model's SFT
warm start, 2 ranks, 32 prompts x G=8) for ``--steps`` steps without validation, ``--repeats``
times, the modes interleaved so drift on a shared machine hits them alike. Reported per mode:
the median step, generate and update time over steps 3..N of every repeat, and the peak RSS per
rank (max over ranks and steps). Writes results/preload.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.common import figure, machine_info, run_trainer, save_figure, write_json
from hybrid_rl.timing import memory_key, phase_key

TIMES = ("step", "generate", "update", "switch_to_rollout")


def run_once(mode: str, steps: int, extra: list[str]) -> list[dict]:
    p, rows, _ = run_trainer(
        [
            "+recipe=grpo_math", f"trainer.preload={mode}", f"trainer.total_steps={steps}", "trainer.val_every=0",
            "trainer.val_before_train=false", "trainer.export_hf=false", "trainer.save_every_minutes=0",
            "logger.progress_bar=false", *extra,
        ],
        prefix=f"preload_{mode}_",
    )
    if p.returncode:
        raise SystemExit(f"preload={mode} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default="none,tcmalloc,auto")
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides")
    args = ap.parse_args()
    modes = args.modes.split(",")
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:
            runs[m].append(run_once(m, args.steps, args.extra))
    summary = {}
    for m, reps in runs.items():
        rows = [r for rep in reps for r in rep if r["step"] >= 3]
        summary[m] = {
            # a step whose groups were all filtered out (DAPO's filter) has no update
            **{f"median_{t}_s": statistics.median([r[phase_key(t)] for r in rows if phase_key(t) in r] or [0.0]) for t in TIMES},
            "peak_rss_mib": max(r.get(memory_key("step", "peak_rss_mib"), 0.0) for rep in reps for r in rep),
            "steps_measured": len(rows),
        }
    base = summary.get("none", {}).get("median_step_s")
    for row in summary.values():
        row["step_speedup_vs_none"] = base / row["median_step_s"] if base else None
    write_json("preload", {"machine": machine_info(), "settings": vars(args), "summary": summary})
    fig, ax = figure((7, 4))
    width = 0.8 / len(modes)
    for i, m in enumerate(modes):
        ax.bar([x + i * width for x in range(len(TIMES))], [summary[m][f"median_{t}_s"] for t in TIMES], width, label=f"preload={m}")
    ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(TIMES))], TIMES)
    ax.set_ylabel("median seconds (steps 3..N)")
    ax.set_title("default GRPO step, 2 ranks: LD_PRELOAD of the ranks")
    ax.legend()
    save_figure(fig, "preload")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
