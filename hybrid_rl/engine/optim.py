"""The optimizer and learning-rate schedule an ``actor`` config section describes."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


class OptimSettings(Protocol):
    """The part of the ``actor`` config the optimizer and its schedule read (``ActorConfig`` has it)."""

    lr: float
    weight_decay: float
    betas: list[float]
    warmup_steps: int
    lr_schedule: str
    min_lr_ratio: float
    grad_clip: float
    optimizer_impl: str

@dataclass
class OptimConfig:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    warmup_steps: int
    schedule: str
    min_lr_ratio: float
    total_steps: int
    grad_clip: float
    # AdamW kernel: "fused" (one kernel per step over all shards, no full-size temporaries),
    # "foreach" (torch's default: its step allocates temporaries the size of the shards, ~1.5x
    # the fp32 weights more at the peak; measured by benchmarks/memory_scaling.py) or
    # "bf16_moments" (engine/adamw_bf16.py: the two moments stored in bf16, half the state).
    impl: str = "fused"

    @classmethod
    def from_actor(cls, actor_cfg: OptimSettings, total_steps: int) -> OptimConfig:
        """The optimizer and schedule an ``actor`` config section describes."""
        return cls(
            lr=actor_cfg.lr,
            weight_decay=actor_cfg.weight_decay,
            betas=tuple(actor_cfg.betas),
            warmup_steps=actor_cfg.warmup_steps,
            schedule=actor_cfg.lr_schedule,
            min_lr_ratio=actor_cfg.min_lr_ratio,
            total_steps=total_steps,
            grad_clip=actor_cfg.grad_clip,
            impl=actor_cfg.optimizer_impl,
        )


def build_optimizer(params: list, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over ``params`` with the kernel ``cfg.impl`` names (see :class:`OptimConfig`)."""
    kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    if cfg.impl == "bf16_moments":
        from hybrid_rl.engine.adamw_bf16 import AdamWBf16Moments

        return AdamWBf16Moments(params, **kw)
    return torch.optim.AdamW(params, **kw, **({"fused": True} if cfg.impl == "fused" else {"foreach": True}))


def lr_lambda(cfg: OptimConfig) -> Callable[[int], float]:
    """Linear warm-up, then constant or cosine decay to ``min_lr_ratio``."""

    def fn(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "cosine":
            span = max(cfg.total_steps - cfg.warmup_steps, 1)
            progress = min((step - cfg.warmup_steps) / span, 1.0)
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    return fn
