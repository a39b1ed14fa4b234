"""Benchmark: the same GRPO step with hybrid_rl and with TRL's GRPOTrainer, on CPU, per phase.

    python -m benchmarks.vs_trl [--preset tiny] [--prompts 8] [--group 8] [--max-tokens 64] [--steps 5]
                                [--trl-precision fp32,bf16] [--ranks 2]

Same model (the project's tiny model, random init, so both sides generate to the length cap
nearly always: the same work), same prompts (the synthetic math task through the chat template),
same G, same completion cap, one optimizer step per generation (no PPO epochs, no KL term, no
reference model), same learning rate, same rule-based reward. The median step time over steps
2..N is compared (step 1 carries start-up and warm-up on both sides), and each phase: generate,
log-probs (old/reference passes; both skip them in this on-policy setting), reward, update, switch.

Each side at its best settings: hybrid_rl with its defaults (``precision auto``: bf16 compute with
fp32 masters and a bf16 vLLM engine on CPUs with avx512_bf16/amx_bf16; the shared-prefix forward);
TRL once per ``--trl-precision`` (``bf16=True`` is TRL/accelerate's CPU autocast) and the faster
one is the reference (both are recorded).

  hybrid_rl: ``python -m hybrid_rl.main +recipe=grpo_math`` with the matching overrides, on 1 rank
             (one process, like TRL here) and on 2 ranks (the recipe's default on 2 cores);
  TRL:       GRPOTrainer in one process, ``use_cpu=True``, generation with transformers
             (TRL's vLLM modes need CUDA).

TRL is an optional benchmark dependency: it is installed (pinned, no deps) into
``benchmarks/.deps`` on first use and put on the path of the TRL process only, so the project's
environment is untouched. Writes results/vs_trl.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import figure, machine_info, save_figure, write_json
from hybrid_rl.timing import phase_key

HERE = Path(__file__).resolve().parent
DEPS = HERE / ".deps"
# What TRL adds on top of the project's environment (pip --dry-run against it), pinned.
TRL_PINS = ["trl==1.16.0", "accelerate==1.15.0", "datasets==5.2.0", "multiprocess==0.70.19", "pandas==3.1.1", "xxhash==4.1.0"]


def ensure_trl() -> None:
    if (DEPS / "trl").is_dir():
        return
    print(f"[vs_trl] installing {', '.join(TRL_PINS)} into {DEPS}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(DEPS), *TRL_PINS], check=True)


def prompts(n: int, seed: int = 0) -> list[dict]:
    import random

    from hybrid_rl.data import synth_math

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = synth_math.make_problem(rng, rng.choice([1, 2, 3]))
        out.append({"prompt": [{"role": "user", "content": f"{p.question} {synth_math.INSTRUCTION}"}], "answer": str(p.answer)})
    return out


def trl_worker(args) -> None:
    from hybrid_rl.env import setup_process_env

    setup_process_env(threads_per_rank=os.cpu_count() or 1)
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hybrid_rl.models.tiny import tiny_model_path
    from hybrid_rl.rewards.functions import math_reward

    path = str(tiny_model_path(args.preset))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    data = Dataset.from_list(prompts(args.prompts * (args.steps + 1)))

    def reward(completions, answer, **_):
        return [
            math_reward("synth_math", c[0]["content"] if isinstance(c, list) else c, a)
            for c, a in zip(completions, answer, strict=True)
        ]

    marks: list[float] = []
    phases: dict[str, list[float]] = {"generate": [], "score": []}

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            phases[name].append(time.perf_counter() - t)
            return out

        return wrapper

    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-"),
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        beta=0.0,
        num_iterations=1,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=args.trl_bf16,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=model, processing_class=tok, reward_funcs=reward, args=cfg, train_dataset=data, callbacks=[Clock()]
    )
    # generate = TRL's _generate (transformers generate); score = the rest of
    # _generate_and_score_completions (rewards, advantages, old log-probs if any); update = the rest.
    trainer._generate = timed("generate", trainer._generate)
    trainer._generate_and_score_completions = timed("score", trainer._generate_and_score_completions)
    start = time.perf_counter()
    trainer.train()
    steps = [b - a for a, b in zip([start, *marks[:-1]], marks, strict=True)]
    gen, score = phases["generate"], phases["score"]
    per_phase = {
        "generate": gen,
        "reward_and_logprobs": [s - g for s, g in zip(score, gen, strict=True)],
        "update": [st - s for st, s in zip(steps, score, strict=True)],
    }
    Path(args.out).write_text(json.dumps({"step_seconds": steps, "phases": per_phase}))
    sys.stdout.flush()
    os._exit(0)


HYBRID_PHASES = {"generate": ("generate",), "reward_and_logprobs": ("reward", "logprobs", "advantage"),
                 "update": ("update",), "switch": ("switch_to_train", "switch_to_rollout")}  # fmt: skip


def run_hybrid(args, ranks: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"hybrid-{ranks}-"))
    cmd = [
        sys.executable, "-m", "hybrid_rl.main", "+recipe=grpo_math",
        "model.path=builtin:tiny", f"model.preset={args.preset}", f"trainer.nproc_per_node={ranks}", f"trainer.output_dir={out}",
        f"trainer.total_steps={args.steps}", "trainer.val_every=0", "trainer.val_before_train=false",
        "trainer.save_every=0", "logger.progress_bar=false",
        f"data.train_batch_size={args.prompts}", f"rollout.n={args.group}", f"rollout.max_response_length={args.max_tokens}",
        "rollout.val_pass_k=0", "algorithm.filter_groups.enable=false", f"actor.lr={args.lr}",
        f"actor.micro_batch_size={args.prompts * args.group}",
    ]  # fmt: skip
    p = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True, check=False, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"hybrid_rl ({ranks} ranks) failed:\n{p.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/step" in r]
    phases = {k: [sum(r.get(phase_key(n), 0.0) for n in names) for r in rows] for k, names in HYBRID_PHASES.items()}
    return {"step_seconds": [r["timing_s/step"] for r in rows], "phases": phases}


def run_trl(args, bf16: bool) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DEPS), str(HERE.parent)])}
    cmd = [sys.executable, "-m", "benchmarks.vs_trl", "--worker", "--out", str(out), *(["--trl-bf16"] if bf16 else [])]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("worker", "out", "trl_bf16")]
    p = subprocess.run(cmd, cwd=HERE.parent, env=env, capture_output=True, text=True, check=False, timeout=3600)
    if p.returncode != 0 or out.stat().st_size == 0:
        raise SystemExit(f"TRL worker failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--trl-precision", default="fp32,bf16", help="TRL runs (the faster is the reference)")
    ap.add_argument("--ranks", default="2", help="hybrid_rl runs, by rank count")
    ap.add_argument("--name", default="", help="results/<name>.json (default vs_trl_<preset>_<max-tokens>)")
    ap.add_argument("--trl-bf16", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        trl_worker(args)
        return
    ensure_trl()
    results = {f"trl_{p}": run_trl(args, p == "bf16") for p in args.trl_precision.split(",")}
    results |= {f"hybrid_rl_{n}rank{'s' if int(n) > 1 else ''}": run_hybrid(args, int(n)) for n in args.ranks.split(",")}
    med = {k: statistics.median(v["step_seconds"][1:]) for k, v in results.items()}
    phase_med = {k: {ph: statistics.median(xs[1:]) for ph, xs in v["phases"].items()} for k, v in results.items()}
    trl_best = min((k for k in med if k.startswith("trl_")), key=med.get)
    ratios = {k: med[trl_best] / v for k, v in med.items() if not k.startswith("trl_")}
    for k, v in med.items():
        extra = f"  ({ratios[k]:.2f}x faster than {trl_best})" if k in ratios else ""
        print(f"{k:>17}: {v:.2f} s/step {phase_med[k]}{extra}", flush=True)
    payload = {
        "benchmark": "vs_trl",
        "machine": machine_info(),
        "settings": vars(args),
        "trl_pins": TRL_PINS,
        "runs": results,
        "median_step_s": med,
        "median_phase_s": phase_med,
        "trl_reference": trl_best,
        "trl_over_hybrid": ratios,
        "target_min": 3.0,
    }
    name = args.name or f"vs_trl_{args.preset}_{args.max_tokens}"
    path = write_json(name, payload)
    fig, ax = figure((6.5, 3.8))
    names = list(med)
    bottom = [0.0] * len(names)
    for i, ph in enumerate(("generate", "reward_and_logprobs", "update", "switch")):
        vals = [phase_med[k].get(ph, 0.0) for k in names]
        ax.bar(names, vals, bottom=bottom, label=ph, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, k in enumerate(names):
        ax.text(i, max(med[k], bottom[i]), f"{med[k]:.1f} s" + (f"\n{ratios[k]:.2f}x" if k in ratios else ""),
                ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_ylabel("seconds per GRPO step (median of steps 2-N)")
    ax.set_title(f"Same GRPO step: {args.prompts} prompts x G={args.group} x {args.max_tokens} tokens ({args.preset}, CPU)", fontsize=9)
    ax.legend(fontsize=7)
    ax.margins(y=0.2)
    print(f"wrote {path} and {save_figure(fig, name)}")


if __name__ == "__main__":
    main()
