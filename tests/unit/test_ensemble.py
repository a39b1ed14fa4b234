"""Reward-model ensembles (hybrid_rl/rewards/ensemble.py) against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.rewards.ensemble import batch_moments, ensemble_reward, standardize

pytestmark = pytest.mark.unit

# 3 models x 4 responses; model 2 = model 0 + 10 (a Bradley-Terry offset), model 1 disagrees on response 3.
S = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, -3.0], [10.0, 11.0, 12.0, 13.0]])


def test_raw_reductions_are_mean_min_and_mean_minus_variance():
    assert torch.allclose(ensemble_reward(S, "mean", normalize=False), S.mean(0))
    assert torch.equal(ensemble_reward(S, "min", normalize=False), torch.tensor([0.0, 1.0, 2.0, -3.0]))
    col = S[:, 3]
    want = col.mean() - 0.5 * ((col - col.mean()) ** 2).mean()
    assert ensemble_reward(S, "uwo", var_coef=0.5, normalize=False)[3] == pytest.approx(float(want))
    # responses where the models agree (after their offsets) lose nothing to the variance term
    assert ensemble_reward(S[[0, 2]], "uwo", normalize=True)[0] == pytest.approx(float(standardize(S[[0]])[0, 0]), abs=1e-5)


def test_normalising_removes_each_models_offset_so_min_is_not_the_lowest_offset_model():
    z = standardize(S)
    assert torch.allclose(z[0], z[2], atol=1e-5)  # an offset alone changes nothing
    assert torch.allclose(z.mean(1), torch.zeros(3), atol=1e-6) and torch.allclose(z.std(1, unbiased=False), torch.ones(3), atol=1e-5)
    raw_min = ensemble_reward(S, "min", normalize=False)
    assert torch.equal(raw_min[:3], S[0, :3])  # without normalising, model 2 (offset +10) never counts
    norm_min = ensemble_reward(S, "min")
    assert norm_min.argmin() == 3 and norm_min[3] == pytest.approx(float(z[1, 3]))  # the flagged response scores lowest


def test_moments_summed_over_ranks_give_the_global_standardisation():
    """Two ranks' halves, moments added (what the all-reduce does), equal one rank with the whole batch."""
    a, b = S[:, :2], S[:, 2:]
    total = tuple(x + y for x, y in zip(batch_moments(a), batch_moments(b), strict=True))
    assert torch.allclose(torch.cat([standardize(a, total), standardize(b, total)], 1), standardize(S), atol=1e-5)
    assert not torch.allclose(standardize(a), standardize(S)[:, :2])  # per-rank statistics would differ


def test_one_model_passes_through_and_bad_input_is_named():
    assert torch.equal(ensemble_reward(S[:1], "min"), S[0])
    with pytest.raises(ValueError, match="models, responses"):
        ensemble_reward(S[0])
    with pytest.raises(KeyError, match="unknown reward-model ensemble reduction 'max'; known: mean, min, uwo"):
        ensemble_reward(S, "max")
