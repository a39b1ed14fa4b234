"""Offline preference learning on the same FSDP2 engine: DPO (``dpo_math``) and reward-model
training (``rm_math``), with the default preference set built from the SFT model's own answers.

Rows of a batch are laid out response by response (a pair's chosen then rejected; a list's K
responses in order) so micro-batches that are a multiple of the group size never split a pair or
a list. Losses are normalised by the global number of pairs/lists (all ranks).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import OmegaConf

from hybrid_rl.algorithms.preference import dpo_loss, listwise_rm_loss, margin_rm_loss, pairwise_rm_loss
from hybrid_rl.batch import ModelOutputs, Sample, TrainBatch, collate
from hybrid_rl.data.dataset import DataError, PromptSampler, load_prompts, resolve_files
from hybrid_rl.data.preference import (
    PreferenceExample,
    build_synthetic_preferences,
    load_preferences,
    split_by_prompt,
    synthetic_preference_dir,
)
from hybrid_rl.dist import DistContext, all_gather_objects, all_reduce_sum, barrier
from hybrid_rl.engine.builders import build_policy_engine, build_reward_engine
from hybrid_rl.engine.fsdp import FSDPEngine
from hybrid_rl.trainer.build import build_rollout_engine, load_tokenizer, max_model_len
from hybrid_rl.trainer.offline import fit_offline, offline_logger, offline_steps

if TYPE_CHECKING:  # annotations only
    from hybrid_rl.config import Config

log = logging.getLogger("hybrid_rl")
# In-process vLLM engines must outlive the process group (see rollout/vllm_engine.py).
_ENGINES: list[Any] = []


# ------------------------------------------------------------------ data
def set_seed(cfg: Config) -> int:
    """The built preference set's sampling seed: preference.seed, else trainer.seed."""
    return cfg.preference.seed if cfg.preference.seed is not None else cfg.trainer.seed


def preference_files(cfg: Config, ctx: DistContext, model_path: str, tok: Any) -> tuple[list[Path], list[Path]]:
    """The train/val preference files; builds the default set from the SFT model on first use."""
    d = cfg.data
    if list(d.train_files) != ["builtin:synth_pref"]:
        return [Path(f) for f in d.train_files], [Path(f) for f in d.val_files]
    pr = cfg.preference
    settings = {
        "n": pr.n_prompts,
        "k": pr.samples_per_prompt,
        "pairs": pr.pairs_per_prompt,
        "list": pr.list_size,
        "val": pr.val_fraction,
        "seed": set_seed(cfg),
        "synth": OmegaConf.to_container(d.synth, resolve=True),
    }
    out = synthetic_preference_dir(model_path, settings)
    if not (out / "train.parquet").exists():
        rows = _generate_preference_rows(cfg, ctx, model_path, tok, pr)
        if ctx.is_main:
            import pyarrow as pa
            import pyarrow.parquet as pq

            train, val = split_by_prompt(rows, pr.val_fraction)
            out.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(train), out / "train.parquet")
            pq.write_table(pa.Table.from_pylist(val), out / "val.parquet")
        barrier()
    return [out / "train.parquet"], [out / "val.parquet"]


def _generate_preference_rows(cfg: Config, ctx: DistContext, model_path: str, tok: Any, pr: Any) -> list[dict]:
    from hybrid_rl.rewards.pool import RewardPool

    synth_paths = resolve_files(["builtin:synth_math"], "train", cfg.data.synth)
    records, _ = load_prompts(synth_paths, tok, cfg.data, limit=pr.n_prompts)
    engine = build_rollout_engine(model_path, cfg, ctx, max_model_len(cfg, model_path), set_seed(cfg))
    _ENGINES.append(engine)
    pool = RewardPool(cfg.reward)
    try:
        mine = build_synthetic_preferences(
            model_path,
            engine,
            tok,
            records[ctx.rank :: ctx.world_size],
            pool,
            pr.samples_per_prompt,
            pr.list_size,
            set_seed(cfg) + ctx.rank,
            pr.pairs_per_prompt,
        )
    finally:
        pool.close()
    rows = [r for part in all_gather_objects(mine) for r in part]
    if not rows:
        raise DataError("the SFT model's answers were all right or all wrong on every prompt: no preference pairs")
    return rows


