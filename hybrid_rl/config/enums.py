"""The closed value sets of the configuration, as enums in the schema.

OmegaConf checks an enum field when the config is composed, so a bad value fails before anything
starts with a message that lists the allowed ones (``Invalid value 'foo', expected one of [skip,
left, right, error]``). Each enum is a :class:`enum.StrEnum` whose names equal its values: a
member compares, hashes, formats and JSON-encodes as its string, so code reading the config keeps
comparing with plain strings.

Open sets stay strings checked against their registry (``algorithm.adv_estimator``,
``algorithm.policy_loss``, ``rollout.backend``, ``reward.reward_model.ensemble_reduce``), and so
do values that are not Python names (``algorithm.loss_agg_mode``'s ``token-mean``, the
``qwen0.5b`` preset): :mod:`hybrid_rl.config.checks` checks those.
"""

from __future__ import annotations

from enum import StrEnum

# The algorithm's closed sets live with the functions that read them (below the config layer).
from hybrid_rl.algorithms.params import FilterMetric, FilterRefill, GFPOMetric, KLControl, KLEstimator, TISMode


class Task(StrEnum):
    rl = "rl"
    sft = "sft"
    dpo = "dpo"
    rm = "rm"
    eval = "eval"


class NoUpdateAction(StrEnum):
    """What a run does after ``trainer.no_update_patience`` steps in a row without an optimizer step."""

    warn = "warn"
    stop = "stop"


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DType(StrEnum):
    """A compute dtype; ``auto`` picks what the hardware computes natively (:func:`hybrid_rl.env.auto_dtype`)."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class ReduceDType(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Truncation(StrEnum):
    skip = "skip"
    left = "left"
    right = "right"
    error = "error"


class SyncTransport(StrEnum):
    auto = "auto"
    collective = "collective"
    shm = "shm"


class LRSchedule(StrEnum):
    constant = "constant"
    cosine = "cosine"


class RecomputeOld(StrEnum):
    auto = "auto"
    always = "always"


class PrefixAttention(StrEnum):
    matmul = "matmul"
    sdpa = "sdpa"


class GradAccumulation(StrEnum):
    sharded = "sharded"
    unsharded = "unsharded"


class OptimizerImpl(StrEnum):
    fused = "fused"
    foreach = "foreach"
    bf16_moments = "bf16_moments"


class RMLoss(StrEnum):
    pairwise = "pairwise"
    margin = "margin"
    listwise = "listwise"


class ToolParser(StrEnum):
    hermes = "hermes"


class LoggerBackend(StrEnum):
    console = "console"
    tensorboard = "tensorboard"
    jsonl = "jsonl"
    wandb = "wandb"
    mlflow = "mlflow"


__all__ = [
    "DType",
    "Device",
    "FilterMetric",
    "FilterRefill",
    "GFPOMetric",
    "GradAccumulation",
    "KLControl",
    "KLEstimator",
    "LRSchedule",
    "LoggerBackend",
    "OptimizerImpl",
    "PrefixAttention",
    "RMLoss",
    "RecomputeOld",
    "ReduceDType",
    "SyncTransport",
    "TISMode",
    "Task",
    "ToolParser",
    "Truncation",
]  # fmt: skip
