"""The one offline training loop, shared by SFT, DPO and reward-model training.

Each task brings what differs (its examples, how a batch is built, its loss and its held-out
evaluation); the loop does the rest: ``steps`` x (next batch -> ``engine.train_batch``), timed,
with throughput, logged every ``log_every`` steps and at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from hybrid_rl.batch import LossFn, TrainBatch
from hybrid_rl.dist import DistContext, all_reduce_sum
from hybrid_rl.trainer.logger import MetricsLogger

if TYPE_CHECKING:  # annotations only
    from hybrid_rl.config import Config


def offline_steps(cfg: Config, n_examples: int) -> int:
    """``trainer.total_steps``, or fewer when ``trainer.sft_epochs`` passes over the examples first."""
    bs = cfg.data.train_batch_size
    return min(cfg.trainer.total_steps, max(1, int(cfg.trainer.sft_epochs * n_examples / bs)))


def offline_logger(cfg: Config, ctx: DistContext, steps: int) -> MetricsLogger:
    run_config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    return MetricsLogger(cfg.logger, Path(cfg.trainer.output_dir), run_config, steps, ctx.is_main)


def fit_offline(
    engine: Any,
    next_batch: Callable[[], TrainBatch],
    loss_fn: LossFn,
    steps: int,
    logger: MetricsLogger,
    metric_weight: str = "tokens",
    log_every: int = 10,
) -> dict[str, float]:
    """Train ``steps`` optimizer steps; returns the last step's metrics."""
    last: dict[str, float] = {}
    for step in range(1, steps + 1):
        start = time.perf_counter()
        batch = next_batch()
        last = engine.train_batch(batch, loss_fn, metric_weight=metric_weight)
        last["timing_s/step"] = time.perf_counter() - start
        last["train/tokens_per_s"] = all_reduce_sum([float(batch.attention_mask.sum())])[0] / last["timing_s/step"]
        if step % log_every == 0 or step == steps:
            logger.log(step, last)
    return last
