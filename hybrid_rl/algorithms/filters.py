"""Sample filters applied between reward and advantage: pure functions of scores and group ids."""

from __future__ import annotations

import math

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


def whole_groups(group_ids: list[int], cap: int, world_size: int) -> int:
    """How many leading rows to use: whole groups only, at most ``cap`` rows, a multiple of
    ``world_size`` (each rank trains on the same number of rows). ``group_ids`` runs in
    contiguous groups; a group cut short would get its advantages from a partial group."""
    take = best = 0
    i = 0
    while i < len(group_ids):
        j = i
        while j < len(group_ids) and group_ids[j] == group_ids[i]:
            j += 1
        if take + (j - i) > cap:
            break
        take += j - i
        if take % world_size == 0:
            best = take
        i = j
    return best


def refill_prompts(missing: int, drawn: int, informative: int, batch: int, ranks: int, margin: float) -> int:
    """Prompts for DAPO's next generation round when only the ``missing`` groups are drawn for.

    DAPO and verl draw a whole batch each round and drop the informative groups past the batch
    (about 12 of 32 per step in the default job). This draws
    ``ceil(missing / (informative / drawn) * margin)`` prompts, ``informative`` of the ``drawn``
    so far having varied, rounded up to a multiple of ``ranks`` and at most ``batch``; a whole
    batch while nothing has varied yet. Each round's draw is a function of the rewards, so a
    resumed run draws the same prompts.
    """
    if informative <= 0:
        return batch
    want = math.ceil(missing * drawn / informative * margin)
    return min(batch, max(ranks, math.ceil(want / ranks) * ranks))


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    r"""DAPO soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward ``[B]``.

    .. math::
        R_{len}(y) = \begin{cases} 0 & |y| \le L_{max} - L_{buf} \\
        \frac{(L_{max} - L_{buf}) - |y|}{L_{buf}} & L_{max} - L_{buf} < |y| \le L_{max} \\
        -1 & |y| > L_{max} \end{cases}

    times ``factor``. ``buffer = 0`` disables it.
    """
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    start = max_len - buffer
    pen = ((start - lengths.float()) / buffer).clamp(min=-1.0, max=0.0)
    pen = torch.where(lengths > max_len, torch.full_like(pen, -1.0), pen)
    return pen * factor
