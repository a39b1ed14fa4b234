"""The long-tailed task's length distribution, in tokens of the tokenizer its recipe uses.

    python -m benchmarks.longtail_lengths [--recipe grpo_longtail]

Composes the recipe, generates its synthetic splits with the recipe's ``data.synth`` settings
(running sums, level 7: one worked line per operand, a heavy-tailed operand count), and tokenizes
every row with the tokenizer of the recipe's builtin model preset: the answer as SFT trains on it
and a rollout ends it (worked solution, boxed answer, end-of-turn token) and the prompt as the
chat template renders it. Reported per split: median, mean, p90, p99, max and p99/median of the
answer, the prompt's median/p99/max, the operand counts, and the longest answer and prompt the
generator can make at all (64 nines), against the recipe's ``rollout.max_response_length`` and
``data.max_prompt_length``. The default task (``grpo_math``'s levels 1 and 6) is measured alongside
for contrast. Writes results/longtail_lengths.json and .png (histogram and CDF).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import numpy as np

from benchmarks.common import figure, machine_info, save_figure, write_json

# CPU flags worth naming on a figure's label (the measurement itself is tokenizer counting).
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def lscpu() -> dict:
    """CPU model and the notable flags, from lscpu (empty where it is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    return {"cpu_model": fields.get("Model name", "").strip(), "cpu_flags": [f for f in FLAGS if f in flags]}


def stats(xs: list[int]) -> dict:
    a = np.asarray(xs)
    med = float(np.median(a))
    out = {"n": len(xs), "median": med, "mean": float(a.mean()), "p90": float(np.percentile(a, 90))}
    out.update(p99=float(np.percentile(a, 99)), max=int(a.max()), min=int(a.min()))
    out["p99_over_median"] = out["p99"] / med
    return out


def lengths(rows: list[dict], tok) -> dict:
    """Answer and prompt token counts of ``rows``, and running sums' operand counts (lines + 1)."""
    from hybrid_rl.data.dataset import encode_prompts
    from hybrid_rl.data.synth_math import RUNNING_SUM_LEVEL

    eos = tok.eos_token or ""
    answers = [len(x) for x in tok([r["extra_info"]["solution"] + eos for r in rows], add_special_tokens=False)["input_ids"]]
    prompts = [len(x) for x in encode_prompts(tok, [r["prompt"] for r in rows])]
    out = {"answer": answers, "prompt": prompts}
    if all(r["extra_info"]["level"] == RUNNING_SUM_LEVEL for r in rows):
        out["operands"] = [len(r["extra_info"]["facts"]) + 1 for r in rows]
    return out


def worst_case(tok) -> dict:
    """The longest answer and prompt level 7 can produce: MAX_OPERANDS nines, the longest name and item."""
    from hybrid_rl.data.dataset import encode_prompts
    from hybrid_rl.data.longtail import MAX_OPERANDS
    from hybrid_rl.data.synth_math import INSTRUCTION, ITEMS, NAMES, RUNNING_SUM_LEVEL, Problem, format_solution

    steps = [f"{9 * i} + 9 = {9 * (i + 1)}" for i in range(1, MAX_OPERANDS)]
    name, item = max(NAMES, key=len), max(ITEMS, key=len)
    counts = ", ".join(["9"] * (MAX_OPERANDS - 1)) + " and 9"
    q = f"{name} has {MAX_OPERANDS} boxes with {counts} {item} in them. How many {item} does {name} have?"
    p = Problem(q, 9 * MAX_OPERANDS, ". ".join(steps) + ".", RUNNING_SUM_LEVEL)
    answer = len(tok(format_solution(p) + (tok.eos_token or ""), add_special_tokens=False)["input_ids"])
    prompt = len(encode_prompts(tok, [[{"role": "user", "content": f"{q} {INSTRUCTION}"}]])[0])
    return {"answer_tokens": answer, "prompt_tokens": prompt, "operands": MAX_OPERANDS}


def compose(recipe: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from hybrid_rl.config import register_configs
    from hybrid_rl.config.compose import conf_dir

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=[f"+recipe={recipe}"])


def measure(recipe: str) -> dict:
    from transformers import AutoTokenizer

    from hybrid_rl.data.synth_math import make_splits
    from hybrid_rl.models.tiny import tiny_model_path

    cfg = compose(recipe)
    s = cfg.data.synth
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path(cfg.model.preset)))
    splits = make_splits(s.n_train, s.n_val, s.n_val_seen, s.seed, list(s.levels), s.direct_share, s.heldout_fraction)
    default = make_splits(s.n_train, 0, 0, s.seed, [1, 6], 0.0, s.heldout_fraction)["train"]
    raw = {name: lengths(rows, tok) for name, rows in splits.items()}
    raw["default_task_train"] = lengths(default, tok)
    return {
        "recipe": recipe,
        "preset": cfg.model.preset,
        "levels": list(s.levels),
        "budget": {"max_response_length": cfg.rollout.max_response_length, "max_prompt_length": cfg.data.max_prompt_length},
        "worst_case": worst_case(tok),
        "splits": {name: {k: stats(v) for k, v in r.items()} for name, r in raw.items()},
        "raw": raw,
    }


