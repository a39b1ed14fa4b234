"""Benchmark: LoRA against the full fine-tune on the real trainer: switch time, bytes per switch,
step time and peak memory per rank, on 2 ranks.

    python -m benchmarks.lora [--presets base,large,qwen0.5b] [--modes full,lora] [--rank 16] [--steps 4]

Each (preset, mode) is one run of ``python -m hybrid_rl.main`` (``+recipe=grpo_math`` for the full
fine-tune, ``+recipe=grpo_math_lora`` with ``actor.lora.rank=--rank`` for LoRA) on a random-init
model of the preset's shape, 4 prompts x G=4 x 32 new tokens per step, the length reward (a
random-init model's math score is 0). ``--dtype`` is the update's compute dtype and the vLLM
engine's (fp32 masters and AdamW state either way; with LoRA the frozen base is held in the compute
dtype). From the trainer's metrics, medians over the steps after the first (the first step's
switch warms the engine's adapter slot): ``switch/to_rollout_s`` (the whole switch) and its
``sync_weights`` phase, the bytes handed to vLLM per switch (``moved_mib/sync.tensors``), the step
and update times, the peak RSS per rank (VmHWM per phase, max over phases and ranks) and, sampled
every second by this script, the whole host's used memory. A run that fails (the kernel's OOM
killer, exit 137) is recorded with its exit status.

Writes results/lora.json and results/lora.png (or ``--name``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading

from benchmarks.common import ROOT, figure, machine_info, run_trainer, save_figure, write_json
from benchmarks.real_size_grpo import _host_used_mib
from hybrid_rl.timing import memory_key, phase_key

PHASES = ("generate", "reward", "update", "switch_to_rollout", "switch_to_train")


def overrides(args: argparse.Namespace, preset: str, mode: str) -> list[str]:
    reward = ROOT / "tests" / "e2e" / "length_reward.py"
    compute = "null" if args.dtype == "float32" else args.dtype
    recipe = ["+recipe=grpo_math_lora", f"actor.lora.rank={args.rank}", f"actor.lora.alpha={2 * args.rank}"] if mode == "lora" else ["+recipe=grpo_math"]
    return [
        *recipe, "model.path=builtin:tiny", f"model.preset={preset}", f"trainer.nproc_per_node={args.ranks}",
        f"data.train_batch_size={args.prompts}", f"rollout.n={args.group}", f"rollout.max_response_length={args.new_tokens}",
        f"trainer.total_steps={args.steps}", "trainer.val_every=0", "trainer.val_before_train=false", "trainer.export_hf=false",
        "trainer.save_every_minutes=0", "logger.progress_bar=false", "algorithm.filter_groups.enable=false",
        f"actor.micro_batch_size={args.prompts * args.group}", f"actor.param_dtype={compute}", f"rollout.dtype={args.dtype}",
        f"rollout.kv_cache_gib={args.kv_cache_gib}", f"reward.functions=[{{name: custom, weight: 1.0, path: {reward}, function: score}}]",
        "trainer.run_name=lora_bench", *args.extra,
    ]  # fmt: skip


def median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def measure(args: argparse.Namespace, preset: str, mode: str) -> dict:
    stop, host = threading.Event(), []
    sampler = threading.Thread(target=_host_used_mib, args=(stop, host), daemon=True)
    sampler.start()
    p, rows, wall = run_trainer(overrides(args, preset, mode), prefix=f"lora_{mode}_")
    stop.set()
    sampler.join()
    steps = [r for r in rows if "timing_s/step" in r]
    warm = steps[1:] or steps
    row = {
        "preset": preset, "mode": mode, "rank": args.rank if mode == "lora" else 0, "returncode": p.returncode, "steps_done": len(steps),
        "wall_s": wall, "to_rollout_median_s": median(warm, "switch/to_rollout_s"),
        "sync_median_s": median(warm, "switch/to_rollout/sync_weights_s"),
        "sync_mib": median(warm, "switch/to_rollout/moved_mib/sync.tensors"),
        "step_median_s": median(warm, "timing_s/step"), "update_median_s": median(warm, phase_key("update")),
        "generate_median_s": median(warm, phase_key("generate")),
        "peak_rss_per_rank_mib": max((r.get(memory_key(ph, "peak_rss_mib")) or 0.0 for r in steps for ph in PHASES), default=None),
        "host_used_peak_mib": max(host) if host else None,
    }  # fmt: skip
    if p.returncode:
        row["error"] = f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1][:300] if p.stderr.strip() else ''}"
    return row


def summarise(rows: list[dict]) -> list[dict]:
    """Per preset: how much faster and lighter the LoRA switch is than the full one."""
    out = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        by = {r["mode"]: r for r in rows if r["preset"] == preset and not r.get("error")}
        if "full" in by and "lora" in by:
            f, lo = by["full"], by["lora"]
            out.append({
                "preset": preset,
                "switch_speedup": f["to_rollout_median_s"] / lo["to_rollout_median_s"],
                "sync_speedup": f["sync_median_s"] / lo["sync_median_s"],
                "bytes_ratio": f["sync_mib"] / lo["sync_mib"],
                "step_speedup": f["step_median_s"] / lo["step_median_s"],
                "peak_rss_ratio": f["peak_rss_per_rank_mib"] / lo["peak_rss_per_rank_mib"],
            })  # fmt: skip
    return out


def plot(rows: list[dict], name: str, args: argparse.Namespace) -> None:
    fig, axes = figure((13, 4), ncols=3)
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    for i, mode in enumerate(("full", "lora")):
        sel = {r["preset"]: r for r in rows if r["mode"] == mode}
        xs = [j + (i - 0.5) * 0.38 for j in range(len(presets))]
        label = mode if mode == "full" else f"LoRA r={args.rank}"
        for ax, key in zip(axes, ("to_rollout_median_s", "sync_mib", "peak_rss_per_rank_mib"), strict=True):
            vals = [(sel.get(p) or {}).get(key) or 0.0 for p in presets]
            ax.bar(xs, vals, width=0.38, label=label)
            for x, p, v in zip(xs, presets, vals, strict=True):
                if (sel.get(p) or {}).get("error"):  # e.g. the OOM killer: the figures are of the steps done
                    ax.annotate(f"exit {sel[p]['returncode']}", (x, v), ha="center", va="bottom", fontsize=7, color="red")
    for ax, title in zip(axes, ("switch to rollout (s, median)", "bytes to vLLM per switch (MiB)", "peak RSS per rank (MiB)"), strict=True):
        ax.set_xticks(range(len(presets)), presets)
        ax.set_title(title)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    fig.suptitle(f"GRPO, {args.ranks} ranks, {args.dtype}, {args.prompts}x{args.group}x{args.new_tokens} tokens per step")
    save_figure(fig, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="base,large,qwen0.5b")
    ap.add_argument("--modes", default="full,lora")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides")
    ap.add_argument("--name", default="lora")
    args = ap.parse_args()
    rows = []
    for preset in args.presets.split(","):
        for mode in args.modes.split(","):
            rows.append(measure(args, preset, mode))
            print(json.dumps(rows[-1]), flush=True)
    payload = {"machine": machine_info(), "settings": vars(args), "rows": rows, "summary": summarise(rows)}
    write_json(args.name, payload)
    plot(rows, args.name, args)
    print(json.dumps(payload["summary"]))


if __name__ == "__main__":
    main()
