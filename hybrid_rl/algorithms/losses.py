"""Policy losses (registered by name), loss aggregation, and the composed actor loss.

A policy loss is ``fn(logprobs, old_logprobs, advantages, response_mask, params) -> (loss [B, R],
metrics)``, with ``params`` the dataclass it declared when it registered (or None): a per-token loss, not yet reduced. Reduction is a weighted sum with weights from
:func:`agg_weights`, normalised over the *whole* mini-batch across ranks, so that splitting it
into micro-batches (and ranks) changes nothing: ``sum_micro sum_{i,t} w_{i,t} l_{i,t}``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybrid_rl.algorithms.kl import kl_estimate
from hybrid_rl.algorithms.params import ActorLossSettings, ClipParams, CriticLossSettings
from hybrid_rl.algorithms.registry import POLICY_LOSSES, bind_params, register_policy_loss
from hybrid_rl.batch import LossFn, ModelOutputs, TrainBatch


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def agg_weights(mask: Tensor, mode: str, n_tokens: float, n_seqs: float, max_len: int | None = None) -> Tensor:
    r"""Per-token weights ``[B, R]`` that turn a per-token loss into the aggregate ``sum(w * l)``.

    ``n_tokens`` / ``n_seqs`` are the mini-batch's totals over all ranks; ``max_len`` is the
    constant length of ``seq-mean-token-sum-norm``.

    ========================  =================================================  ==========================
    mode                      aggregate                                          used by
    ========================  =================================================  ==========================
    token-mean                :math:`\sum_{i,t} l_{it} / \sum_i |y_i|`           DAPO (token-level loss)
    seq-mean-token-sum        :math:`\frac1N \sum_i \sum_t l_{it}`               REINFORCE on sequences
    seq-mean-token-mean       :math:`\frac1N \sum_i \frac{1}{|y_i|}\sum_t l_{it}`  GRPO paper, GSPO
    seq-mean-token-sum-norm   :math:`\frac{1}{N L}\sum_{i,t} l_{it}`             Dr.GRPO (L constant)
    ========================  =================================================  ==========================
    """
    mask = mask.float()
    if mode == "token-mean":
        return mask / max(n_tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return mask / max(n_seqs, 1.0)
    if mode == "seq-mean-token-mean":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1) / max(n_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        length = max_len if max_len is not None else mask.shape[-1]
        return mask / (max(n_seqs, 1.0) * length)
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


def agg_loss(loss: Tensor, mask: Tensor, mode: str, max_len: int | None = None) -> Tensor:
    """Reference aggregation of a local batch (no ranks): ``sum(agg_weights * loss)``."""
    w = agg_weights(mask, mode, float(mask.sum()), float((mask.sum(-1) > 0).sum()), max_len)
    return (w * loss).sum()


@register_policy_loss("ppo_clip", params=ClipParams)
def ppo_clip(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, params: ClipParams) -> tuple[Tensor, dict]:
    r"""PPO clipped surrogate (Schulman et al. 2017) with decoupled clip and dual-clip.

    .. math::
        \rho_t = e^{\log\pi_\theta - \log\pi_{old}},\quad
        L_t = \max\big(-\hat A_t \rho_t,\; -\hat A_t\,\mathrm{clip}(\rho_t, 1-\epsilon_{low}, 1+\epsilon_{high})\big)

    Clip-higher (DAPO, Yu et al. 2025) sets :math:`\epsilon_{high} > \epsilon_{low}`. Dual-clip
    (Ye et al. 2020) bounds the loss of negative advantages by :math:`-c \hat A_t`:
    :math:`L_t = \min(L_t, -c\hat A_t)` where :math:`\hat A_t < 0`.
    """
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    loss = torch.maximum(pg1, pg2)
    metrics = {
        "actor/pg_clipfrac": masked_mean((pg2 > pg1).float(), mask),
        "actor/ppo_kl": masked_mean(-log_ratio, mask),
    }
    c = params.clip_ratio_c
    if c is not None:
        dual = torch.minimum(loss, -advantages * c)
        neg = advantages < 0
        metrics["actor/pg_clipfrac_lower"] = masked_mean((neg & (loss > -advantages * c)).float(), mask)
        loss = torch.where(neg, dual, loss)
    return loss, metrics


@register_policy_loss("gspo", params=ClipParams)
def gspo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, params: ClipParams) -> tuple[Tensor, dict]:
    r"""GSPO (Zheng et al. 2025): a sequence-level, length-normalised importance ratio, clipped per sequence.

    .. math::
        s_i(\theta) = \exp\Big(\frac{1}{|y_i|}\sum_t \log\frac{\pi_\theta(y_{i,t})}{\pi_{old}(y_{i,t})}\Big),\quad
        L_i = \max\big(-\hat A_i s_i,\; -\hat A_i\,\mathrm{clip}(s_i, 1-\epsilon_{low}, 1+\epsilon_{high})\big)

    Implemented as GSPO-token (paper eq. 13): :math:`s_{i,t} = \mathrm{sg}[s_i]\,\pi_\theta(y_{i,t})/\mathrm{sg}[\pi_\theta(y_{i,t})]`,
    which has the same value and gradient as the sequence form when advantages are per sequence.
    Aggregate with ``seq-mean-token-mean`` to get the paper's objective. The paper's clip ranges
    are tiny (3e-4, 4e-4), set by the ``gspo_math`` recipe.
    """
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    seq_ratio = torch.exp(seq_log_ratio.detach().clamp(max=10.0))[:, None]
    ratio = seq_ratio * torch.exp(logprobs - logprobs.detach())
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - params.clip_ratio_low, 1.0 + params.clip_ratio_high)
    loss = torch.maximum(pg1, pg2)
    seq_clipped = ((pg2 > pg1).float() * mask).amax(-1)
    has = (mask.sum(-1) > 0).float()
    return loss, {
        "actor/pg_clipfrac": (seq_clipped * has).sum() / has.sum().clamp(min=1),
        "actor/ppo_kl": masked_mean(-log_ratio, mask),
    }


@register_policy_loss("reinforce")
def vanilla_pg(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, params: None) -> tuple[Tensor, dict]:
    r"""Vanilla policy gradient :math:`L_t = -\hat A_t \log\pi_\theta(y_t)` (Williams 1992).

    No ratio and no clip: correct only on-policy (one optimizer step per rollout), where it has
    the same gradient as PPO's surrogate at ratio 1.
    """
    return -advantages * logprobs, {"actor/ppo_kl": masked_mean(old_logprobs - logprobs, mask)}


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, mode: str, cap: float) -> Tensor:
    r"""Truncated importance sampling for the trainer/rollout-engine mismatch (Yao et al. 2025).

    The samples come from the engine's :math:`\mu` (vLLM kernels), the loss is defined under
    the trainer's :math:`\pi_{old}`; the correction is :math:`w = \min(\pi_{old}/\mu, C)`, per
    token (``token``) or as the product over the sequence (``sequence``), detached. ``[B, R]``.
    """
    log_w = (old_logprobs - rollout_logprobs) * mask
    if mode == "token":
        w = torch.exp(log_w.clamp(max=20.0))
    elif mode == "sequence":
        w = torch.exp(log_w.sum(-1, keepdim=True).clamp(max=20.0)).expand_as(log_w)
    else:
        raise ValueError(f"tis mode must be token or sequence, got {mode!r}")
    return w.clamp(max=cap).detach()


def make_actor_loss(cfg: ActorLossSettings) -> LossFn:
    r"""The actor's full loss for ``cfg`` (the ``algorithm`` config), for the engine to minimise.

    .. math:: L = \sum_{i,t} w_{it}\big(\mathrm{TIS}_{it}\,L^{pg}_{it} - c_H H_{it} + \beta\,\mathrm{KL}^{k}_{it}\big)

    with ``w`` the mini-batch's aggregation weights (``batch.loss_weights``).
    """
    policy_loss = POLICY_LOSSES[cfg.policy_loss]
    params = bind_params(POLICY_LOSSES, cfg.policy_loss, cfg)
    kl_loss, tis = cfg.kl_loss, cfg.tis

    def loss_fn(out: ModelOutputs, mb: TrainBatch) -> tuple[Tensor, dict]:
        mask = mb.response_mask
        old = mb.old_logprobs if mb.old_logprobs is not None else out.logprobs.detach()
        pg, metrics = policy_loss(out.logprobs, old, mb.advantages, mask, params)
        if mb.old_logprobs is None and mb.rollout_logprobs is not None:
            # exactly on-policy (no separate old-log-prob pass): the train/inference mismatch here
            metrics["rollout/logprob_diff_mean"] = masked_mean((old - mb.rollout_logprobs).abs(), mask)
        if tis.mode != "none" and mb.rollout_logprobs is not None:
            w = tis_weights(old, mb.rollout_logprobs, mask, tis.mode, tis.cap)
            metrics["actor/tis_weight_mean"] = masked_mean(w, mask)
            metrics["actor/tis_clipped_frac"] = masked_mean((w >= tis.cap).float(), mask)
            pg = pg * w
        loss = pg
        metrics["actor/pg_loss"] = masked_mean(pg.detach(), mask)  # token mean; the engine weights by tokens
        if out.entropy is not None:
            metrics["actor/entropy"] = masked_mean(out.entropy.detach(), mask)
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * out.entropy
        if kl_loss.enable:
            if mb.ref_logprobs is None:
                raise ValueError("algorithm.kl_loss.enable needs reference log-probs in the batch")
            # Untruncated on both sides: a top-k/top-p policy against the full-softmax reference
            # would give a KL > 0 at identical weights.
            policy = out.kl_logprobs if out.kl_logprobs is not None else out.logprobs
            kl = kl_estimate(policy, mb.ref_logprobs, kl_loss.type)
            metrics["actor/kl_loss"] = masked_mean(kl.detach(), mask)
            loss = loss + kl_loss.coef * kl
        return (loss * mb.loss_weights).sum(), metrics

    return loss_fn


def make_sft_loss() -> LossFn:
    """Negative log-likelihood of the response tokens, aggregated by ``batch.loss_weights``."""

    def loss_fn(out: ModelOutputs, mb: TrainBatch) -> tuple[Tensor, dict]:
        nll = -out.logprobs
        return (nll * mb.loss_weights).sum(), {"sft/nll": masked_mean(nll.detach(), mb.response_mask)}

    return loss_fn


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None) -> Tensor:
    r"""PPO's clipped value loss (per token), as in OpenAI baselines / verl.

    .. math:: L^V_t = \tfrac12\max\big((V_t - R_t)^2,\ (V^{old}_t + \mathrm{clip}(V_t - V^{old}_t, -c, c) - R_t)^2\big)

    ``clip=None`` gives the plain squared error.
    """
    err = (values - returns) ** 2
    if clip is None:
        return 0.5 * err
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum(err, (clipped - returns) ** 2)


def make_critic_loss(cfg: CriticLossSettings) -> LossFn:
    """The critic's loss for the ``critic`` config: clipped value loss times ``value_loss_coef``."""

    def loss_fn(out: ModelOutputs, mb: TrainBatch) -> tuple[Tensor, dict]:
        mask = mb.response_mask
        loss = clipped_value_loss(out.values, mb.values, mb.returns, cfg.cliprange_value)
        clip_frac = ((out.values - mb.values).abs() > (cfg.cliprange_value or float("inf"))).float()
        metrics = {
            "critic/vf_loss": masked_mean(loss.detach(), mask),
            "critic/clip_frac": masked_mean(clip_frac, mask),
            "critic/values": masked_mean(out.values.detach(), mask),
        }
        return (cfg.value_loss_coef * loss * mb.loss_weights).sum(), metrics

    return loss_fn
