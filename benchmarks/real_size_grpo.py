"""Benchmark: GRPO on a real model size on this host, memory per rank per phase (CPU).

    python -m benchmarks.real_size_grpo [--preset qwen0.5b] [--steps 10] [--dtype bfloat16]

Runs the real trainer (``python -m hybrid_rl.main +recipe=grpo_math``, 2 ranks, each with an
FSDP2 shard and a vLLM engine) on a random-init model in the shape of ``--preset`` (qwen0.5b:
494M parameters, the 151,936-row vocabulary of Qwen2.5) with 4 prompts x G=4 x 32 new tokens
per step, the sizes a first real model is tried at. ``--dtype`` is the compute dtype of the
update (fp32 master weights and AdamW state whatever it is) and the vLLM engine's dtype.
The reward is the length of the decoded answer (a random-init model's math score is 0, and a
reward that never varies would leave the update nothing to do).

Recorded per step, from the trainer's own metrics (``memory/timing_s/<phase>/peak_rss_mib``: the
kernel's VmHWM reset at each phase, max over ranks): the peak resident memory of every phase,
the phase times, and, sampled every second by this script, the whole host's used memory.
Writes results/real_size_grpo_<preset>_<dtype>.json and .png (or ``--name``); the run's exit status is in the
JSON (a rank killed by the kernel's OOM killer fails the run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading

from benchmarks.common import ROOT, figure, machine_info, run_trainer, save_figure, write_json
from hybrid_rl.timing import memory_key, phase_key

PHASES = ("generate", "reward", "update", "switch_to_rollout", "switch_to_train")


def _host_used_mib(stop: threading.Event, samples: list[float]) -> None:
    import psutil

    while not stop.is_set():
        vm = psutil.virtual_memory()
        samples.append((vm.total - vm.available) / 2**20)
        stop.wait(1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen0.5b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides")
    ap.add_argument("--name", default=None, help="results/<name>.json (default real_size_grpo_<preset>_<dtype>)")
    args = ap.parse_args()

    reward = ROOT / "tests" / "e2e" / "length_reward.py"
    overrides = [
        "+recipe=grpo_math", "model.path=builtin:tiny", f"model.preset={args.preset}",
        f"trainer.nproc_per_node={args.ranks}", f"data.train_batch_size={args.prompts}", f"rollout.n={args.group}",
        f"rollout.max_response_length={args.new_tokens}", f"trainer.total_steps={args.steps}", "trainer.val_every=0",
        "trainer.val_before_train=false", "trainer.export_hf=false", "trainer.save_every_minutes=0",
        "logger.progress_bar=false", "algorithm.filter_groups.enable=false", f"actor.micro_batch_size={args.prompts * args.group}",
        f"actor.param_dtype={'null' if args.dtype == 'float32' else args.dtype}", f"rollout.dtype={args.dtype}",
        f"reward.functions=[{{name: custom, weight: 1.0, path: {reward}, function: score}}]",
        "trainer.run_name=real_size_grpo", *args.extra,
    ]  # fmt: skip
    stop, host = threading.Event(), []
    sampler = threading.Thread(target=_host_used_mib, args=(stop, host), daemon=True)
    sampler.start()
    p, rows, wall = run_trainer(overrides, prefix="real_size_grpo_")
    stop.set()
    sampler.join()
    steps = []
    for r in rows:
        steps.append({
            "step": r["step"],
            "step_s": r.get("timing_s/step"),
            "phase_s": {ph: r.get(phase_key(ph)) for ph in PHASES},
            "peak_rss_mib": {ph: r.get(memory_key(ph, "peak_rss_mib")) for ph in PHASES},
            "reward_mean": r.get("critic/score/mean"),
            "grad_norm": r.get("actor/grad_norm"),
        })  # fmt: skip
    peaks = {ph: max((s["peak_rss_mib"][ph] or 0.0) for s in steps) if steps else None for ph in PHASES}
    machine = machine_info()
    payload = {
        "machine": machine,
        "settings": vars(args),
        "overrides": overrides,
        "returncode": p.returncode,
        # the launcher's line, with the LD_PRELOAD it gave the ranks (trainer.preload)
        "launcher": next((ln.split("] - ", 1)[-1] for ln in (p.stdout + p.stderr).splitlines() if "starting " in ln and " ranks" in ln), None),
        "stderr_tail": p.stderr[-3000:] if p.returncode else "",
        "wall_s": wall,
        "steps_done": len(steps),
        "peak_rss_per_rank_mib": peaks,
        "host_used_peak_mib": max(host) if host else None,
        "host_total_mib": machine.get("memory_gib", 0) * 1024,
        "median_step_s": statistics.median(s["step_s"] for s in steps) if steps else None,
        "steps": steps,
    }
    name = args.name or f"real_size_grpo_{args.preset.replace('.', '')}_{args.dtype}"
    write_json(name, payload)

    fig, (ax, ax2) = figure((10, 4), ncols=2)
    for ph in PHASES:
        ax.plot([s["step"] for s in steps], [s["peak_rss_mib"][ph] for s in steps], marker="o", label=ph)
    ax.set_xlabel("step")
    ax.set_ylabel("peak RSS per rank (MiB, max over ranks)")
    ax.set_title(f"{args.preset}, {args.ranks} ranks, {args.dtype} compute, fp32 masters")
    ax.legend(fontsize=7)
    bottom = [0.0] * len(steps)
    for ph in PHASES:
        vals = [s["phase_s"][ph] or 0.0 for s in steps]
        ax2.bar([s["step"] for s in steps], vals, bottom=bottom, label=ph)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_xlabel("step")
    ax2.set_ylabel("seconds")
    ax2.set_title("time per phase")
    ax2.legend(fontsize=7)
    save_figure(fig, name)
    print(json.dumps({k: payload[k] for k in ("returncode", "steps_done", "peak_rss_per_rank_mib", "host_used_peak_mib", "median_step_s", "wall_s")}))
    if p.returncode:
        print(p.stderr[-3000:], file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
