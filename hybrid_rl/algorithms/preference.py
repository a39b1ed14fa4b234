"""Preference losses: DPO and reward-model training (pairwise, margin, listwise). Pure tensor functions.

Shapes: N pairs (or lists), scalar sequence quantities per response.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def dpo_loss(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float
) -> tuple[Tensor, Tensor, Tensor]:
    r"""DPO (Rafailov et al. 2023, eq. 7), sigmoid loss, per pair ``[N]``.

    .. math::
        \mathcal L = -\log\sigma\Big(\beta\big[(\log\pi_\theta(y_w|x) - \log\pi_{ref}(y_w|x))
                     - (\log\pi_\theta(y_l|x) - \log\pi_{ref}(y_l|x))\big]\Big)

    Inputs are sequence log-probs (summed over response tokens). Returns the loss and the
    implicit rewards :math:`\beta(\log\pi_\theta - \log\pi_{ref})` of chosen and rejected.
    """
    chosen_reward = beta * (policy_chosen - ref_chosen)
    rejected_reward = beta * (policy_rejected - ref_rejected)
    return -F.logsigmoid(chosen_reward - rejected_reward), chosen_reward.detach(), rejected_reward.detach()


def pairwise_rm_loss(r_chosen: Tensor, r_rejected: Tensor) -> Tensor:
    r"""Bradley-Terry pairwise loss (Ouyang et al. 2022, eq. 1): :math:`-\log\sigma(r_w - r_l)`, per pair."""
    return -F.logsigmoid(r_chosen - r_rejected)


def margin_rm_loss(r_chosen: Tensor, r_rejected: Tensor, margin: float = 1.0) -> Tensor:
    r"""Margin (hinge) ranking loss: :math:`\max(0, m - (r_w - r_l))`, per pair."""
    return torch.clamp(margin - (r_chosen - r_rejected), min=0.0)


def listwise_rm_loss(scores: Tensor, ranks: Tensor, temperature: float = 1.0) -> Tensor:
    r"""Listwise softmax cross-entropy (ListNet top-one, Cao et al. 2007), per list ``[N]``.

    ``scores [N, K]`` are the model's rewards for K responses; ``ranks [N, K]`` their true ranks
    (0 = best). The target is the softmax of :math:`-\mathrm{rank}/T`, so better ranks get more
    mass; the loss is :math:`-\sum_k p_k \log\mathrm{softmax}(r)_k`.
    """
    target = torch.softmax(-ranks.float() / temperature, dim=-1)
    return -(target * torch.log_softmax(scores, dim=-1)).sum(-1)
