"""One measurement process of the switch benchmark (see switch_overhead.py).

Modes:
  hybrid (under torchrun): FSDP2 actor + in-process vLLM per rank; times each switch phase,
         the memcpy floor for the same bytes, and reads RSS.
  naive  (single process): save the model to disk, start a new vLLM engine from it, generate once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from benchmarks.common import actor_config, model_config, rollout_config
from hybrid_rl.env import setup_process_env

setup_process_env(threads_per_rank=max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))

import torch  # noqa: E402

from hybrid_rl.engine.fsdp import to_dtype  # noqa: E402
from hybrid_rl.models.tiny import tiny_model_path  # noqa: E402
from hybrid_rl.rollout.base import SamplingSpec  # noqa: E402

RC = rollout_config(max_num_seqs=32, kv_cache_gib=0.0625)


def memcpy_floor(nbytes: int, repeats: int) -> dict:
    """Copy ``nbytes`` between two preallocated buffers (the floor for moving the weights once)."""
    from benchmarks.common import timed

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)
        if dev == "cuda":
            torch.cuda.synchronize()

    return timed(copy, repeats)


def hybrid(args) -> dict:
    from hybrid_rl.dist import barrier, init_distributed
    from hybrid_rl.engine.builders import build_policy_engine
    from hybrid_rl.hybrid.switch import HybridSwitch
    from hybrid_rl.rollout.vllm_engine import VLLMRollout
    from hybrid_rl.timing import memory_reading

    ctx = init_distributed("auto")
    path = str(tiny_model_path(args.preset)) if ctx.rank == 0 else None
    barrier()
    path = str(tiny_model_path(args.preset))
    actor = build_policy_engine(path, model_config(), actor_config(args.dtype, micro_batch_size=8), ctx, total_steps=10)
    engine = VLLMRollout(path, RC, args.dtype, seed=ctx.rank, device=ctx.device, max_model_len=256)
    switch = HybridSwitch(
        actor, engine, sync_dtype=to_dtype(args.dtype), bucket_bytes=args.bucket_mb << 20, sleep_level=1, device=ctx.device
    )
    nbytes = actor.param_bytes(to_dtype(args.dtype))
    rss0 = memory_reading(ctx.device)
    phases: dict[str, list[float]] = {}
    totals = {"to_rollout": [], "to_train": []}
    trace: list[float] = []
    for i in range(args.repeats + 1):
        for rep in (switch.to_train(), switch.to_rollout()):
            if i == 0:
                continue  # warm-up (first gather, allocator growth)
            totals[rep.direction].append(rep.total_seconds)
            for k, v in rep.seconds.items():
                phases.setdefault(f"{rep.direction}/{k}", []).append(v)
        engine.generate([[1, 2, 3, 4]], SamplingSpec(n=1, max_tokens=4))
        if i == 0:
            rss0 = memory_reading(ctx.device)
        trace.append(memory_reading(ctx.device)["rss_mib"])
    rss1 = memory_reading(ctx.device)
    # Where the sync time goes: the all-gather out of the shards alone, and vLLM's load alone.
    from benchmarks.common import timed

    dt, bucket = to_dtype(args.dtype), args.bucket_mb << 20
    gather = timed(lambda: sum(1 for _ in actor.iter_full_params(bucket, dt)), args.repeats)
    gathered = [(n, t.clone()) for n, t in actor.iter_full_params(bucket, dt)]
    load = timed(lambda: engine.load_weights(iter(gathered)), args.repeats)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    out = {
        "preset": args.preset,
        "dtype": args.dtype,
        "world_size": ctx.world_size,
        "param_bytes": nbytes,
        "params": sum(p.numel() for p in actor.module.parameters()),
        "phases_median_s": {k: med(v) for k, v in phases.items()},
        "to_rollout_median_s": med(totals["to_rollout"]),
        "to_train_median_s": med(totals["to_train"]),
        "gather_only": gather,
        "vllm_load_only": load,
        "memcpy_floor": memcpy_floor(nbytes, args.repeats) if ctx.rank == 0 else None,
        "rss_before_mib": rss0,
        "rss_after_mib": rss1,
        "rss_trace_mib": trace,
        "engine_start_s": engine.start_seconds,
        "notes": switch.history[-2].notes + switch.history[-1].notes,
    }
    if ctx.rank == 0:
        with open(args.out, "w") as fh:
            json.dump(out, fh)
    barrier()
    sys.stdout.flush()
    os._exit(0)


def naive(args) -> dict:
    """Save to disk + start a new engine + first token: the switch without a hybrid engine."""
    from transformers import AutoModelForCausalLM

    from hybrid_rl.rollout.vllm_engine import VLLMRollout

    path = str(tiny_model_path(args.preset))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=to_dtype(args.dtype))
    tmp = tempfile.mkdtemp(prefix="naive-", dir=os.environ.get("TMPDIR", "/tmp"))
    t0 = time.perf_counter()
    model.save_pretrained(tmp, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if os.path.exists(os.path.join(path, f)):
            with open(os.path.join(path, f), "rb") as a, open(os.path.join(tmp, f), "wb") as b:
                b.write(a.read())
    os.sync()
    t1 = time.perf_counter()
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    engine = VLLMRollout(tmp, RC, args.dtype, seed=0, device=dev, max_model_len=256)
    t2 = time.perf_counter()
    engine.generate([[1, 2, 3, 4]], SamplingSpec(n=1, max_tokens=1))
    t3 = time.perf_counter()
    out = {
        "preset": args.preset,
        "dtype": args.dtype,
        "save_s": t1 - t0,
        "engine_start_s": t2 - t1,
        "first_token_s": t3 - t2,
        "total_s": t3 - t0,
    }
    with open(args.out, "w") as fh:
        json.dump(out, fh)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["hybrid", "naive"])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    hybrid(a) if a.mode == "hybrid" else naive(a)
