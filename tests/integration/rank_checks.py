"""Checks that need several real ranks (run by test_ranks.py under torchrun, and with 1 rank).

    torchrun --nproc-per-node 2 tests/integration/rank_checks.py OUT.json
    python tests/integration/rank_checks.py OUT.json          # the same on 1 rank

1. For each loss aggregation mode, the full gradient of the actor loss on one fixed batch of 8
   samples of different lengths (each rank takes its rows), gathered from the FSDP2 shards.
   Splitting the batch over ranks (and micro-batches) must not change it.
2. The adaptive KL controller: each rank sees a different local KL; after the update every rank
   must hold the same coefficient (the global token-weighted KL drives it).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from hybrid_rl.env import setup_process_env

setup_process_env(threads_per_rank=1)

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from hybrid_rl.algorithms.kl import make_kl_controller  # noqa: E402
from hybrid_rl.algorithms.losses import agg_weights, make_actor_loss  # noqa: E402
from hybrid_rl.algorithms.params import GroupNormParams, KLRewardSettings  # noqa: E402
from hybrid_rl.algorithms.registry import ADV_ESTIMATORS  # noqa: E402
from hybrid_rl.batch import Sample, collate  # noqa: E402
from hybrid_rl.config import LOSS_AGG_MODES, ActorConfig, AlgorithmConfig, ModelConfig  # noqa: E402
from hybrid_rl.dist import all_gather_objects, all_reduce_sum, barrier, finish_rank, init_distributed  # noqa: E402
from hybrid_rl.engine.builders import build_policy_engine  # noqa: E402
from hybrid_rl.models.tiny import tiny_model_path  # noqa: E402
from hybrid_rl.trainer.rl import RLTrainer  # noqa: E402


def fixed_batch():
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        p, r = 3 + i % 3, 2 + (5 * i) % 9
        ids = torch.randint(5, 200, (p + r,), generator=g).tolist()
        samples.append(Sample(ids[:p], ids[p:], [0.0] * r, [1] * r, "stop", i // 4, score=float(i % 3)))
    return samples


def group_batch():
    """2 prompts x 4 responses of different lengths (GRPO groups: the shared-prefix case)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 200, (n,), generator=g).tolist() for n in (6, 3)]
    samples = []
    for i in range(8):
        r = 2 + (5 * i) % 9
        samples.append(Sample(prompts[i // 4], torch.randint(5, 200, (r,), generator=g).tolist(), [0.0] * r, [1] * r,
                              "stop", i // 4, score=float(i % 3)))  # fmt: skip
    return samples


def gradients(
    ctx, path: str, mode: str, accumulation: str = "sharded", shared_prefix: bool = False, samples=None, micro: int = 2,
    reshard: bool = True,
) -> dict[str, list[float]]:
    """The gradient the engine's own ``train_batch`` (micro-batching, accumulation, rank scaling)
    hands the optimizer, gathered from the shards; no clipping so nothing rescales it. With
    ``reshard=False`` (``actor.reshard_after_forward``) also ``"_sharded_after_no_grad_pass"``:
    1.0 when every parameter is back to its shard after a no-grad forward that followed the update."""
    ac = ActorConfig(micro_batch_size=micro, grad_clip=0.0, packing=False, grad_accumulation=accumulation, param_dtype=None,
                     shared_prefix=shared_prefix, reshard_after_forward=reshard)  # fmt: skip
    actor = build_policy_engine(path, ModelConfig(attn_implementation="sdpa"), ac, ctx, 10)
    samples = samples or fixed_batch()
    per = len(samples) // ctx.world_size
    batch = collate(samples[ctx.rank * per : (ctx.rank + 1) * per], 0)
    full_adv = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    batch.advantages = full_adv[ctx.rank * per : (ctx.rank + 1) * per, : batch.response_mask.shape[1]]
    n_tok, n_seq = all_reduce_sum([float(batch.response_mask.sum()), float(batch.size)])
    batch.loss_weights = agg_weights(batch.response_mask, mode, n_tok, n_seq, 16)
    out: dict[str, list[float]] = {}
    step = actor.optimizer.step

    def capture_then_step(*args, **kwargs):
        for name, p in actor.module.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            out[name] = [*grad.flatten()[:64].tolist(), float(grad.norm())]
        return step(*args, **kwargs)

    actor.optimizer.step = capture_then_step
    actor.train_batch(batch, make_actor_loss(AlgorithmConfig(loss_agg_mode=mode)))
    if not reshard:
        actor.forward_outputs(batch)
        out["_sharded_after_no_grad_pass"] = [float(all(isinstance(p, DTensor) for p in actor.module.parameters()))]
    return out


def sharded_init(ctx, path: str) -> dict[str, float]:
    """Policy, critic and reward model built on the meta device and filled shard by shard: the
    gathered parameters equal the checkpoint's tensors (and the old full-load path's)."""
    from safetensors.torch import load_file

    from hybrid_rl.config import CriticConfig
    from hybrid_rl.engine.builders import build_reward_engine, build_value_engine

    file = load_file(f"{path}/model.safetensors")
    ac, mc = ActorConfig(packing=False, param_dtype=None), ModelConfig(attn_implementation="sdpa", sharded_init=True)
    report = {}
    engines = {
        "policy": (build_policy_engine(path, mc, ac, ctx, 10), lambda n: n.removeprefix("lm.")),
        "critic": (build_value_engine(path, mc, CriticConfig(), ac, ctx, 10), lambda n: "model." + n.removeprefix("body.")),
        "reward": (
            build_reward_engine(path, mc, ac, ctx, 1, False, seed=0),
            lambda n: n.removeprefix("rm."),
        ),
    }
    old = build_policy_engine(path, ModelConfig(attn_implementation="sdpa", sharded_init=False), ac, ctx, 10)
    old_params = {n: p.full_tensor() for n, p in old.module.named_parameters()}
    for kind, (engine, key) in engines.items():
        worst, rows = 0.0, 0
        for name, p in engine.module.named_parameters():
            full = p.full_tensor()
            rows += p.to_local().shape[0] if p.dim() else 1
            if key(name) in file:
                worst = max(worst, float((full - file[key(name)].float()).abs().max()))
                if kind == "policy":
                    worst = max(worst, float((full - old_params[name]).abs().max()))
            elif "value_head" in name:
                worst = max(worst, float(full.abs().max()))  # zero-initialised
        report[f"{kind}_max_abs_diff"] = worst
        report[f"{kind}_local_rows"] = rows
        report[f"{kind}_loaded_tensors"] = engine.load_stats.get("tensors", 0)
    # The fresh reward head is the same on every rank (seeded), not one init per rank.
    score = dict(engines["reward"][0].module.named_parameters())["rm.score.weight"].full_tensor()
    report["reward_head_norm"] = float(score.norm())
    report["reward_head_rank_spread"] = max(all_gather_objects(float(score.sum()))) - min(all_gather_objects(float(score.sum())))
    return report


def gather_transports(ctx, path: str) -> dict[str, float]:
    """The weight sync's gather (flat buckets; collective and shared-memory transports; buckets
    smaller than one tensor, and all in one) against DTensor.full_tensor(), bitwise, fp32 and bf16."""
    actor = build_policy_engine(
        path, ModelConfig(attn_implementation="sdpa"), ActorConfig(packing=False, param_dtype=None), ctx, 10
    )
    ref = {actor.hf_name(n): p.detach().full_tensor() for n, p in actor.module.named_parameters()}
    out = {}
    # After a no-grad forward FSDP2 leaves the root's parameters unsharded (plain tensors).
    for after_forward in (False, True):
        if after_forward:
            actor.forward_logprobs(collate(fixed_batch(), 0))
            out["root_unsharded"] = sum(not hasattr(p, "full_tensor") for p in actor.module.parameters())
        for transport in ("collective", "shm"):
            for dtype in (torch.float32, torch.bfloat16):
                for bucket in (1, 1 << 30):
                    got = list(actor.iter_full_params(bucket, dtype, transport))
                    assert [n for n, _ in got] == list(ref), "names or order differ"
                    worst = max(float((t.float() - ref[n].to(dtype).float()).abs().max()) for n, t in got)
                    out[f"{transport}_{str(dtype)[6:]}_{bucket}_{after_forward}"] = worst
    out["auto"] = actor.auto_transport()
    out["odd_rows"] = sum(1 for t in ref.values() if t.dim() and t.shape[0] % 2)
    return out


def kl_controller(ctx) -> list[float]:
    a = AlgorithmConfig(kl_reward=KLRewardSettings(enable=True, penalty="k1", coef=0.1, ctrl="adaptive", target=0.01, horizon=10))
    stub = SimpleNamespace(
        cfg=SimpleNamespace(algorithm=a),
        kl_ctrl=make_kl_controller(a.kl_reward),
        adv_fn=ADV_ESTIMATORS["grpo"],
        adv_params=GroupNormParams(),
        ctx=ctx,
    )
    samples = fixed_batch()[:4]
    batch = collate(samples, 0)
    # rank r's policy is r+1 nats/token away from the reference: local KLs differ by rank
    batch.old_logprobs = torch.zeros_like(batch.response_mask)
    batch.ref_logprobs = -(ctx.rank + 1.0) * (1 + torch.arange(batch.size))[:, None] * torch.ones_like(batch.response_mask)
    RLTrainer.compute_advantages(stub, batch)
    return [float(v) for v in all_gather_objects(stub.kl_ctrl.value)]


def main() -> None:
    out_path = sys.argv[1]
    ctx = init_distributed("cpu")
    path = str(tiny_model_path("micro"))
    report = {"world_size": ctx.world_size, "grads": {m: gradients(ctx, path, m) for m in LOSS_AGG_MODES}}
    report["grads_unsharded_accumulation"] = gradients(ctx, path, "token-mean", "unsharded")
    report["grads_kept_after_forward"] = gradients(ctx, path, "token-mean", reshard=False)
    # Shared-prefix forward under FSDP2 (the body runs twice per micro-batch) vs the plain one.
    groups = group_batch()
    report["grads_groups_plain"] = gradients(ctx, path, "token-mean", samples=groups, micro=4)
    report["grads_groups_shared_prefix"] = gradients(ctx, path, "token-mean", shared_prefix=True, samples=groups, micro=4)
    report["sharded_init"] = sharded_init(ctx, path)
    report["gather"] = gather_transports(ctx, path)
    report["kl_coef_per_rank"] = kl_controller(ctx)
    if ctx.rank == 0:
        with open(out_path, "w") as fh:
            json.dump(report, fh)
    barrier()
    finish_rank(0)


if __name__ == "__main__":
    main()
