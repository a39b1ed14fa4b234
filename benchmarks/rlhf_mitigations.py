"""Benchmark: RLHF-PPO's reward over-optimisation and the usual mitigations, measured.

    python -m benchmarks.rlhf_mitigations [--steps 30] [--rows baseline,kl,mix,pairs,ensemble_mean,ensemble_min]

Every row is ``+recipe=rlhf_ppo trainer.total_steps=STEPS`` from the same SFT warm start
(``builtin:tiny-sft``) with one change, validated every ``--val-every`` steps with the math
verifier on the same ``--val-size`` held-out problems (the true accuracy the learned reward
stands in for). Rows:

- ``baseline``: the recipe (reward = ``builtin:tiny-rm``: ``rm_math`` on 3,000 prompts' pairs,
  adaptive k1 KL 0.01);
- ``kl``: a 10x stronger, fixed KL coefficient (``algorithm.kl_reward.coef=0.1``);
- ``mix``: the verifier added to the learned reward (weight 1 each);
- ``pairs``: a reward model trained on ``--more-prompts`` prompts' pairs (``rm_math
  preference.n_prompts=N``, steps scaled with the data);
- ``ensemble_mean`` / ``ensemble_min``: ``builtin:tiny-rm`` plus two more ``rm_math`` models
  (``trainer.seed`` 1 and 2: another head init and pair order, the same preference set via
  ``preference.seed=0``), standardised per step and averaged / minimised (Coste et al. 2024).

Reported per row: the verifier accuracy curve, the learned reward of the baseline reward model
(first 5 -> last 5 steps; in ensemble rows its raw score, ``reward/reward_model_0``), the KL to
the reference, and each trained reward model's held-out pairwise accuracy.
Writes results/rlhf_mitigations.json and .png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import figure, machine_info, run_trainer, save_figure, write_json

ROWS = ("baseline", "kl", "mix", "pairs", "ensemble_mean", "ensemble_min")


def train_rm(name: str, overrides: list[str]) -> dict:
    """``+recipe=rm_math`` with ``overrides``: the exported model's folder and its held-out accuracy."""
    p, rows, wall = run_trainer(["+recipe=rm_math", "logger.progress_bar=false", *overrides], prefix=f"rlhf-rm-{name}-", timeout=7200)
    if p.returncode != 0:
        raise SystemExit(f"rm_math {name} failed:\n{p.stderr[-3000:]}")
    out = Path([a for a in p.args if a.startswith("trainer.output_dir=")][-1].split("=", 1)[1])  # run_trainer's folder
    val = [r for r in rows if "val/rm_pairwise_accuracy" in r]
    return {"path": str(out / "hf"), "overrides": overrides, "wall_s": wall,
            "pairwise_accuracy": val[-1]["val/rm_pairwise_accuracy"] if val else None,
            "val_pairs": val[-1]["val/pairs"] if val else None}  # fmt: skip


def mean5(rows: list[dict], key: str, last: bool) -> float | None:
    xs = [r[key] for r in rows if key in r]
    xs = xs[-5:] if last else xs[:5]
    return sum(xs) / len(xs) if xs else None


