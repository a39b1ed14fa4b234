"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore.

``conf/config.yaml`` starts from the ``base_config`` schema below, then each group file
(``conf/model/tiny.yaml`` ...) fills its node. Because every node is a structured config, a
typo'd key, a mistyped value or a value outside an enum fails when the config is composed, with a
message naming the key. :mod:`hybrid_rl.config.preflight` then runs every check of the chosen task
in the launching process, before any rank, warm-start job or engine starts
(:mod:`hybrid_rl.config.checks` holds the cross-field checks a schema cannot express).

Importing this package does not import torch: the launcher validates a config in about a second.
"""

from __future__ import annotations

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from hybrid_rl.config.checks import LOSS_AGG_MODES, validate
from hybrid_rl.config.groups import (
    ActorConfig,
    AgentConfig,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    SynthMathConfig,
)
from hybrid_rl.config.training import (
    AlgorithmConfig,
    CriticConfig,
    LoggerConfig,
    PreferenceConfig,
    RewardConfig,
    RewardFnConfig,
    RewardModelConfig,
    TrainerConfig,
)
from hybrid_rl.errors import ConfigError


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    rollout: RolloutConfig = MISSING
    actor: ActorConfig = MISSING
    algorithm: AlgorithmConfig = MISSING
    critic: CriticConfig = MISSING
    preference: PreferenceConfig = MISSING
    reward: RewardConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING


def register_configs() -> None:
    """Register the root schema and one schema per group (``<group>/schema``)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in {
        "model": ModelConfig,
        "data": DataConfig,
        "rollout": RolloutConfig,
        "actor": ActorConfig,
        "algorithm": AlgorithmConfig,
        "critic": CriticConfig,
        "preference": PreferenceConfig,
        "reward": RewardConfig,
        "trainer": TrainerConfig,
        "logger": LoggerConfig,
    }.items():
        cs.store(group=group, name="schema", node=node)


def resolve_precision(cfg: Config, device_type: str) -> str:
    """Replace ``auto`` in ``actor.param_dtype`` and ``rollout.dtype`` with what this hardware
    computes natively (:func:`hybrid_rl.env.auto_dtype`), in place, so the run's logged config says
    what ran; returns a one-line summary. Explicit values are kept."""
    from hybrid_rl.env import auto_dtype, cpu_bf16_support

    native = auto_dtype(device_type)
    if cfg.actor.param_dtype == "auto":
        cfg.actor.param_dtype = None if native == "float32" else native
    if cfg.rollout.dtype == "auto":
        cfg.rollout.dtype = native
    why = "CUDA" if device_type == "cuda" else f"CPU {cpu_bf16_support() or 'with no bf16 matrix unit'}"
    return f"precision: train compute {cfg.actor.param_dtype or 'float32'}, rollout {cfg.rollout.dtype} ({why}); masters fp32"


# The cross-field checks live in checks.py; they and the error they raise are part of
# this module's interface (``from hybrid_rl.config import ConfigError, validate``).
__all__ = [
    "LOSS_AGG_MODES", "ActorConfig", "AgentConfig", "AlgorithmConfig", "Config", "ConfigError", "CriticConfig", "DataConfig",
    "LoggerConfig", "ModelConfig", "PreferenceConfig", "RewardConfig", "RewardFnConfig", "RewardModelConfig", "RolloutConfig",
    "SynthMathConfig", "TrainerConfig", "register_configs", "resolve_precision", "validate",
]  # fmt: skip
