"""Runs of every RL algorithm recipe on the default task, same budget, for the README table.

    python -m benchmarks.compare_algorithms [--steps 300] [--seeds 1,2] [--recipes grpo_math,dapo_math,...]

Each recipe starts from the same SFT model (builtin:tiny-sft), trains ``--steps`` steps with its
own settings, once per seed in ``--seeds`` (``trainer.seed`` and ``data.seed``: sampling noise and
prompt order), and is validated on the same held-out prompts (greedy accuracy, 1,024 problems).
Each recipe's row is the mean over seeds with the min..max spread. The SFT model's accuracy,
measured once by the first run before training, is the common starting point. Writes
results/compare_algorithms.json and .png.
"""

from __future__ import annotations

import argparse
import statistics

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


def run(recipe: str, steps: int, before: bool, extra: list[str]) -> dict:
    p, rows, wall = run_trainer(
        [
            f"+recipe={recipe}", f"trainer.total_steps={steps}", f"trainer.val_every={steps}",
            f"trainer.val_before_train={str(before).lower()}", "trainer.save_every=0", "logger.progress_bar=false",
            "rollout.val_pass_k=0", *extra,
        ],
        prefix=f"cmp-{recipe}-",
        timeout=3600,
    )
    if p.returncode != 0:
        return {"recipe": recipe, "error": p.stderr[-2000:]}
    val = {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}
    steps_t = [r["timing/step"] for r in rows if "timing/step" in r]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    return {
        "recipe": recipe,
        "val_before": val.get(0),
        "val_after": val.get(steps),
        "train_reward_first5": sum(rewards[:5]) / max(len(rewards[:5]), 1),
        "train_reward_last5": sum(rewards[-5:]) / max(len(rewards[-5:]), 1),
        "step_s_median": sorted(steps_t)[len(steps_t) // 2] if steps_t else None,
        "wall_s": wall,
    }


def summarise(recipe: str, runs: list[dict]) -> dict:
    """Mean and spread over seeds of one recipe's runs."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"recipe": recipe, "error": runs[0]["error"]}
    after = [r["val_after"] for r in ok]
    mean = statistics.fmean(after)
    return {
        "recipe": recipe,
        "seeds": len(ok),
        "val_after": after,
        "val_after_mean": mean,
        "val_after_min": min(after),
        "val_after_max": max(after),
        "val_after_sd": statistics.stdev(after) if len(after) > 1 else 0.0,
        "train_reward_last5_mean": statistics.fmean(r["train_reward_last5"] for r in ok),
        "step_s_median": statistics.median(r["step_s_median"] for r in ok),
        "wall_s_mean": statistics.fmean(r["wall_s"] for r in ok),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="the recipes' own budget")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--seeds", default="1,2", help="trainer.seed and data.seed of each run (one row per recipe: mean and spread)")
    ap.add_argument("extra", nargs="*", help="Hydra overrides for every run")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, list[dict]] = {}
    first = True
    for recipe in args.recipes.split(","):
        for seed in seeds:
            r = run(recipe, args.steps, before=first, extra=[f"trainer.seed={seed}", f"data.seed={seed}", *args.extra])
            r["seed"] = seed
            first = first and "error" in r
            runs.setdefault(recipe, []).append(r)
            if "error" in r:
                print(f"{recipe:>28} seed {seed}: FAILED\n{r['error']}", flush=True)
            else:
                print(
                    f"{recipe:>28} seed {seed}: val {r['val_before'] if r['val_before'] is not None else '':>6} -> {r['val_after']:.3f}  "
                    f"reward -> {r['train_reward_last5']:.3f}  {r['step_s_median']:.2f} s/step  ({r['wall_s']:.0f} s)",
                    flush=True,
                )
    rows = [summarise(recipe, rs) for recipe, rs in runs.items()]
    sft = next((r["val_before"] for rs in runs.values() for r in rs if r.get("val_before") is not None), None)
    path = write_json(
        "compare_algorithms",
        {
            "benchmark": "compare_algorithms",
            "machine": machine_info(),
            "settings": vars(args),
            "sft_val_accuracy": sft,
            "rows": rows,
            "runs": runs,
        },
    )
    ok = [r for r in rows if "error" not in r]
    if not ok:
        raise SystemExit("every run failed; see the errors above")
    for r in ok:
        print(f"{r['recipe']:>28}: {r['val_after_mean']:.3f} (min {r['val_after_min']:.3f}, max {r['val_after_max']:.3f}, {r['seeds']} seeds)")
    fig, ax = figure((9, 3.8))
    names = [r["recipe"].removesuffix("_math") for r in ok]
    means = [r["val_after_mean"] for r in ok]
    err = [[m - r["val_after_min"] for m, r in zip(means, ok, strict=True)], [r["val_after_max"] - m for m, r in zip(means, ok, strict=True)]]
    ax.bar(names, means, yerr=err, capsize=4, color="C0", label=f"mean over {len(seeds)} seeds (bars: min..max)")
    if sft is not None:
        ax.axhline(sft, color="k", ls="--", lw=1, label=f"SFT start ({sft:.3f})")
    ax.legend(fontsize=8)
    ax.set_ylabel(f"held-out greedy accuracy after {args.steps} steps")
    lo = min([r["val_after_min"] for r in ok] + [sft or 1])
    ax.set_ylim(max(0.0, lo - 0.05), min(1.0, max(r["val_after_max"] for r in ok) + 0.05))
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    print(f"wrote {path} and {save_figure(fig, 'compare_algorithms')}")


if __name__ == "__main__":
    main()