def rlhf(name: str, overrides: list[str], args: argparse.Namespace) -> dict:
    p, rows, wall = run_trainer(
        [
            "+recipe=rlhf_ppo", f"trainer.total_steps={args.steps}", f"trainer.val_every={args.val_every}",
            f"data.val_size={args.val_size}", "rollout.val_pass_k=0", "trainer.save_every=0", "logger.progress_bar=false",
            *overrides,
        ],
        prefix=f"rlhf-{name}-",
        timeout=7200,
    )  # fmt: skip
    if p.returncode != 0:
        return {"row": name, "overrides": overrides, "error": p.stderr[-3000:]}
    curve = {r["step"]: r["val/accuracy"] for r in rows if "val/accuracy" in r}
    base_rm = "reward/reward_model_0" if any("reward/reward_model_0" in r for r in rows) else "reward/reward_model"
    return {
        "row": name,
        "overrides": overrides,
        "val_curve": curve,
        "val_before": curve.get(0),
        "val_after": curve.get(args.steps),
        "baseline_rm_reward_first5": mean5(rows, base_rm, False),
        "baseline_rm_reward_last5": mean5(rows, base_rm, True),
        "reward_first5": mean5(rows, "critic/score/mean", False),
        "reward_last5": mean5(rows, "critic/score/mean", True),
        "kl_last5": mean5(rows, "actor/reward_kl_penalty", True),
        "disagreement_first5": mean5(rows, "reward/reward_model_disagreement", False),
        "disagreement_last5": mean5(rows, "reward/reward_model_disagreement", True),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--val-every", type=int, default=10)
    ap.add_argument("--val-size", type=int, default=512)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--more-prompts", type=int, default=6000, help="preference.n_prompts of the 'pairs' row (the recipe: 3000)")
    args = ap.parse_args()
    rows = args.rows.split(",")
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; known: {', '.join(ROWS)}")
    rms: dict[str, dict] = {}
    if "pairs" in rows:
        steps = 150 * args.more_prompts // 3000  # the recipe's 150 steps per 3,000 prompts: the same epochs
        rms["pairs"] = train_rm("pairs", [f"preference.n_prompts={args.more_prompts}", f"trainer.total_steps={steps}"])
    if any(r.startswith("ensemble") for r in rows):
        for seed in (1, 2):
            rms[f"seed{seed}"] = train_rm(f"seed{seed}", [f"trainer.seed={seed}", f"data.seed={seed}", "preference.seed=0"])
    members = f"reward.reward_model.ensemble=[{rms['seed1']['path']},{rms['seed2']['path']}]" if "seed1" in rms else None
    overrides = {
        "baseline": [],
        "kl": ["algorithm.kl_reward.ctrl=fixed", "algorithm.kl_reward.coef=0.1"],
        "mix": ["reward.functions=[{name:math,weight:1.0}]"],
        "pairs": [f"reward.reward_model.path={rms['pairs']['path']}"] if "pairs" in rms else [],
        "ensemble_mean": [members, "reward.reward_model.ensemble_reduce=mean"],
        "ensemble_min": [members, "reward.reward_model.ensemble_reduce=min"],
    }
    results = []
    for name in rows:
        r = rlhf(name, overrides[name], args)
        results.append(r)
        if "error" in r:
            print(f"{name:>14}: FAILED\n{r['error']}", flush=True)
        else:
            print(f"{name:>14}: verifier {r['val_before']} -> {r['val_after']:.3f}  curve {r['val_curve']}  "
                  f"RM reward {r['baseline_rm_reward_first5']:.3f} -> {r['baseline_rm_reward_last5']:.3f}  KL {r['kl_last5']:.3f}  "
                  f"({r['wall_s']:.0f} s)", flush=True)  # fmt: skip
    path = write_json("rlhf_mitigations", {"benchmark": "rlhf_mitigations", "machine": machine_info(), "settings": vars(args),
                                           "reward_models": rms, "rows": results})  # fmt: skip
    ok = [r for r in results if "error" not in r]
    if not ok:
        raise SystemExit("every run failed; see the errors above")
    fig, ax = figure((7, 4))
    for r in ok:
        steps = sorted(r["val_curve"])
        ax.plot(steps, [r["val_curve"][s] for s in steps], marker="o", label=r["row"])
    ax.set_xlabel("RLHF-PPO step")
    ax.set_ylabel(f"held-out verifier accuracy ({args.val_size} problems)")
    ax.set_title("Reward over-optimisation and mitigations (rlhf_ppo)")
    ax.legend(fontsize=8)
    print(f"wrote {path} and {save_figure(fig, 'rlhf_mitigations', grid_axis='both')}")


if __name__ == "__main__":
    main()
