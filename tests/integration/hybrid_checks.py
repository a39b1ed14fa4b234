"""Checks of the hybrid engine under real torchrun (run by test_hybrid.py; writes a JSON report).

    torchrun --nproc-per-node 2 tests/integration/hybrid_checks.py OUT.json [--switches 50]

On every rank: an FSDP2 actor and an in-process vLLM engine on the tiny model. Checks, per
dtype: log-prob parity after a sync on fixed sequences, that a training step changes vLLM's
outputs (and they still match), that the push resets the prefix cache, that a sync after an
aborted generate and another step works, and RSS over many switches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hybrid_rl.env import setup_process_env

setup_process_env(threads_per_rank=1)


from hybrid_rl.algorithms.losses import agg_weights, make_sft_loss  # noqa: E402
from hybrid_rl.batch import Sample, collate  # noqa: E402
from hybrid_rl.config import ActorConfig, ModelConfig, RolloutConfig  # noqa: E402
from hybrid_rl.dist import all_reduce_max, barrier, init_distributed  # noqa: E402
from hybrid_rl.engine.builders import build_policy_engine  # noqa: E402
from hybrid_rl.engine.fsdp import to_dtype  # noqa: E402
from hybrid_rl.hybrid.switch import HybridSwitch  # noqa: E402
from hybrid_rl.models.tiny import tiny_model_path  # noqa: E402
from hybrid_rl.rollout.base import SamplingSpec  # noqa: E402
from hybrid_rl.rollout.vllm_engine import VLLMRollout  # noqa: E402
from hybrid_rl.timing import memory_reading  # noqa: E402

# Engines must outlive the process group: a collected in-process engine shuts itself down, and
# vLLM's shutdown destroys torch.distributed's default group (on that rank only -> hangs).
KEEP_ALIVE: list = []


def fixed_sequences(tok, rank: int) -> list[list[int]]:
    out = []
    for i in range(4):
        msgs = [{"role": "user", "content": f"Dan has {i + rank} eggs. Dan finds {7 * i} more. How many eggs?"}]
        p = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append(list(p) + tok.encode(f"{i + rank} + {7 * i} = {8 * i + rank}. The answer is \\boxed{{{8 * i + rank}}}."))
    return out


def trainer_logprobs(engine, seqs, prompt_len: int = 1) -> list[list[float]]:
    samples = [
        Sample(s[:prompt_len], s[prompt_len:], [0.0] * (len(s) - prompt_len), [1] * (len(s) - prompt_len), "stop", i)
        for i, s in enumerate(seqs)
    ]
    lp = engine.forward_logprobs(collate(samples, pad_id=0))
    return [lp[i, : len(s) - prompt_len].tolist() for i, s in enumerate(seqs)]


def max_diff(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def check_dtype(dtype: str, path: str, ctx, switches: int) -> dict:
    mc = ModelConfig(attn_implementation="sdpa")
    # fp32 master weights always; bf16 runs compute in bf16 and the engine holds bf16 weights.
    ac = ActorConfig(lr=3e-3, micro_batch_size=8, packing=True, param_dtype=None if dtype == "float32" else dtype)
    actor = build_policy_engine(path, mc, ac, ctx, total_steps=10)
    rc = RolloutConfig(block_size=32, max_num_seqs=64, gpu_memory_utilization=0.3, kv_cache_gib=0.125)
    engine = VLLMRollout(path, rc, dtype, seed=ctx.rank, device=ctx.device, max_model_len=256)
    KEEP_ALIVE.extend([engine, actor])
    tok = engine.tokenizer
    switch = HybridSwitch(actor, engine, sync_dtype=to_dtype(dtype), bucket_bytes=1 << 20, device=ctx.device)
    seqs = fixed_sequences(tok, ctx.rank)
    out: dict = {"dtype": dtype}

    # 1. parity after a sync
    switch.to_train()
    rep = switch.to_rollout()
    out["sync_seconds"] = rep.seconds["sync_weights"]
    before = engine.prompt_logprobs(seqs)
    out["parity_max_abs_diff"] = all_reduce_max(max_diff(before, trainer_logprobs(actor, seqs)))

    # A prompt over three 32-token blocks, generated twice: the second is served from the prefix cache.
    long = seqs[0] + seqs[1]
    for _ in range(2):
        engine.generate([long], SamplingSpec(n=1, max_tokens=4, seed=3))
    out["prefix_cached_warm"] = engine.last_stats.cached_prompt_tokens
    out["prefix_full_blocks"] = len(long) // 32 * 32

    # 2. a training step changes vLLM's outputs, and they match the trainer's new log-probs
    switch.to_train()
    samples = [Sample(s[:-6], s[-6:], [0.0] * 6, [1] * 6, "stop", i) for i, s in enumerate(seqs)]
    batch = collate(samples, tok.pad_token_id)
    batch.loss_weights = agg_weights(
        batch.response_mask, "token-mean", float(batch.response_mask.sum()) * ctx.world_size, float(batch.size * ctx.world_size)
    )
    actor.train_batch(batch, make_sft_loss())
    switch.policy_updated()
    stale = engine.prompt_logprobs(seqs)
    out["stale_equals_before"] = max_diff(stale, before) == 0.0
    switch.to_rollout()
    # The push reset the prefix cache (nothing has run since it): the long prompt is computed again with the new
    # weights, so its sampled tokens' log-probs match the trainer's (stale cached KV would not)
    fresh = engine.generate([long], SamplingSpec(n=1, max_tokens=4, seed=3))[0].completions[0]
    out["prefix_cached_after_push"] = engine.last_stats.cached_prompt_tokens
    mine = trainer_logprobs(actor, [long + list(fresh.token_ids)], prompt_len=len(long))
    out["generated_parity_after_push"] = all_reduce_max(max_diff(mine, [list(fresh.logprobs)]))
    after = engine.prompt_logprobs(seqs)
    out["change_after_step"] = all_reduce_max(max_diff(after, before))
    out["parity_after_step"] = all_reduce_max(max_diff(after, trainer_logprobs(actor, seqs)))
    out["weights_version"] = switch.engine_version

    # 3. a sync after a failed generate (one request too long for the engine) still works
    too_long = [seqs[0], seqs[0] * 40]
    try:
        engine.generate(too_long, SamplingSpec(n=2, max_tokens=8))
        out["aborted_generate_raised"] = False
    except Exception as e:
        out["aborted_generate_raised"] = type(e).__name__
    # ... with a training step between the abort and the next push, so a push that does nothing
    # after an abort leaves the engine behind and fails the parity below
    switch.to_train()
    actor.train_batch(batch, make_sft_loss())
    switch.policy_updated()
    switch.to_rollout()
    res = engine.generate([seqs[1][:20]], SamplingSpec(n=2, max_tokens=8, seed=1))
    out["generate_after_abort_ok"] = len(res[0].completions) == 2
    after_abort = engine.prompt_logprobs(seqs)
    out["change_after_abort_step"] = all_reduce_max(max_diff(after_abort, after))
    out["parity_after_abort"] = all_reduce_max(max_diff(after_abort, trainer_logprobs(actor, seqs)))

    # 4. CUDA: to_train frees the KV cache and vLLM's weights (sleep mode), to_rollout takes them back
    if ctx.device.type == "cuda":
        import torch

        switch.to_train()
        torch.cuda.synchronize()
        free_train = torch.cuda.mem_get_info(ctx.device)[0]
        out["engine_freed"] = bool(switch.history[-1].freed)
        switch.to_rollout()
        torch.cuda.synchronize()
        free_rollout = torch.cuda.mem_get_info(ctx.device)[0]
        out["cuda_freed_by_sleep_gib"] = (free_train - free_rollout) / 2**30
        out["parity_after_sleep_wake"] = all_reduce_max(max_diff(engine.prompt_logprobs(seqs), trainer_logprobs(actor, seqs)))
        out["switch_phases_s"] = {f"{r.direction}/{k}": v for r in switch.history[-2:] for k, v in r.seconds.items()}

    # 5. many switches: resident memory stays flat
    rss = []
    for _ in range(switches):
        switch.to_train()
        switch.to_rollout()
        engine.generate([seqs[2][:24]], SamplingSpec(n=4, max_tokens=8, seed=2))
        rss.append(memory_reading()["rss_mib"])
        if ctx.device.type == "cuda":
            import torch

            free, total = torch.cuda.mem_get_info(ctx.device)
            out.setdefault("cuda_used_mib", []).append((total - free) / 2**20)
    out["rss_mib"] = rss
    out["rss_growth_mib_after_warmup"] = all_reduce_max(rss[-1] - rss[min(5, len(rss) - 1)])
    out["switch_total_s_mean"] = sum(r.total_seconds for r in switch.history[-2 * switches :]) / switches
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--switches", type=int, default=50)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    args = ap.parse_args()
    ctx = init_distributed(args.device)
    path = str(tiny_model_path(args.preset)) if ctx.rank == 0 else None
    barrier()
    path = str(tiny_model_path(args.preset))
    report = {"world_size": ctx.world_size, "results": [check_dtype(d, path, ctx, args.switches) for d in args.dtypes.split(",")]}
    write_report_and_exit(report, args.out, ctx)


def write_report_and_exit(report: dict, out: str, ctx) -> None:
    """Rank 0 writes the report; every rank leaves without interpreter teardown (vLLM's atexit
    shutdown tears down the process group mid-exit)."""
    if ctx.rank == 0:
        with open(out, "w") as fh:
            json.dump(report, fh, indent=1)
    barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
