"""Benchmark: prefix caching for GRPO groups.

    python -m benchmarks.prefix_cache [--groups 1,2,4,8,16,32] [--lengths 64,256,960] [--prompts 4]

For each prompt length L and group size G, N prompts are sampled G times each, with the prefix
cache on and off, and two ways of asking: one request with ``n=G`` (the group shares the prompt's
KV blocks) or G duplicated requests with ``n=1``. vLLM's own counters give the prompt tokens
scheduled and the ones served from the cache, so the prefill tokens actually computed are
measured, not assumed; they are set against the token account of the seed (N*G*L without
sharing, N*L with it). Writes results/prefix_cache.json and results/prefix_cache.png.

Each cache setting runs in its own process (one vLLM engine each, CPU threads = all cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, figure, machine_info, rollout_config, save_figure, write_json

HERE = Path(__file__).resolve().parent


def worker(args) -> None:
    from hybrid_rl.env import setup_process_env

    setup_process_env(threads_per_rank=os.cpu_count() or 1)
    import torch

    from hybrid_rl.models.tiny import tiny_model_path
    from hybrid_rl.rollout.base import SamplingSpec
    from hybrid_rl.rollout.vllm_engine import VLLMRollout

    rc = rollout_config(block_size=args.block_size, enable_prefix_caching=args.caching == "on", kv_cache_gib=args.kv_cache_gib)
    max_len = max(int(x) for x in args.lengths.split(",")) + args.max_tokens
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    engine = VLLMRollout(str(tiny_model_path(args.preset)), rc, args.dtype, seed=0, device=device, max_model_len=max_len)
    rng = random.Random(0)
    vocab = len(engine.tokenizer) - 8

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(8, vocab) for _ in range(length)] for _ in range(n)]

    spec = SamplingSpec(n=1, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=True)
    engine.generate(prompts(2, 32), spec)  # warm-up
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for g in (int(x) for x in args.groups.split(",")):
            for mode in ("n=G", "duplicated"):
                ps = prompts(args.prompts, length)
                engine.reset_prefix_cache()
                c0 = engine.counters()
                if mode == "n=G":
                    engine.generate(ps, SamplingSpec(**{**spec.__dict__, "n": g}))
                else:
                    engine.generate([p for p in ps for _ in range(g)], spec)
                seconds = engine.last_stats.seconds
                c1 = engine.counters()
                d = {k: c1[k] - c0[k] for k in c0}
                row = {
                    "caching": args.caching,
                    "device": device.type,
                    "preset": args.preset,
                    "L": length,
                    "G": g,
                    "N": args.prompts,
                    "mode": mode,
                    "prompt_tokens": d["prompt_tokens"],
                    "cached_tokens": d["prompt_tokens_cached"],
                    "computed_prefill_tokens": d["prompt_tokens"] - d["prompt_tokens_cached"],
                    "generated_tokens": d["generation_tokens"],
                    "seconds": seconds,
                    "seed_account_unshared": args.prompts * g * length,
                    "seed_account_shared": args.prompts * length,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(rows))
    sys.stdout.flush()
    os._exit(0)


def plot(rows: list[dict], path: Path) -> None:
    lengths = sorted({r["L"] for r in rows})
    fig, axes = figure((11, 4.2), ncols=2)
    for length in lengths:
        on = {r["G"]: r for r in rows if r["L"] == length and r["caching"] == "on" and r["mode"] == "n=G"}
        off = {r["G"]: r for r in rows if r["L"] == length and r["caching"] == "off" and r["mode"] == "n=G"}
        gs = sorted(on)
        axes[0].plot(
            gs, [on[g]["computed_prefill_tokens"] / off[g]["computed_prefill_tokens"] for g in gs], "o-", label=f"L={length}"
        )
        axes[1].plot(gs, [off[g]["seconds"] / on[g]["seconds"] for g in gs], "o-", label=f"L={length}")
    gs = sorted({r["G"] for r in rows})
    axes[0].plot(gs, [1 / g for g in gs], "k--", label="seed account 1/G")
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("group size G")
    axes[0].set_ylabel("prefill tokens computed, cache on / off")
    axes[0].legend(fontsize=8)
    axes[1].set_xscale("log", base=2)
    axes[1].set_xlabel("group size G")
    axes[1].set_ylabel("rollout time, cache off / on")
    axes[1].axhline(1, color="k", lw=0.5)
    axes[1].legend(fontsize=8)
    fig.suptitle(
        f"Prefix caching for GRPO groups (n=G per prompt, {rows[0].get('device', 'cpu')}, {rows[0].get('preset', 'tiny')})"
    )
    save_figure(fig, path.stem, grid_axis="both")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", default="1,2,4,8,16,32")
    ap.add_argument("--lengths", default="64,256,960")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=32, help="vLLM CPU attention needs a multiple of 32")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--caching", default="on", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    rows: list[dict] = []
    for caching in ("on", "off"):
        out = Path(tempfile.mkstemp(suffix=".json")[1])
        cmd = [sys.executable, "-m", "benchmarks.prefix_cache", "--worker", "--caching", caching, "--out", str(out)]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("worker", "caching", "out")]
        p = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True, check=False, timeout=1800)
        if p.returncode != 0 or out.stat().st_size == 0:
            raise SystemExit(f"prefix_cache worker (caching={caching}) failed ({p.returncode}):\n{p.stderr[-4000:]}")
        rows += json.loads(out.read_text())
    summary = []
    for r in rows:
        if r["caching"] != "on":
            continue
        off = next(o for o in rows if o["caching"] == "off" and (o["L"], o["G"], o["mode"]) == (r["L"], r["G"], r["mode"]))
        summary.append(
            {
                "L": r["L"],
                "G": r["G"],
                "mode": r["mode"],
                "computed_on_over_off": r["computed_prefill_tokens"] / max(off["computed_prefill_tokens"], 1),
                "target_1.1_over_G": 1.1 / r["G"],
                "time_off_over_on": off["seconds"] / r["seconds"],
            }
        )
    for s in summary:
        print(
            f"L={s['L']:4d} G={s['G']:2d} {s['mode']:>10}: prefill on/off {s['computed_on_over_off']:.3f} "
            f"(target <= {s['target_1.1_over_G']:.3f})  time off/on {s['time_off_over_on']:.2f}x"
        )
    payload = {"benchmark": "prefix_cache", "machine": machine_info(), "settings": vars(args), "rows": rows, "summary": summary}
    path = write_json("prefix_cache", payload)
    plot(rows, RESULTS / "prefix_cache.png")
    print(f"wrote {path} and {RESULTS / 'prefix_cache.png'}")


if __name__ == "__main__":
    main()
