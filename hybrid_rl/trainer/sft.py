"""Supervised fine-tuning on the same FSDP2 engine (the ``sft_math`` recipe, and GRPO's warm start).

Each row's prompt is rendered with the chat template (generation prompt included) and its
response (``data.response_key``) is appended with the end-of-turn token; the loss is the
token-mean negative log-likelihood of the response tokens over the whole batch (all ranks).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hybrid_rl.algorithms.losses import agg_weights, make_sft_loss
from hybrid_rl.batch import Sample, collate
from hybrid_rl.data.dataset import DataError, PromptSampler, get_path, load_prompts, read_rows, resolve_files
from hybrid_rl.dist import DistContext, all_reduce_sum, barrier
from hybrid_rl.engine.builders import build_policy_engine
from hybrid_rl.rollout.chat import assemble_trajectory
from hybrid_rl.trainer.build import build_tools, load_tokenizer, max_model_len
from hybrid_rl.trainer.logger import MetricsLogger

log = logging.getLogger("hybrid_rl")


def sft_samples(files: list[Path], tokenizer: Any, cfg: Any, tools: list[dict] | None = None) -> list[Sample]:
    """Prompt + target response token ids for every row.

    The target is a string (one assistant turn) or a list of ``[role, text]`` turns (tool use:
    assistant turns are trained on, tool turns are masked out, laid out exactly as the agent
    loop produces them at rollout time).
    """
    records, _ = load_prompts(files, tokenizer, cfg, tools=tools)
    rows_by_source = {}
    for path in files:
        for i, row in enumerate(read_rows(path)):
            rows_by_source[f"{path}:{i}"] = row
    eos = tokenizer.eos_token or ""
    samples = []
    for rec in records:
        row = rows_by_source[rec.source]
        try:
            target = get_path(row, cfg.response_key)
        except KeyError:
            raise DataError(f"{rec.source}: missing response field {cfg.response_key!r} (data.response_key)") from None
        if isinstance(target, list) and target and all(isinstance(t, list | tuple) and len(t) == 2 for t in target):
            ids, mask = assemble_trajectory(tokenizer, rec.prompt_ids, [(str(r), str(t)) for r, t in target])
        elif isinstance(target, str) and target.strip():
            ids = tokenizer(target + eos, add_special_tokens=False)["input_ids"]
            mask = [1] * len(ids)
        else:
            raise DataError(
                f"{rec.source}: response field {cfg.response_key!r} must be a non-empty string or a list of [role, text] turns"
            )
        samples.append(Sample(rec.prompt_ids, ids, [0.0] * len(ids), mask, "stop", len(samples)))
    return samples


def run_sft(
    cfg: Any, ctx: DistContext, model_path: str, export_dir: str | None = None, evaluate_after: bool = False
) -> dict[str, float]:
    """Train for ``trainer.total_steps`` steps (or ``trainer.sft_epochs``); export an HF folder."""
    tok = load_tokenizer(model_path)
    _, schemas = build_tools(cfg)
    samples = sft_samples(resolve_files(cfg.data.train_files, "train", cfg.data.synth), tok, cfg.data, schemas)
    bs = cfg.data.train_batch_size
    if bs % ctx.world_size:
        raise DataError(f"data.train_batch_size={bs} does not divide over {ctx.world_size} ranks")
    steps = min(cfg.trainer.total_steps, max(1, int(cfg.trainer.sft_epochs * len(samples) / bs)))
    engine = build_policy_engine(model_path, cfg.model, cfg.actor, ctx, steps, trainable=True)
    sampler = PromptSampler(len(samples), bs, cfg.data.seed, cfg.data.shuffle)
    loss_fn = make_sft_loss()
    out_dir = Path(cfg.trainer.output_dir)
    logger = MetricsLogger(cfg.logger, out_dir, OmegaConf.to_container(cfg, resolve=True), steps, ctx.is_main)
    per_rank = bs // ctx.world_size
    last: dict[str, float] = {}
    for step in range(1, steps + 1):
        start = time.perf_counter()
        idx = sampler.next_batch()[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]
        batch = collate([samples[i] for i in idx], tok.pad_token_id)
        n_tok, n_seq = all_reduce_sum([float(batch.response_mask.sum()), float(batch.size)])
        batch.loss_weights = agg_weights(batch.response_mask, "token-mean", n_tok, n_seq)
        metrics = engine.train_batch(batch, loss_fn)
        metrics["timing/step"] = time.perf_counter() - start
        metrics["train/tokens_per_s"] = all_reduce_sum([float(batch.attention_mask.sum())])[0] / metrics["timing/step"]
        last = metrics
        if step % 10 == 0 or step == steps:
            logger.log(step, metrics)
    hf_dir = export_dir or str(out_dir / "hf")
    engine.export_hf(hf_dir, tok)
    if evaluate_after:
        last.update(_evaluate_export(cfg, ctx, hf_dir, tok))
        logger.log(steps, {k: v for k, v in last.items() if k.startswith("val/")})
    logger.close()
    return last


def _evaluate_export(cfg: Any, ctx: DistContext, hf_dir: str, tok: Any) -> dict[str, float]:
    """Held-out accuracy of the exported model, generated by vLLM (the engine RL will use)."""
    from hybrid_rl.rewards.pool import RewardPool
    from hybrid_rl.trainer.build import build_rollout_engine
    from hybrid_rl.trainer.validation import evaluate, single_turn_sampler

    _, schemas = build_tools(cfg)
    val_records, _ = load_prompts(
        resolve_files(cfg.data.val_files, "val", cfg.data.synth), tok, cfg.data, cfg.data.val_size, tools=schemas
    )
    engine = build_rollout_engine(hf_dir, cfg, ctx, max_model_len(cfg, hf_dir), cfg.trainer.seed)
    pool = RewardPool(cfg.reward)
    try:
        return evaluate(
            single_turn_sampler(engine, tok),
            val_records,
            pool,
            ctx,
            cfg.rollout.max_response_length,
            cfg.rollout.val_pass_k,
            cfg.rollout.temperature,
            cfg.trainer.seed,
        )
    finally:
        pool.close()
        barrier()
        engine.shutdown()
