"""Benchmark: the default GRPO step in fp32 and in bf16 (fp32 masters), with MFU.

    python -m benchmarks.precision [--steps 12] [--repeats 2] [--gemm 2048]

Each precision runs the default recipe (``+recipe=grpo_math``: the tiny model's SFT warm start, 2
ranks, 32 prompts x G=8, 64 new tokens) for ``--steps`` steps without validation, ``--repeats``
times, interleaved: ``fp32`` (``actor.param_dtype=null rollout.dtype=float32``) and ``bf16``
(``actor.param_dtype=bfloat16 rollout.dtype=bfloat16``; masters and AdamW state stay fp32).
``auto``, the default, resolves to one of them on this machine (recorded as ``auto_resolves_to``).

MFU: the trainer logs the achieved model FLOP/s of the update and of generation
(``perf/update_tflops_per_s``, ``perf/generate_tflops_per_s``; hybrid_rl/engine/flops.py). The
peak is measured here, in the same run, before and after the trainer runs: a square GEMM of
``--gemm`` on all cores in each dtype (the machine's matrix-unit peak), and the GEMMs of the
model's own shapes (4,096 tokens x hidden -> MLP width), which bound what a model this small can
reach. Reported per precision: median step / generate / update seconds over steps 3..N, the
FLOP/s, and MFU against both peaks. Writes results/precision.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks.common import figure, machine_info, run_trainer, save_figure, write_json
from hybrid_rl.timing import phase_key

TIMES = ("step", "generate", "logprobs", "update", "switch_to_rollout", "switch_to_train")
MODES = {
    "fp32": ["actor.param_dtype=null", "rollout.dtype=float32"],
    "bf16": ["actor.param_dtype=bfloat16", "rollout.dtype=bfloat16"],
}


def gemm_peak(dtype_name: str, m: int, k: int, n: int, seconds: float = 3.0) -> float:
    """FLOP/s of an ``m x k @ k x n`` matmul on all cores, as the cores sustain it once warm.

    The matmul runs back to back for ``seconds``, and the rate is taken at the 25th percentile of
    the call times. A few calls are not enough: on a 2-core AMX Xeon VM (2026-12-06) a bf16
    2048^3 matmul ran at ~0.7 TFLOP/s for its first ~0.5 s of continuous work and at ~2.1 after,
    and fell back to ~0.7 after a 0.2 s pause, so a peak from 2 warm-up calls and 5 timed ones
    came out 3x low (and the MFU against it 3x high)."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    xs: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(xs) < 8:
        t = time.perf_counter()
        a @ b
        xs.append(time.perf_counter() - t)
    xs.sort()
    return 2.0 * m * k * n / xs[len(xs) // 4]


def peaks(square: int, hidden: int, mlp: int) -> dict[str, dict[str, float]]:
    return {
        d: {"square_tflops": gemm_peak(d, square, square, square) / 1e12, "model_shape_tflops": gemm_peak(d, 4096, hidden, mlp) / 1e12}
        for d in ("float32", "bfloat16")
    }


def run_once(mode: str, steps: int, extra: list[str]) -> list[dict]:
    p, rows, _ = run_trainer(
        [
            "+recipe=grpo_math", *MODES[mode], f"trainer.total_steps={steps}", "trainer.val_every=0",
            "trainer.val_before_train=false", "trainer.export_hf=false", "trainer.save_every_minutes=0",
            "logger.progress_bar=false", *extra,
        ],
        prefix=f"precision_{mode}_",
    )  # fmt: skip
    if p.returncode:
        raise SystemExit(f"precision={mode} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return rows


def median_of(rows: list[dict], key: str) -> float:
    xs = [r[key] for r in rows if key in r]
    return statistics.median(xs) if xs else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--gemm", type=int, default=2048, help="square GEMM size for the peak")
    ap.add_argument("--modes", default="fp32,bf16")
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides")
    args = ap.parse_args()
    from hybrid_rl.env import auto_dtype, cpu_bf16_support
    from hybrid_rl.models.tiny import PRESETS

    shape = PRESETS["tiny"]
    modes = args.modes.split(",")
    before = peaks(args.gemm, shape["hidden_size"], shape["intermediate_size"])
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:
            runs[m].append(run_once(m, args.steps, args.extra))
    after = peaks(args.gemm, shape["hidden_size"], shape["intermediate_size"])
    peak = {d: {k: max(before[d][k], after[d][k]) for k in before[d]} for d in before}
    summary = {}
    for m, reps in runs.items():
        rows = [r for rep in reps for r in rep if r["step"] >= 3]
        p = peak["float32" if m == "fp32" else "bfloat16"]
        row = {f"median_{t}_s": median_of(rows, phase_key(t)) for t in TIMES}
        for phase in ("update", "generate"):
            tf = median_of(rows, f"perf/{phase}_tflops_per_s")
            row[f"{phase}_tflops_per_s"] = tf
            row[f"{phase}_mfu_vs_square_peak"] = tf / p["square_tflops"]
            row[f"{phase}_mfu_vs_model_shape_peak"] = tf / p["model_shape_tflops"]
        row["reward_mean"] = median_of(rows, "critic/score/mean")
        row["steps_measured"] = len(rows)
        summary[m] = row
    if "fp32" in summary:
        for row in summary.values():
            row["step_speedup_vs_fp32"] = summary["fp32"]["median_step_s"] / row["median_step_s"]
    payload = {
        "machine": machine_info(), "settings": vars(args), "cpu_bf16": cpu_bf16_support(), "auto_resolves_to": auto_dtype("cpu"),
        "gemm_peak_before": before, "gemm_peak_after": after, "gemm_peak": peak, "summary": summary,
    }  # fmt: skip
    write_json("precision", payload)
    fig, (ax, ax2) = figure((11, 4), ncols=2)
    width = 0.8 / len(modes)
    shown = ("step", "generate", "update", "switch_to_rollout")
    for i, m in enumerate(modes):
        ax.bar([x + i * width for x in range(len(shown))], [summary[m][f"median_{t}_s"] for t in shown], width, label=m)
        ax2.bar(
            [x + i * width for x in range(2)],
            [100 * summary[m][f"{ph}_mfu_vs_square_peak"] for ph in ("update", "generate")],
            width,
            label=m,
        )
    ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(shown))], shown)
    ax.set_ylabel("median seconds (steps 3..N)")
    ax.set_title(f"default GRPO step, 2 ranks (CPU bf16 unit: {cpu_bf16_support()})")
    ax.legend()
    ax2.set_xticks([width * (len(modes) - 1) / 2 + x for x in range(2)], ["update", "generate"])
    ax2.set_ylabel(f"MFU, % of a {args.gemm}^3 GEMM on all cores")
    ax2.set_title("model FLOP/s over the measured GEMM peak")
    ax2.legend()
    save_figure(fig, "precision")
    print(json.dumps({"gemm_peak": peak, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
