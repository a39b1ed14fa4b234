"""Sample filters applied between reward and advantage: pure functions of scores and group ids."""

from __future__ import annotations

import torch
from torch import Tensor


def informative_groups(scores: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """DAPO dynamic sampling (Yu et al. 2025, §3.2): keep groups whose rewards are not all equal.

    A group whose G rewards are identical has zero group-relative advantage for every sample,
    so it adds no gradient, only tokens to the loss normaliser. Returns a bool mask ``[B]``.
    """
    _, inv = torch.unique(group_ids, return_inverse=True)
    n = int(inv.max()) + 1 if inv.numel() else 0
    hi = torch.full((n,), -torch.inf).scatter_reduce(0, inv, scores, "amax")
    lo = torch.full((n,), torch.inf).scatter_reduce(0, inv, scores, "amin")
    return (hi - lo > eps)[inv]
