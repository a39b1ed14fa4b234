"""Benchmark: host memory per rank of the training side as the world grows (CPU, gloo ranks).

    python -m benchmarks.memory_scaling [--preset large] [--worlds 1,2,4] [--micro 2]

Each world size runs real torchrun ranks that build the actor with sharded init (meta device,
rows read from safetensors), take ``--steps`` AdamW steps on a fixed batch in ``--micro``
micro-batches and read their resident memory at each phase (``VmRSS``; the peak is ``VmHWM``).
The training state is ``16 P`` bytes (fp32 weights 4P, gradients 4P, AdamW moments 8P), so the
model is (with fused AdamW, whose step needs no shard-sized temporaries; torch's default foreach
step adds ~6 P / N at the peak, shown as a trade-off row)

    peak_rss_per_rank(N) = 16 P / N + C,

where C is what every rank holds whatever N is: the process itself (Python, torch, transformers;
measured as the RSS before the model is built), the activations of one micro-batch and the
gathered parameters of the layers in flight (one layer's full weights, plus prefetch). C is
measured as the mean of (peak - 16 P / N) over the world sizes; the target is every world size
within 1.2x of the model. Trade-off rows at 2 ranks, one change each: unsharded gradient
accumulation (``actor.grad_accumulation``: the full 4P gradient on every rank), the old full-load
init (``model.sharded_init=false``) and foreach AdamW (``actor.optimizer_impl``).
Writes results/memory_scaling.json and .png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import figure, machine_info, save_figure, write_json

HERE = Path(__file__).resolve().parent


def _status() -> dict[str, float]:
    """VmRSS and VmHWM (peak) of this process, MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":")
            out[key] = int(value.split()[0]) / 1024
    return out


def worker(args: argparse.Namespace) -> None:
    from hybrid_rl.env import setup_process_env

    setup_process_env(threads_per_rank=1)
    import torch

    from benchmarks.common import actor_config
    from hybrid_rl.algorithms.losses import agg_weights, make_sft_loss
    from hybrid_rl.batch import Sample, collate
    from hybrid_rl.config import ModelConfig
    from hybrid_rl.dist import all_gather_objects, barrier, finish_rank, init_distributed
    from hybrid_rl.engine.builders import build_policy_engine
    from hybrid_rl.hybrid.switch import trim_host_heap
    from hybrid_rl.models.tiny import tiny_model_path

    ctx = init_distributed("cpu")
    if ctx.rank == 0:
        tiny_model_path(args.preset)
    barrier()
    path = str(tiny_model_path(args.preset))
    phases: dict[str, dict[str, float]] = {"start": _status()}
    ac = actor_config(
        micro_batch_size=args.rows // args.micro // ctx.world_size or 1, grad_accumulation=args.accumulation, optimizer_impl=args.optimizer
    )
    t = time.perf_counter()
    actor = build_policy_engine(path, ModelConfig(attn_implementation="sdpa", sharded_init=args.sharded_init), ac, ctx, 10)
    init_s = time.perf_counter() - t
    trim_host_heap()
    phases["after_init"] = _status()
    g = torch.Generator().manual_seed(0)
    per = args.rows // ctx.world_size
    samples = []
    for i in range(per):
        ids = torch.randint(5, 400, (args.prompt + args.response,), generator=g).tolist()
        samples.append(Sample(ids[: args.prompt], ids[args.prompt :], [0.0] * args.response, [1] * args.response, "stop", i))
    batch = collate(samples, 0)
    batch.loss_weights = agg_weights(batch.response_mask, "token-mean", float(batch.response_mask.sum()) * ctx.world_size, float(args.rows))
    step_s = []
    for _ in range(args.steps):
        barrier()
        t = time.perf_counter()
        m = actor.train_batch(batch, make_sft_loss())
        step_s.append(time.perf_counter() - t)
        phases[f"after_step_{len(step_s)}"] = _status()
    params = sum(p.numel() for p in actor.module.parameters())
    local = {
        "params_local": sum(p.to_local().numel() for p in actor.module.parameters()),
        "phases": phases,
        "peak_mib": _status()["VmHWM"],
        "init_s": init_s,
        "step_s": step_s,
        "micro_batches": m["actor/micro_batches"],
    }
    ranks = all_gather_objects(local)
    if ctx.rank == 0:
        out = {"preset": args.preset, "params": params, "world": ctx.world_size, "accumulation": args.accumulation,
               "sharded_init": args.sharded_init, "optimizer": args.optimizer, "ranks": ranks}  # fmt: skip
        Path(args.out).write_text(json.dumps(out))
    barrier()
    finish_rank(0)


