"""The algorithm's typed sections, owned by the functions that read them.

Each estimator or policy loss with parameters declares them as a small dataclass when it
registers (``@register_adv_est("gae", needs=("critic",), params=GAEParams)``); the trainer binds
it from the ``algorithm`` config with :func:`hybrid_rl.algorithms.registry.bind_params` and the
function receives that object, never the config. A params field is named after an ``algorithm``
key: a plain value (``algorithm.gamma``) or a whole section (``algorithm.gfpo``).

The sections below group ``algorithm``'s keys by concern (``algorithm.kl_loss.coef``,
``algorithm.filter_groups.enable``); :class:`hybrid_rl.config.AlgorithmConfig` composes them, as
it composes the agent's :class:`hybrid_rl.rollout.settings.AgentSettings`. Defined here, below
the config layer, because the functions that read them must not import the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class KLEstimator(StrEnum):
    """Schulman's k1/k2/k3 estimators of KL(pi || ref) and |log r| (:mod:`hybrid_rl.algorithms.kl`)."""

    k1 = "k1"
    k2 = "k2"
    k3 = "k3"
    abs = "abs"


class KLControl(StrEnum):
    fixed = "fixed"
    adaptive = "adaptive"


class GFPOMetric(StrEnum):
    length = "length"
    reward_per_token = "reward_per_token"


class TISMode(StrEnum):
    none = "none"
    token = "token"
    sequence = "sequence"


class FilterMetric(StrEnum):
    """What DAPO's dynamic sampling compares within a group: ``acc`` (the verifier's score, as
    DAPO and verl's ``filter_groups.metric=acc``) or ``score`` (the shaped training reward)."""

    acc = "acc"
    score = "score"


class FilterRefill(StrEnum):
    """How many prompts DAPO's dynamic sampling draws in each round after the first: ``full`` (a
    whole data.train_batch_size, as DAPO and verl) or ``missing`` (:func:`~hybrid_rl.algorithms.
    filters.refill_prompts`: the groups still missing over the share of informative groups so far)."""

    full = "full"
    missing = "missing"


# ---------------------------------------------------------------- sections of `algorithm`
@dataclass
class KLLossSettings:
    """KL(pi || ref) as a loss term, GRPO style (``algorithm.kl_loss``)."""

    enable: bool = False
    coef: float = 0.001
    # Estimator of the per-token KL (Schulman 2020): k1 | k2 | k3 | abs.
    type: KLEstimator = KLEstimator.k3


@dataclass
class KLRewardSettings:
    """KL to the reference folded into the token reward, RLHF-PPO style (``algorithm.kl_reward``)."""

    enable: bool = False
    # Estimator of the per-token KL: k1 | k2 | k3 | abs.
    penalty: KLEstimator = KLEstimator.k1
    coef: float = 0.001
    # fixed | adaptive (Ziegler et al. 2019: aims at `target` over `horizon` samples).
    ctrl: KLControl = KLControl.fixed
    target: float = 0.1
    horizon: int = 10000


@dataclass
class FilterGroupsSettings:
    """DAPO dynamic sampling (``algorithm.filter_groups``; verl's ``algorithm.filter_groups``):
    drop groups whose rewards are all equal and draw more prompts until data.train_batch_size x
    rollout.n samples are kept, for at most ``max_gen_rounds`` batches."""

    enable: bool = False
    max_gen_rounds: int = 3
    # What a group must vary in to be kept: acc (the verifier's 0/1 score, as DAPO and verl's
    # filter_groups.metric=acc) | score (the shaped training reward: overlong penalty, learned reward).
    metric: FilterMetric = FilterMetric.acc
    # Prompts drawn in each round after the first: full (a whole data.train_batch_size, as DAPO and
    # verl; informative groups past the batch are generated and dropped) | missing (the groups still
    # missing / the informative share so far x refill_margin, at most a whole batch: less generation
    # thrown away, the odd extra round when a refill falls short).
    refill: FilterRefill = FilterRefill.full
    # refill=missing draws this many times the expected need (>= 1). At 1.25 a third round ran in
    # 24 of the default job's 250 steps (the share estimated from one round is itself noisy).
    refill_margin: float = 1.25


@dataclass
class OverlongSettings:
    """DAPO overlong reward shaping (``algorithm.overlong``): responses within ``buffer`` tokens of
    rollout.max_response_length lose up to ``penalty_factor`` linearly (buffer 0 = off);
    ``mask_truncated`` drops responses cut at the length limit from the loss."""

    buffer: int = 0
    penalty_factor: float = 1.0
    mask_truncated: bool = False


@dataclass
class GFPOSettings:
    """GFPO (``algorithm.gfpo``): keep the best ``keep`` answers of each group by ``metric``
    (length | reward_per_token)."""

    keep: int = 4
    metric: GFPOMetric = GFPOMetric.length


@dataclass
class TISSettings:
    """Truncated importance sampling between rollout-engine and trainer log-probs
    (``algorithm.tis``): mode none | token | sequence, weights capped at ``cap``."""

    mode: TISMode = TISMode.none
    cap: float = 2.0


# ---------------------------------------------------------------- declared parameters
@dataclass
class GroupNormParams:
    """GRPO: divide by the group's std (False = Dr.GRPO)."""

    norm_adv_by_std: bool = True


@dataclass
class ReturnParams:
    """Discounted token returns (REINFORCE++)."""

    gamma: float = 1.0


@dataclass
class GAEParams:
    """GAE's discount and lambda (Schulman et al. 2016)."""

    gamma: float = 1.0
    lam: float = 1.0


@dataclass
class GFPOParams:
    norm_adv_by_std: bool = True
    gfpo: GFPOSettings = field(default_factory=GFPOSettings)


@dataclass
class ClipParams:
    """PPO's clip range [1 - low, 1 + high] and the dual-clip bound c (Ye et al. 2020; None = off)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0


# ---------------------------------------------------------------- what the composed losses read
class ActorLossSettings(Protocol):
    """The part of the ``algorithm`` config the actor's loss reads (``AlgorithmConfig`` has it):
    the policy loss by name (its declared params are bound from the same section), the entropy
    bonus, the KL loss and TIS."""

    policy_loss: str
    entropy_coeff: float
    kl_loss: KLLossSettings
    tis: TISSettings


class CriticLossSettings(Protocol):
    """The part of the ``critic`` config the value loss reads (``CriticConfig`` has it)."""

    cliprange_value: float | None
    value_loss_coef: float
