"""Runs of every RL algorithm recipe on the default task, same budget, for the README table.

    python -m benchmarks.compare_algorithms [--steps 250] [--seeds 1,2] [--recipes grpo_math,dapo_math,...]

Each recipe starts from the same SFT model (builtin:tiny-sft), trains ``--steps`` steps with its
own settings, once per seed in ``--seeds`` (``trainer.seed`` and ``data.seed``: sampling noise and
prompt order), and is validated on the same held-out prompts: 1,024 problems each with an arithmetic fact no training split states (the figures
below; ``*_seen``: the 256 new questions over training facts, for comparison). Greedy accuracy and
``--pass-k`` samples per problem at the rollout temperature (mean@k: the sampled accuracy, which
RL moves long before the greedy one; pass@k). Each recipe's row is the mean over seeds with the
min..max spread. The SFT model's figures, measured once by the first run before training, are
the common starting point. Writes results/compare_algorithms.json and .png.

``--keep OLD.json`` re-runs only ``--recipes`` and carries every other recipe's runs over from an
earlier result of the same ``--steps``, ``--seeds`` and ``--pass-k`` (for recipes whose config did
not change since); the carried rows name the run they came from (``carried_from``) and are marked
``*`` in the plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.common import figure, machine_info, run_trainer, save_figure, write_json

RECIPES = [
    "grpo_math",
    "drgrpo_math",
    "dapo_math",
    "gspo_math",
    "gfpo_math",
    "rloo_math",
    "reinforce_math",
    "reinforce_pp_math",
    "reinforce_pp_baseline_math",
    "remax_math",
    "ppo_math",
]


HELD, SEEN = "synth_math_heldout", "synth_math_seen"


def held_out(row: dict, key: str) -> float | None:
    """``key`` on the held-out problems alone (the synthetic task's), else over the whole set."""
    return row.get(f"{key}/{HELD}", row.get(key))


def levels(row: dict) -> dict[str, float]:
    """Held-out greedy accuracy per task level, ``{"level6": 0.60, ...}``."""
    prefix = f"val/accuracy/{HELD}_"
    return {k[len(prefix):]: v for k, v in row.items() if k.startswith(prefix)}


def run(recipe: str, steps: int, before: bool, pass_k: int, extra: list[str]) -> dict:
    p, rows, wall = run_trainer(
        [
            f"+recipe={recipe}", f"trainer.total_steps={steps}", f"trainer.val_every={steps}",
            f"trainer.val_before_train={str(before).lower()}", "trainer.save_every=0", "logger.progress_bar=false",
            f"rollout.val_pass_k={pass_k}", *extra,
        ],
        prefix=f"cmp-{recipe}-",
        timeout=3600,
    )
    if p.returncode != 0:
        return {"recipe": recipe, "error": p.stderr[-2000:]}
    val = {r["step"]: r for r in rows if "val/accuracy" in r}
    steps_t = [r["timing_s/step"] for r in rows if "timing_s/step" in r]
    rewards = [r["critic/score/mean"] for r in rows if "critic/score/mean" in r]
    k = min(20, max(len(rewards) // 5, 1))  # the train reward's first and last 20 steps (a fifth of a short run)
    before_row, after_row = val.get(0, {}), val.get(steps, {})
    return {
        "recipe": recipe,
        "val_before": held_out(before_row, "val/accuracy"),
        "val_after": held_out(after_row, "val/accuracy"),
        "val_seen_before": before_row.get(f"val/accuracy/{SEEN}"),
        "val_seen_after": after_row.get(f"val/accuracy/{SEEN}"),
        "meank_before": held_out(before_row, f"val/mean@{pass_k}"),
        "meank_after": held_out(after_row, f"val/mean@{pass_k}"),
        "passk_before": held_out(before_row, f"val/pass@{pass_k}"),
        "passk_after": held_out(after_row, f"val/pass@{pass_k}"),
        # per task level on the held-out problems (level 6: column sums, level 1: unseen facts)
        "levels_before": levels(before_row),
        "levels_after": levels(after_row),
        "gain": held_out(after_row, "val/gain"),
        "gain_se": held_out(after_row, "val/gain_se"),
        "train_reward_first": sum(rewards[:k]) / k,
        "train_reward_last": sum(rewards[-k:]) / k,
        "step_s_median": sorted(steps_t)[len(steps_t) // 2] if steps_t else None,
        "wall_s": wall,
    }


def spread(values: list[float]) -> dict:
    """Mean, min, max and sample standard deviation of one figure over seeds."""
    return {
        "values": values,
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def summarise(recipe: str, runs: list[dict]) -> dict:
    """Mean and spread over seeds of one recipe's runs."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"recipe": recipe, "error": runs[0]["error"]}
    out = {"recipe": recipe, "seeds": len(ok)}
    for key in ("val_after", "val_seen_after", "meank_after", "passk_after", "train_reward_last"):
        values = [r[key] for r in ok if r.get(key) is not None]
        if values:
            out[key] = spread(values)
    out["step_s_median"] = statistics.median(r["step_s_median"] for r in ok)
    out["wall_s_mean"] = statistics.fmean(r["wall_s"] for r in ok)
    if "carried_from" in ok[0]:
        out["carried_from"] = ok[0]["carried_from"]
    return out


def fmt(row: dict, key: str) -> str:
    s = row.get(key)
    return f"{s['mean']:.3f} ({s['min']:.3f}..{s['max']:.3f})" if s else "-"


def carried_runs(path: str, args: argparse.Namespace) -> tuple[dict[str, list[dict]], dict]:
    """The runs of ``path`` (an earlier compare_algorithms.json) for recipes not in ``--recipes``,
    each marked with where it came from; refuses a result measured with other settings."""
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--keep {path}: not a readable compare_algorithms.json ({type(e).__name__}: {e})") from e
    missing = [k for k in ("settings", "machine", "runs") if not isinstance(old, dict) or k not in old]
    if missing:
        raise SystemExit(f"--keep {path}: not a readable compare_algorithms.json (no {', '.join(missing)})")
    for key in ("steps", "seeds", "pass_k"):
        if str(old["settings"].get(key)) != str(getattr(args, key)):
            raise SystemExit(f"--keep {path}: settings.{key} is {old['settings'].get(key)!r}, this run's is {getattr(args, key)!r}")
    source = {"file": path, "time": old["machine"].get("time"), "machine": old["machine"]}
    fresh = set(args.recipes.split(","))
    # A run carried over twice keeps the time of the run that measured it.
    return {r: [dict(x, carried_from=x.get("carried_from", source["time"])) for x in rs] for r, rs in old["runs"].items() if r not in fresh}, source


def plot(ok: list[dict], sft: dict, n_seeds: int, steps: int, k: int):
    """Bars of held-out greedy (and mean@k) per recipe, the SFT start as a line; carried rows starred."""
    panels = [("val_after", "greedy", "held-out greedy accuracy")]
    if k and all("meank_after" in r for r in ok):
        panels.append(("meank_after", f"mean@{k}", f"held-out mean@{k} (sampled)"))
    fig, axes = figure((5.5 * len(panels), 3.8), ncols=len(panels))
    axes = list(axes) if len(panels) > 1 else [axes]
    names = [r["recipe"].removesuffix("_math") + ("*" if "carried_from" in r else "") for r in ok]
    carried_times = sorted({r["carried_from"] for r in ok if "carried_from" in r})
    for ax, (key, start_key, label) in zip(axes, panels, strict=True):
        means = [r[key]["mean"] for r in ok]
        err = [[m - r[key]["min"] for m, r in zip(means, ok, strict=True)], [r[key]["max"] - m for m, r in zip(means, ok, strict=True)]]
        ax.bar(names, means, yerr=err, capsize=4, color="C0", label=f"mean over {n_seeds} seeds (bars: min..max)")
        if sft[start_key] is not None:
            ax.axhline(sft[start_key], color="k", ls="--", lw=1, label=f"SFT start ({sft[start_key]:.3f})")
        ax.legend(fontsize=8)
        ax.set_ylabel(f"{label} after {steps} steps", fontsize=9)
        if carried_times:
            ax.set_xlabel(f"* carried over from the run(s) of {', '.join(carried_times)}", fontsize=8)
        lo = min([r[key]["min"] for r in ok] + [sft[start_key] if sft[start_key] is not None else 1])
        ax.set_ylim(max(0.0, lo - 0.05), min(1.0, max(r[key]["max"] for r in ok) + 0.05))
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=250, help="the recipes' own budget")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--seeds", default="1,2", help="trainer.seed and data.seed of each run (one row per recipe: mean and spread)")
    ap.add_argument("--pass-k", type=int, default=4, help="samples per held-out problem for mean@k and pass@k (0: greedy only)")
    ap.add_argument("--keep", default=None, help="an earlier compare_algorithms.json: carry over the recipes not in --recipes")
    ap.add_argument("extra", nargs="*", help="Hydra overrides for every run")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    k = args.pass_k
    kept, carried_from = carried_runs(args.keep, args) if args.keep else ({}, None)
    runs: dict[str, list[dict]] = {}
    first = True
    for recipe in args.recipes.split(","):
        for seed in seeds:
            r = run(recipe, args.steps, first, k, [f"trainer.seed={seed}", f"data.seed={seed}", *args.extra])
            r["seed"] = seed
            first = first and "error" in r
            runs.setdefault(recipe, []).append(r)
            if "error" in r:
                print(f"{recipe:>28} seed {seed}: FAILED\n{r['error']}", flush=True)
                continue
            meank = f"  mean@{k} -> {r['meank_after']:.3f}" if r.get("meank_after") is not None else ""
            print(
                f"{recipe:>28} seed {seed}: greedy {r['val_before'] if r['val_before'] is not None else '':>6} -> {r['val_after']:.3f}"
                f"{meank}  train reward {r['train_reward_first']:.3f} -> {r['train_reward_last']:.3f}  "
                f"{r['step_s_median']:.2f} s/step  ({r['wall_s']:.0f} s)",
                flush=True,
            )
    start = next((r for rs in runs.values() for r in rs if r.get("val_before") is not None), {})
    order = {r: i for i, r in enumerate(RECIPES)}
    runs = dict(sorted({**runs, **kept}.items(), key=lambda kv: order.get(kv[0], len(order))))
    rows = [summarise(recipe, rs) for recipe, rs in runs.items()]
    sft = {"greedy": start.get("val_before"), f"mean@{k}": start.get("meank_before"), f"pass@{k}": start.get("passk_before")}
    path = write_json(
        "compare_algorithms",
        {
            "benchmark": "compare_algorithms",
            "machine": machine_info(),
            "settings": vars(args),
            "sft_val_accuracy": sft["greedy"],
            "sft": sft,
            "carried_from": carried_from,
            "rows": rows,
            "runs": runs,
        },
    )
    ok = [r for r in rows if "error" not in r]
    if not ok:
        raise SystemExit("every run failed; see the errors above")
    for r in ok:
        print(
            f"{r['recipe']:>28}: greedy {fmt(r, 'val_after')}  mean@{k} {fmt(r, 'meank_after')}  "
            f"train reward {fmt(r, 'train_reward_last')}  ({r['seeds']} seeds: mean (min..max))"
        )
    fig = plot(ok, sft, len(seeds), args.steps, k)
    print(f"wrote {path} and {save_figure(fig, 'compare_algorithms')}")


if __name__ == "__main__":
    main()
