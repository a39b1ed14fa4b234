r"""KL estimators between the policy and the reference, and the KL coefficient controllers.

With :math:`\log r = \log\pi_{ref}(y_t) - \log\pi_\theta(y_t)` on tokens sampled from
:math:`\pi_\theta` (Schulman 2020, "Approximating KL Divergence"):

- k1 :math:`= -\log r` — unbiased, high variance, can be negative; used in the reward (RLHF-PPO).
- k2 :math:`= \tfrac12 (\log r)^2` — low variance, biased.
- k3 :math:`= r - 1 - \log r` — unbiased, always >= 0; GRPO puts it in the loss (DeepSeekMath eq. 4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from hybrid_rl.algorithms.params import KLRewardSettings

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3", clamp: float = 20.0) -> Tensor:
    """Per-token KL estimate ``[B, R]``. ``clamp`` bounds log r so k3's exp cannot overflow.

    k3 is also clamped to ``[-10, 10]`` as verl's ``low_var_kl``: one token whose reference
    log-prob is far below the policy's (log r = -20 gives k3 ~ 19) would otherwise dominate the
    KL term of a whole batch; its gradient is cut beyond the bound.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-clamp, clamp)
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return (torch.exp(log_ratio) - 1 - log_ratio).clamp(-10.0, 10.0)
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")


def kl_in_reward(scores: Tensor, response_mask: Tensor, kl: Tensor | None, coef: float) -> Tensor:
    r"""Token rewards ``[B, R]``: the sequence score on the last response token, minus :math:`\beta\,\mathrm{KL}_t`.

    .. math:: r_t = s\,[t = T] - \beta\, \mathrm{KL}_t   \quad(\text{Ziegler et al. 2019; Ouyang et al. 2022})
    """
    rewards = torch.zeros_like(response_mask, dtype=scores.dtype)
    lengths = response_mask.sum(-1)
    has = lengths > 0
    # Last trained token: highest index with mask 1.
    idx = torch.arange(response_mask.shape[1], device=response_mask.device)
    last = torch.where(response_mask > 0, idx, torch.full_like(idx, -1)).max(-1).values.clamp(min=0)
    rewards[has, last[has]] = scores[has]
    if kl is not None and coef:
        rewards = rewards - coef * kl * response_mask
    return rewards


@dataclass
class FixedKLController:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        return None


@dataclass
class AdaptiveKLController:
    r"""Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences", §2.2).

    .. math:: e = \mathrm{clip}(\mathrm{KL}/\mathrm{KL}_{target} - 1, -0.2, 0.2),\quad
              \beta \leftarrow \beta\,(1 + e \cdot n / H)
    """

    value: float
    target: float
    horizon: int

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):  # NaN passes min/max and would be checkpointed: keep beta
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(kl: KLRewardSettings) -> FixedKLController | AdaptiveKLController:
    """The coefficient of the KL folded into the reward (``algorithm.kl_reward``)."""
    if kl.ctrl == "fixed":
        return FixedKLController(kl.coef)
    if kl.ctrl == "adaptive":
        return AdaptiveKLController(kl.coef, kl.target, kl.horizon)
    raise ValueError(f"algorithm.kl_reward.ctrl={kl.ctrl!r} must be fixed or adaptive")
