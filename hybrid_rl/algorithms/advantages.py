"""Advantage estimators: pure functions of reward tensors, registered by name.

Every estimator has the signature ``fn(inp: AdvantageInputs, params) -> (advantages, returns)``
with both outputs ``[B, R]`` and zero outside ``response_mask``. ``params`` is the dataclass the
estimator declared when it registered (:mod:`hybrid_rl.algorithms.params`), or None. Sequence-level estimators use the
sequence score ``s_i = sum_t token_rewards[i, t]``, which equals the verifier's score unless a
KL penalty was folded into the token rewards.

Shapes: B samples, R response tokens, G samples per prompt (group), ``group_ids [B]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from hybrid_rl.algorithms.params import GAEParams, GFPOParams, GroupNormParams, ReturnParams
from hybrid_rl.algorithms.registry import register_adv_est


class AdvantageInputs(NamedTuple):
    token_rewards: Tensor  # [B, R] reward per token (score at the last response token, minus KL)
    response_mask: Tensor  # [B, R] 1 on trained tokens
    group_ids: Tensor  # [B] samples with equal id answer the same prompt
    values: Tensor | None = None  # [B, R] critic V(s_t) (gae only)
    baseline_scores: Tensor | None = None  # [B] score of the greedy answer to the same prompt (remax)


def _broadcast(seq_adv: Tensor, mask: Tensor) -> Tensor:
    return seq_adv[:, None] * mask


def group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group mean, unbiased group std and group size. Shapes ``[B]``."""
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n = counts.to(scores.dtype)
    sums = torch.zeros_like(n).index_add_(0, inv, scores)
    mean = sums / n
    sq = torch.zeros_like(n).index_add_(0, inv, (scores - mean[inv]) ** 2)
    std = torch.where(n > 1, (sq / (n - 1).clamp(min=1)).sqrt(), torch.zeros_like(n))
    return mean[inv], std[inv], n[inv]


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True) -> Tensor:
    """``(x - mean) / std`` over the positions where ``mask`` is 1 (unbiased variance)."""
    n = mask.sum().clamp(min=1)
    mean = (x * mask).sum() / n
    var = (((x - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


@register_adv_est("grpo", needs=("group",), params=GroupNormParams)
def grpo(inp: AdvantageInputs, params: GroupNormParams) -> tuple[Tensor, Tensor]:
    r"""GRPO group-relative advantage (Shao et al. 2024, DeepSeekMath, eq. 3).

    .. math:: \hat A_{i,t} = \frac{s_i - \mathrm{mean}(s_{g(i)})}{\mathrm{std}(s_{g(i)}) + \epsilon}

    for every response token t of sample i. ``params.norm_adv_by_std=False`` drops the division
    (Dr.GRPO, Liu et al. 2025). The std is the unbiased sample std, as in verl; a group whose
    rewards are all equal gets advantage 0.
    """
    scores = (inp.token_rewards * inp.response_mask).sum(-1)
    mean, std, _ = group_stats(scores, inp.group_ids)
    adv = scores - mean
    if params.norm_adv_by_std:
        adv = adv / (std + 1e-6)
    out = _broadcast(adv, inp.response_mask)
    return out, out


@register_adv_est("drgrpo", needs=("group",))
def drgrpo(inp: AdvantageInputs, params: None) -> tuple[Tensor, Tensor]:
    r"""Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): :math:`s_i - \mathrm{mean}(s_g)`.

    Pair it with ``loss_agg_mode=seq-mean-token-sum-norm`` to remove the length bias as well.
    """
    scores = (inp.token_rewards * inp.response_mask).sum(-1)
    mean, _, _ = group_stats(scores, inp.group_ids)
    out = _broadcast(scores - mean, inp.response_mask)
    return out, out


@register_adv_est("rloo", needs=("group",))
def rloo(inp: AdvantageInputs, params: None) -> tuple[Tensor, Tensor]:
    r"""RLOO leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024).

    .. math:: \hat A_i = s_i - \frac{1}{G-1}\sum_{j \ne i} s_j = \frac{G}{G-1}(s_i - \bar s_g)
    """
    scores = (inp.token_rewards * inp.response_mask).sum(-1)
    mean, _, n = group_stats(scores, inp.group_ids)
    adv = torch.where(n > 1, (scores - mean) * n / (n - 1).clamp(min=1), torch.zeros_like(scores))
    out = _broadcast(adv, inp.response_mask)
    return out, out


@register_adv_est("reinforce")
def reinforce(inp: AdvantageInputs, params: None) -> tuple[Tensor, Tensor]:
    r"""REINFORCE with a baseline (Williams 1992): :math:`\hat A_i = s_i - \bar s` (batch mean).

    The seed text's "baseline" is any action-independent b(s); the batch mean is the simplest
    unbiased-enough choice for a single step (a running mean would carry state across steps).
    """
    scores = (inp.token_rewards * inp.response_mask).sum(-1)
    out = _broadcast(scores - scores.mean(), inp.response_mask)
    return out, out


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    r""":math:`G_t = \sum_{k \ge t} \gamma^{k-t} r_k` over masked positions (masked tokens pass through)."""
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        running = torch.where(m > 0, token_rewards[:, t] + gamma * running, running)
        out[:, t] = running * m
    return out


@register_adv_est("reinforce_pp", params=ReturnParams)
def reinforce_pp(inp: AdvantageInputs, params: ReturnParams) -> tuple[Tensor, Tensor]:
    r"""REINFORCE++ (Hu 2025): token returns, whitened over the whole batch.

    .. math:: G_t = \sum_{k \ge t}\gamma^{k-t} r_k,\quad \hat A_t = \frac{G_t - \mu_{batch}}{\sigma_{batch}}

    with :math:`r_k` the token rewards (score at the end, minus the per-token KL penalty when
    ``algorithm.kl_reward.enable``). Mean and std run over every valid token of the batch.
    """
    returns = discounted_returns(inp.token_rewards, inp.response_mask, params.gamma)
    return masked_whiten(returns, inp.response_mask), returns


@register_adv_est("reinforce_pp_baseline", needs=("group",))
def reinforce_pp_baseline(inp: AdvantageInputs, params: None) -> tuple[Tensor, Tensor]:
    r"""REINFORCE++-baseline (Hu 2025): subtract the group mean score, then whiten over the batch.

    .. math:: \hat A_i = \mathrm{whiten}_{batch}(s_i - \bar s_{g(i)})
    """
    scores = (inp.token_rewards * inp.response_mask).sum(-1)
    mean, _, _ = group_stats(scores, inp.group_ids)
    adv = _broadcast(scores - mean, inp.response_mask)
    return masked_whiten(adv, inp.response_mask), adv


@register_adv_est("remax", needs=("greedy_baseline",))
def remax(inp: AdvantageInputs, params: None) -> tuple[Tensor, Tensor]:
    r"""ReMax (Li et al. 2023): the greedy answer's reward is the baseline.

    .. math:: \hat A_i = s_i - s(\text{greedy}(x_i))

    ``baseline_scores [B]`` must hold, for each sample, the score of the greedy response to its prompt.
    """
    if inp.baseline_scores is None:
        raise ValueError("remax needs baseline_scores (the greedy response's reward per prompt)")
    scores = (inp.token_rewards * inp.response_mask).sum(-1)
    out = _broadcast(scores - inp.baseline_scores, inp.response_mask)
    return out, out


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    r"""Generalised advantage estimation (Schulman et al. 2016), computed backwards.

    .. math::
        \delta_t = r_t + \gamma V(s_{t+1}) - V(s_t),\qquad
        \hat A_t = \delta_t + \gamma\lambda \hat A_{t+1},\qquad \text{returns}_t = \hat A_t + V(s_t)

    The episode ends after the last valid token, so :math:`V(s_{T+1}) = 0` there (terminal, no
    bootstrap). Masked positions inside a response (tool output in multi-turn) are skipped: the
    next value and the running advantage pass through them unchanged. Shapes ``[B, R]``.
    """
    b, r = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(b, dtype=rewards.dtype, device=rewards.device)
    running = torch.zeros_like(next_value)
    for t in reversed(range(r)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        new_running = delta + gamma * lam * running
        running = torch.where(m > 0, new_running, running)
        next_value = torch.where(m > 0, values[:, t], next_value)
        adv[:, t] = running * m
    returns = (adv + values) * mask
    return adv, returns


@register_adv_est("gae", needs=("critic",), params=GAEParams)
def gae(inp: AdvantageInputs, params: GAEParams) -> tuple[Tensor, Tensor]:
    """PPO's GAE with a critic; advantages are whitened over the batch (returns are not)."""
    if inp.values is None:
        raise ValueError("gae needs values from a critic (set critic.enable=true)")
    adv, returns = gae_advantages(inp.token_rewards, inp.values, inp.response_mask, params.gamma, params.lam)
    return masked_whiten(adv, inp.response_mask), returns


def gfpo_keep_mask(scores: Tensor, lengths: Tensor, group_ids: Tensor, keep: int, metric: str) -> Tensor:
    """GFPO filter: in each group keep the ``keep`` best samples by ``metric`` (bool ``[B]``).

    ``length``: shortest responses first; ``reward_per_token``: highest ``score / length`` first
    (ties broken by position, so the result is deterministic).
    """
    if metric == "length":
        key = lengths.float()
    elif metric == "reward_per_token":
        key = -scores / lengths.clamp(min=1).float()
    else:
        raise ValueError(f"unknown gfpo metric {metric!r}; known: length, reward_per_token")
    mask = torch.zeros_like(scores, dtype=torch.bool)
    for g in torch.unique(group_ids):
        idx = (group_ids == g).nonzero().squeeze(1)
        order = idx[torch.argsort(key[idx], stable=True)]
        mask[order[:keep]] = True
    return mask


@register_adv_est("gfpo", needs=("group",), params=GFPOParams)
def gfpo(inp: AdvantageInputs, params: GFPOParams) -> tuple[Tensor, Tensor]:
    r"""GFPO (Shrivastava et al. 2025, "Sample More to Think Less"): group filtering.

    Sample a larger group, keep the ``params.gfpo.keep`` responses that rank best by
    ``params.gfpo.metric``, and compute GRPO advantages with the kept subset's mean and std:

    .. math:: \hat A_i = \frac{s_i - \mathrm{mean}(s_{\mathcal K})}{\mathrm{std}(s_{\mathcal K})} [i \in \mathcal K],\qquad 0 \text{ otherwise}
    """
    scores = (inp.token_rewards * inp.response_mask).sum(-1)
    lengths = inp.response_mask.sum(-1)
    keep = gfpo_keep_mask(scores, lengths, inp.group_ids, params.gfpo.keep, params.gfpo.metric)
    kept_groups = torch.where(keep, inp.group_ids, torch.full_like(inp.group_ids, -1))
    mean, std, _ = group_stats(scores, kept_groups)
    adv = (scores - mean) / (std + 1e-6) if params.norm_adv_by_std else scores - mean
    adv = torch.where(keep, adv, torch.zeros_like(adv))
    out = _broadcast(adv, inp.response_mask)
    return out, out