def label(machine: dict) -> str:
    cpu = machine.get("cpu_model") or machine.get("processor") or "CPU"
    flags = ", ".join(machine.get("cpu_flags") or []) or "no avx2/avx512"
    return f"{machine['time'][:10]}  commit {machine['commit']}  {cpu} ({flags}), {machine['cpu_count']} cores"


def plot(result: dict, machine: dict) -> None:
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (hist, cdf) = figure((11, 4.2), ncols=2)
    train = result["raw"]["train"]["answer"]
    st = result["splits"]["train"]["answer"]
    hist.hist(train, bins=np.arange(0, max(train) + 16, 16), color="C0")
    hist.set_yscale("log")
    for key, ls in (("median", "-"), ("p90", "--"), ("p99", ":")):
        hist.axvline(st[key], color="k", ls=ls, lw=1, label=f"{key} {st[key]:.0f}")
    hist.axvline(result["budget"]["max_response_length"], color="C3", lw=1.5, label="max_response_length")
    hist.set_xlabel("answer tokens (worked solution + boxed answer + end of turn)")
    hist.set_ylabel(f"training rows (of {st['n']:,}), log scale")
    levels = result["levels"]
    hist.set_title(f"{result['recipe']}: train split (level{'s' * (len(levels) > 1)} {', '.join(map(str, levels))})")
    hist.legend(fontsize=8)
    for name, color in (("train", "C0"), ("val", "C1"), ("val_seen", "C2"), ("default_task_train", "0.5")):
        xs = np.sort(result["raw"][name]["answer"])
        cdf.plot(xs, np.arange(1, len(xs) + 1) / len(xs), color=color, label=name.replace("_", " "))
    cdf.set_xscale("log")
    cdf.xaxis.set_major_formatter(ScalarFormatter())
    cdf.xaxis.set_minor_formatter(NullFormatter())
    cdf.set_xticks([16, 32, 64, 128, 256, 512, 1024])
    cdf.set_xlabel("answer tokens (log scale)")
    cdf.set_ylabel("share of rows at or below")
    cdf.set_title("answer-length CDF (grey: the default task, levels 1, 6)")
    cdf.legend(fontsize=8)
    cdf.grid(alpha=0.3)
    fig.suptitle(label(machine), fontsize=8, color="0.3")
    save_figure(fig, "longtail_lengths")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="grpo_longtail")
    args = ap.parse_args()
    t = time.perf_counter()
    result = measure(args.recipe)
    machine = {**machine_info(), **lscpu(), "cpu_count": os.cpu_count()}
    payload = {k: v for k, v in result.items() if k != "raw"} | {"machine": machine, "seconds": time.perf_counter() - t}
    write_json("longtail_lengths", payload)
    plot(result, machine)
    print(json.dumps({"worst_case": result["worst_case"], "budget": result["budget"], "splits": result["splits"]}, indent=1))


if __name__ == "__main__":
    main()
