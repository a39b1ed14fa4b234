"""LoRA on the hybrid engine, on real torchrun ranks (gloo) and a real vLLM engine with LoRA slots:

    torchrun --nproc-per-node 2 tests/integration/lora_checks.py OUT.json [--rank 16]

Rank-8 adapters (alpha = 2 x rank) on the tiny model, fp32. Checks that the engine's log-probs
with the in-memory adapter equal the trainer's after training steps and syncs, that a sync moves
only the adapters and leaves the trainer's own ones as they were (vLLM folds alpha / r into the
``B`` it is given, in place; on one rank nothing is gathered, so it is given the trainer's own
tensors unless the engine copies them), that the frozen base and the adapter-off reference stay
the starting model, and that a skipped sync is caught by the version guard."""

from __future__ import annotations

import argparse

import torch
from hybrid_checks import KEEP_ALIVE, fixed_sequences, max_diff, trainer_logprobs, write_report_and_exit
from torch.distributed.tensor import DTensor

from hybrid_rl.algorithms.losses import agg_weights, make_sft_loss
from hybrid_rl.batch import Sample, collate
from hybrid_rl.config import ActorConfig, ModelConfig, RolloutConfig
from hybrid_rl.config.groups import LoraConfig
from hybrid_rl.dist import all_reduce_max, barrier, init_distributed
from hybrid_rl.engine.builders import build_policy_engine
from hybrid_rl.engine.lora import AdapterOffReference, adapter_config, is_lora
from hybrid_rl.errors import StaleWeightsError
from hybrid_rl.hybrid.switch import HybridSwitch
from hybrid_rl.models.tiny import tiny_model_path
from hybrid_rl.rollout.base import SamplingSpec
from hybrid_rl.rollout.vllm_engine import VLLMRollout


def local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach().clone()


def sft_step(actor, switch, seqs, pad_id: int, world: int) -> None:
    switch.to_train()
    samples = [Sample(s[:-6], s[-6:], [0.0] * 6, [1] * 6, "stop", i) for i, s in enumerate(seqs)]
    batch = collate(samples, pad_id)
    n = float(batch.response_mask.sum()) * world
    batch.loss_weights = agg_weights(batch.response_mask, "token-mean", n, float(batch.size * world))
    actor.train_batch(batch, make_sft_loss())
    switch.policy_updated()


def push(switch, named: dict) -> tuple:
    """``switch.to_rollout()``, and the largest change it made to the trainer's own ``lora_B``
    (bitwise: 0.0 when the push only read them)."""
    before = {n: local(p) for n, p in named.items() if ".lora_B." in n}
    rep = switch.to_rollout()
    return rep, all_reduce_max(max(float((local(named[n]) - b).abs().max()) for n, b in before.items()))


def generated_parity(engine, actor, prompt: list[int]) -> float:
    done = engine.generate([prompt], SamplingSpec(n=2, max_tokens=8, seed=5))[0].completions
    return max(max_diff(trainer_logprobs(actor, [prompt + list(c.token_ids)], len(prompt)), [list(c.logprobs)]) for c in done)


def run(path: str, ctx, rank: int) -> dict:
    lora = LoraConfig(rank=rank, alpha=2.0 * rank)
    ac = ActorConfig(lr=1e-2, micro_batch_size=8, packing=True, param_dtype=None, lora=lora)
    actor = build_policy_engine(path, ModelConfig(attn_implementation="sdpa"), ac, ctx, total_steps=10, lora_seed=0)
    rc = RolloutConfig(block_size=32, max_num_seqs=64, kv_cache_gib=0.125)
    engine = VLLMRollout(path, rc, "float32", seed=ctx.rank, device=ctx.device, max_model_len=256, lora_rank=rank)
    KEEP_ALIVE.extend([engine, actor])
    switch = HybridSwitch(
        actor, engine, sync_dtype=None, bucket_bytes=1 << 20, device=ctx.device, adapter=adapter_config(lora, path)
    )
    ref, tok = AdapterOffReference(actor), engine.tokenizer
    seqs = fixed_sequences(tok, ctx.rank)
    out: dict = {"rank": rank}
    named = dict(actor.module.named_parameters())
    base_name = next(n for n in named if n.endswith("q_proj.base_layer.weight"))
    base_before = local(named[base_name])
    out["trainable_tensors"] = sum(p.requires_grad for p in named.values())
    out["adapter_tensors"] = sum(is_lora(n) for n in named)
    out["optimizer_tensors"] = sum(len(g["params"]) for g in actor.optimizer.param_groups)

    start = engine.prompt_logprobs(seqs)  # the engine as started: base weights, no adapter yet
    out["parity_start"] = all_reduce_max(max_diff(start, trainer_logprobs(actor, seqs)))
    sft_step(actor, switch, seqs, tok.pad_token_id, ctx.world_size)
    out["stale_equals_start"] = max_diff(engine.prompt_logprobs(seqs), start) == 0.0
    try:
        switch.check_version(switch.engine_version)
        out["stale_refused"] = False
    except StaleWeightsError:
        out["stale_refused"] = True
    rep, out["push_changed_lora_b"] = push(switch, named)
    out["lora_b_max"] = all_reduce_max(max(float(local(p).abs().max()) for n, p in named.items() if ".lora_B." in n))
    out["sync_bytes"] = rep.moved_bytes["sync.tensors"]
    out["sync_seconds"] = rep.seconds["sync_weights"]
    out["adapter_bytes"] = sum(p.numel() * 4 for n, p in named.items() if is_lora(n))
    out["model_bytes"] = sum(p.numel() * 4 for n, p in named.items() if not is_lora(n))
    after = engine.prompt_logprobs(seqs)
    out["change_after_step"] = all_reduce_max(max_diff(after, start))
    out["parity_after_step"] = all_reduce_max(max_diff(after, trainer_logprobs(actor, seqs)))
    out["generated_parity_after_step"] = all_reduce_max(generated_parity(engine, actor, seqs[1][:20]))
    ref_lp = trainer_logprobs(ref, seqs)
    out["reference_vs_start"] = all_reduce_max(max_diff(ref_lp, start))
    out["base_max_change"] = all_reduce_max(float((local(named[base_name]) - base_before).abs().max()))

    sft_step(actor, switch, seqs, tok.pad_token_id, ctx.world_size)  # a second push replaces the adapter in place
    _, out["second_push_changed_lora_b"] = push(switch, named)
    again = engine.prompt_logprobs(seqs)
    out["change_second_step"] = all_reduce_max(max_diff(again, after))
    out["parity_second_step"] = all_reduce_max(max_diff(again, trainer_logprobs(actor, seqs)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()
    ctx = init_distributed("cpu")
    if ctx.rank == 0:
        tiny_model_path("tiny")
    barrier()
    write_report_and_exit({"world_size": ctx.world_size, **run(str(tiny_model_path("tiny")), ctx, args.rank)}, args.out, ctx)


if __name__ == "__main__":
    main()
