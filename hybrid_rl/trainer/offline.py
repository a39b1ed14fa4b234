"""The one offline training loop, shared by SFT, DPO and reward-model training.

Each task brings what differs (its examples, how a batch is built, its loss and its held-out
evaluation); the loop does the rest: ``steps`` x (next batch -> ``engine.train_batch``), timed,
with throughput, logged every ``log_every`` steps and at the end.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger("hybrid_rl")


def offline_steps(cfg: Config, n_examples: int, is_main: bool = True) -> int:
    """``trainer.total_steps``, or fewer when ``trainer.sft_epochs`` passes over the examples first
    (said on the console: the step budget the user set is not the one that runs)."""
    t, bs = cfg.trainer, cfg.data.train_batch_size
    steps = min(t.total_steps, max(1, int(t.sft_epochs * n_examples / bs)))
    if is_main:
        if steps < t.total_steps:
            log.info(
                "training %d steps, not trainer.total_steps=%d: trainer.sft_epochs=%s over %d examples of %d per batch ends first",
                steps, t.total_steps, t.sft_epochs, n_examples, bs,
            )  # fmt: skip
        log.info(
            "%s writes no checkpoints and does not resume (trainer.save_every, save_every_minutes, keep_last and resume "
            "apply to RL runs); the trained model is exported at the end", t.task,
        )  # fmt: skip
    return steps


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