def rows_for(examples: list[PreferenceExample], pad_id: int) -> TrainBatch:
    """One row per response, in example order (pairs: chosen, rejected)."""
    samples = [
        Sample(ex.prompt_ids, r, [0.0] * len(r), [1] * len(r), "stop", i) for i, ex in enumerate(examples) for r in ex.responses
    ]
    batch = collate(samples, pad_id)
    batch.scores = torch.tensor([float(rank) for ex in examples for rank in ex.ranks])  # the ranks travel along
    return batch


def seq_logprobs(engine: FSDPEngine, examples: list[PreferenceExample], pad_id: int, chunk: int = 64) -> torch.Tensor:
    """Summed response log-probs per response row ``[sum_i K_i]`` (no grad)."""
    out = []
    for i in range(0, len(examples), chunk):
        b = rows_for(examples[i : i + chunk], pad_id)
        out.append((engine.forward_logprobs(b) * b.response_mask).sum(-1))
    return torch.cat(out) if out else torch.zeros(0)


def _micro(cfg: Config, group: int) -> int:
    return max(group, cfg.actor.micro_batch_size // group * group)


def _shard(items: list, ctx: DistContext) -> list:
    """This rank's equal share of ``items`` (a remainder smaller than the world size is dropped)."""
    per = len(items) // ctx.world_size
    return items[ctx.rank * per : (ctx.rank + 1) * per]


# ------------------------------------------------------------------ DPO
def make_dpo_loss(beta: float, n_pairs: float):
    def loss_fn(out: ModelOutputs, mb: TrainBatch) -> tuple[torch.Tensor, dict]:
        seq = (out.logprobs * mb.response_mask).sum(-1)
        loss, rc, rr = dpo_loss(seq[0::2], seq[1::2], mb.ref_seq_logprobs[0::2], mb.ref_seq_logprobs[1::2], beta)
        return loss.sum() / n_pairs, {
            "dpo/loss": loss.mean().detach(),
            "dpo/reward_margin": (rc - rr).mean(),
            "dpo/chosen_reward": rc.mean(),
            "dpo/rejected_reward": rr.mean(),
            "dpo/preference_accuracy": (rc > rr).float().mean(),
            "dpo/chosen_logprob": seq[0::2].mean().detach(),
            "dpo/rejected_logprob": seq[1::2].mean().detach(),
        }

    return loss_fn


def dpo_eval(policy: FSDPEngine, ref_val: torch.Tensor, val: list[PreferenceExample], pad_id: int, beta: float) -> dict:
    """Held-out: implicit-reward accuracy (margin > 0) and the policy's own preference (log pi(y_w) > log pi(y_l))."""
    seq = seq_logprobs(policy, val, pad_id)
    margin = beta * ((seq[0::2] - ref_val[0::2]) - (seq[1::2] - ref_val[1::2]))
    hits, raw, n = all_reduce_sum([float((margin > 0).sum()), float((seq[0::2] > seq[1::2]).sum()), float(len(val))])
    return {"val/preference_accuracy": hits / max(n, 1), "val/policy_prefers_chosen": raw / max(n, 1), "val/pairs": n}


def run_dpo(cfg: Config, ctx: DistContext, model_path: str) -> dict[str, float]:
    tok = load_tokenizer(model_path)
    train_files, val_files = preference_files(cfg, ctx, model_path, tok)
    train = load_preferences(train_files, tok, cfg.data, "pairs", limit=cfg.data.train_size)
    val = _shard(load_preferences(val_files, tok, cfg.data, "pairs", limit=cfg.data.val_size or 0), ctx)
    bs = cfg.data.train_batch_size
    steps = offline_steps(cfg, len(train), ctx.is_main)
    policy = build_policy_engine(model_path, cfg.model, cfg.actor, ctx, steps, trainable=True)
    policy.micro_batch_size = _micro(cfg, 2)
    ref = build_policy_engine(model_path, cfg.model, cfg.actor, ctx, 1, trainable=False)
    ref.micro_batch_size = policy.micro_batch_size
    # Reference log-probs once, for every pair (the reference never changes).
    ref_train = seq_logprobs(ref, _shard(train, ctx), tok.pad_token_id)
    ref_val = seq_logprobs(ref, val, tok.pad_token_id)
    logger = offline_logger(cfg, ctx, steps)
    before = dpo_eval(policy, ref_val, val, tok.pad_token_id, cfg.preference.beta)
    logger.log(0, before)
    mine = _shard(train, ctx)
    sampler = PromptSampler(len(mine), bs // ctx.world_size, cfg.data.seed, cfg.data.shuffle)

    def next_batch() -> TrainBatch:
        idx = sampler.next_batch()
        batch = rows_for([mine[i] for i in idx], tok.pad_token_id)
        batch.ref_seq_logprobs = torch.stack([ref_train[2 * i + j] for i in idx for j in (0, 1)])
        return batch

    loss_fn = make_dpo_loss(cfg.preference.beta, float(bs))
    last = fit_offline(policy, next_batch, loss_fn, steps, logger, metric_weight="rows")
    after = dpo_eval(policy, ref_val, val, tok.pad_token_id, cfg.preference.beta)
    policy.export_hf(str(Path(cfg.trainer.output_dir) / "hf"), tok)
    logger.log(steps, after)
    logger.close()
    return {**{f"before/{k}": v for k, v in before.items()}, **after, **last}


# ------------------------------------------------------------------ reward model
def make_rm_loss(kind: str, group: int, n_groups: float, margin: float):
    def loss_fn(out: ModelOutputs, mb: TrainBatch) -> tuple[torch.Tensor, dict]:
        s = out.scores
        if kind == "listwise":
            scores, ranks = s.view(-1, group), mb.scores.view(-1, group)
            loss = listwise_rm_loss(scores, ranks)
            best, worst = scores.gather(1, ranks.argmin(1, keepdim=True)), scores.gather(1, ranks.argmax(1, keepdim=True))
            acc = (best > worst).float().mean()
        else:
            loss = pairwise_rm_loss(s[0::2], s[1::2]) if kind == "pairwise" else margin_rm_loss(s[0::2], s[1::2], margin)
            acc = (s[0::2] > s[1::2]).float().mean()
        return loss.sum() / n_groups, {"rm/loss": loss.mean().detach(), "rm/accuracy": acc, "rm/score_mean": s.mean().detach()}

    return loss_fn


def rm_eval(engine: FSDPEngine, val: list[PreferenceExample], pad_id: int) -> dict:
    """Held-out pairwise accuracy (the chosen answer scores above the rejected one) and the mean
    Bradley-Terry probability sigma(r_chosen - r_rejected), which moves even when the accuracy of
    an untrained head is already saturated by chance."""
    hits, prob, n = 0.0, 0.0, 0.0
    for i in range(0, len(val), 64):
        b = rows_for(val[i : i + 64], pad_id)
        s = engine.forward_outputs(b).scores.float()
        hits += float((s[0::2] > s[1::2]).sum())
        prob += float(torch.sigmoid(s[0::2] - s[1::2]).sum())
        n += len(val[i : i + 64])
    hits, prob, n = all_reduce_sum([hits, prob, n])
    return {"val/rm_pairwise_accuracy": hits / max(n, 1), "val/rm_bt_prob": prob / max(n, 1), "val/pairs": n}


def run_rm(cfg: Config, ctx: DistContext, model_path: str, export_dir: str | None = None) -> dict[str, float]:
    tok = load_tokenizer(model_path)
    train_files, val_files = preference_files(cfg, ctx, model_path, tok)
    kind = cfg.preference.rm_loss
    group = cfg.preference.list_size if kind == "listwise" else 2
    train = load_preferences(train_files, tok, cfg.data, "lists" if kind == "listwise" else "pairs", limit=cfg.data.train_size)
    if kind == "listwise":
        train = [ex for ex in train if len(ex.responses) == group]
    val = _shard(load_preferences(val_files, tok, cfg.data, "pairs", limit=cfg.data.val_size or 0), ctx)
    bs = cfg.data.train_batch_size
    steps = offline_steps(cfg, len(train), ctx.is_main)
    engine = build_reward_engine(model_path, cfg.model, cfg.actor, ctx, steps, trainable=True, seed=cfg.trainer.seed)
    engine.micro_batch_size = _micro(cfg, group)
    logger = offline_logger(cfg, ctx, steps)
    before = rm_eval(engine, val, tok.pad_token_id)
    logger.log(0, before)
    mine = _shard(train, ctx)
    sampler = PromptSampler(len(mine), bs // ctx.world_size, cfg.data.seed, cfg.data.shuffle)
    loss_fn = make_rm_loss(kind, group, float(bs), cfg.preference.rm_margin)
    last = fit_offline(
        engine, lambda: rows_for([mine[i] for i in sampler.next_batch()], tok.pad_token_id), loss_fn, steps, logger, "rows"
    )
    after = rm_eval(engine, val, tok.pad_token_id)
    engine.export_hf(export_dir or str(Path(cfg.trainer.output_dir) / "hf"), tok)
    logger.log(steps, after)
    logger.close()
    return {**{f"before/{k}": v for k, v in before.items()}, **after, **last}
