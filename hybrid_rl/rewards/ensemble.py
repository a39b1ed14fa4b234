"""One learned reward from several reward models (``reward.reward_model.ensemble``).

Coste, Anwar, Kirk, Krueger 2024, "Reward Model Ensembles Help Mitigate Overoptimization"
(ICLR): M reward models trained the same way from different seeds disagree most where the policy
has found a flaw of one of them, so a conservative combination of their scores is harder to
over-optimise than any single one.

``scores``: ``[M, B]`` (M models, B responses) -> reward ``[B]``:

- ``mean``: ``r_b = 1/M sum_m s_mb``
- ``min`` (worst-case optimisation, WCO): ``r_b = min_m s_mb``
- ``uwo`` (uncertainty-weighted optimisation): ``r_b = mean_m s_mb - lambda Var_m s_mb``, the
  population variance over the models, ``lambda = reward.reward_model.ensemble_var_coef``.

A Bradley-Terry reward model is defined up to an offset (and, across seeds, a scale), so with
``normalize`` each model's scores are first standardised over the step's batch (all ranks),
``(s_m - mean_b s_m) / std_b s_m``: without it ``min`` would mostly pick the model with the
lowest offset. A single model (M = 1) is passed through unchanged.
"""

from __future__ import annotations

import torch

from hybrid_rl.algorithms.registry import Registry

ENSEMBLE_REDUCERS = Registry("reward-model ensemble reduction")


@ENSEMBLE_REDUCERS.register("mean")
def ensemble_mean(scores: torch.Tensor, var_coef: float = 0.0) -> torch.Tensor:
    """``[M, B] -> [B]``: the mean over models."""
    return scores.mean(0)


@ENSEMBLE_REDUCERS.register("min")
def ensemble_min(scores: torch.Tensor, var_coef: float = 0.0) -> torch.Tensor:
    """``[M, B] -> [B]``: the lowest score of any model (WCO)."""
    return scores.min(0).values


@ENSEMBLE_REDUCERS.register("uwo")
def ensemble_uwo(scores: torch.Tensor, var_coef: float = 1.0) -> torch.Tensor:
    """``[M, B] -> [B]``: mean minus ``var_coef`` times the models' (population) variance (UWO)."""
    return scores.mean(0) - var_coef * scores.var(0, unbiased=False)


def batch_moments(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[M, B]`` -> per-model ``(sum, sum of squares, count)``, ``[M]`` each: what ranks add up
    (one all-reduce) so every rank standardises with the same global mean and std."""
    n = torch.full((scores.shape[0],), float(scores.shape[1]), dtype=scores.dtype)
    return scores.sum(1), (scores * scores).sum(1), n


def standardize(scores: torch.Tensor, moments: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``[M, B]``: each model's scores to zero mean and unit (population) std, from ``moments``
    (:func:`batch_moments`, summed over ranks) or, without them, this batch's."""
    total, sq, n = moments if moments is not None else batch_moments(scores)
    mean = total / n
    std = (sq / n - mean * mean).clamp_min(0.0).sqrt()
    return (scores - mean[:, None]) / (std[:, None] + 1e-6)


def ensemble_reward(
    scores: torch.Tensor,
    reduce: str = "mean",
    var_coef: float = 1.0,
    normalize: bool = True,
    moments: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``[M, B] -> [B]``: the ensemble's reward (see the module docstring); M = 1 is returned as is."""
    if scores.dim() != 2:
        raise ValueError(f"ensemble scores must be [models, responses], got shape {tuple(scores.shape)}")
    if scores.shape[0] == 1:
        return scores[0]
    if normalize:
        scores = standardize(scores, moments)
    return ENSEMBLE_REDUCERS[reduce](scores, var_coef)