def run_world(
    preset: str, world: int, args: argparse.Namespace, accumulation: str = "sharded", sharded_init: bool = True, optimizer: str = "fused"
) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += ["-m", "benchmarks.memory_scaling", "--worker", "--preset", preset, "--out", str(out)]
    cmd += ["--rows", str(args.rows), "--micro", str(args.micro), "--prompt", str(args.prompt), "--response", str(args.response)]
    cmd += ["--steps", str(args.steps), "--accumulation", accumulation, "--optimizer", optimizer]
    if not sharded_init:
        cmd += ["--no-sharded-init"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent, check=False, timeout=3600)
    if p.returncode != 0 or out.stat().st_size == 0:
        raise RuntimeError(f"memory_scaling world={world} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(out.read_text())


def summarise(r: dict) -> dict:
    peaks = [x["peak_mib"] for x in r["ranks"]]
    return {
        "world": r["world"],
        "accumulation": r["accumulation"],
        "sharded_init": r["sharded_init"],
        "optimizer": r["optimizer"],
        "peak_mib_max": max(peaks),
        "peak_mib_per_rank": peaks,
        "start_mib": max(x["phases"]["start"]["VmRSS"] for x in r["ranks"]),
        "after_init_mib": max(x["phases"]["after_init"]["VmRSS"] for x in r["ranks"]),
        "init_peak_mib": max(x["phases"]["after_init"]["VmHWM"] for x in r["ranks"]),
        "step_s": min(min(x["step_s"]) for x in r["ranks"]),
        "micro_batches": r["ranks"][0]["micro_batches"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="large")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per rank")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--response", type=int, default=96)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default="")
    ap.add_argument("--accumulation", default="sharded")
    ap.add_argument("--optimizer", default="fused")
    ap.add_argument("--no-sharded-init", dest="sharded_init", action="store_false")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    raw, rows = [], []
    for w in worlds:
        r = run_world(args.preset, w, args)
        raw.append(r)
        rows.append(summarise(r))
        print(json.dumps(rows[-1]), flush=True)
    params = raw[0]["params"]
    state_mib = 16 * params / 2**20
    const = sum(r["peak_mib_max"] - state_mib / r["world"] for r in rows) / len(rows)
    for r in rows:
        r["model_mib"] = state_mib / r["world"] + const
        r["ratio_to_model"] = r["peak_mib_max"] / r["model_mib"]
    # The trade-offs, one change each at 2 ranks: unsharded gradient accumulation, the old
    # full-load init, torch's default (foreach) AdamW.
    extra = []
    wx = 2 if 2 in worlds else max(worlds)
    for accumulation, sharded_init, optimizer in (("unsharded", True, "fused"), ("sharded", False, "fused"), ("sharded", True, "foreach")):
        r = summarise(run_world(args.preset, wx, args, accumulation, sharded_init, optimizer))
        r["model_mib"] = state_mib / wx + const
        r["ratio_to_model"] = r["peak_mib_max"] / r["model_mib"]
        extra.append(r)
        print(json.dumps(r), flush=True)
    payload = {
        "machine": machine_info(),
        "preset": args.preset,
        "params": params,
        "state_mib_16P": state_mib,
        "constant_mib": const,
        "target": "peak RSS per rank within 1.2x of 16P/N + C",
        "met": all(r["ratio_to_model"] <= 1.2 for r in rows),
        "settings": {k: getattr(args, k) for k in ("rows", "micro", "prompt", "response", "steps")},
        "rows": rows,
        "tradeoffs": extra,
        "raw": raw,
    }
    write_json("memory_scaling", payload)
    print(f"{args.preset}: {params / 1e6:.0f}M params, 16P = {state_mib:.0f} MiB, C = {const:.0f} MiB, met={payload['met']}")
    fig, ax = figure((6.5, 4.2))
    xs = [r["world"] for r in rows]
    ax.plot(xs, [r["peak_mib_max"] / 1024 for r in rows], "o-", label="measured peak RSS per rank")
    ax.plot(xs, [r["model_mib"] / 1024 for r in rows], "s--", label=f"16P/N + C (C = {const / 1024:.2f} GiB)")
    ax.plot(xs, [state_mib / w / 1024 for w in xs], ":", label="16P/N (training state)")
    for r in extra:
        tag = ("unsharded grad accumulation" if r["accumulation"] == "unsharded"
               else "full-load init (old path)" if not r["sharded_init"] else "foreach AdamW")  # fmt: skip
        ax.plot([r["world"]], [r["peak_mib_max"] / 1024], "x", markersize=10, label=f"{tag}, N={r['world']}")
    ax.set_xlabel("ranks (N)")
    ax.set_ylabel("GiB per rank")
    ax.set_xticks(xs)
    ax.set_title(f"Training-side memory per rank, {args.preset} ({params / 1e6:.0f}M params, fp32 + AdamW)")
    ax.legend(fontsize=8)
    save_figure(fig, "memory_scaling", grid_axis="both")


if __name__ == "__main__":
    main()
