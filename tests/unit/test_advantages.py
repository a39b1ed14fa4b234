"""Advantage estimators against hand-computed tensors and plain-loop reference implementations."""

from types import SimpleNamespace

import pytest
import torch

from hybrid_rl.algorithms.advantages import AdvantageInputs, gae_advantages, group_stats, masked_whiten
from hybrid_rl.algorithms.kl import kl_in_reward
from hybrid_rl.algorithms.params import GFPOParams, GFPOSettings
from hybrid_rl.algorithms.registry import ADV_ESTIMATORS

pytestmark = pytest.mark.unit
CFG = SimpleNamespace(norm_adv_by_std=True, gamma=1.0, lam=1.0)  # every estimator's declared params read from it


def inputs(scores, groups, lengths, r=4, values=None, baseline=None):
    mask = torch.zeros(len(scores), r)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    rewards = kl_in_reward(torch.tensor(scores, dtype=torch.float32), mask, None, 0.0)
    return AdvantageInputs(rewards, mask, torch.tensor(groups), values, baseline)


def test_grpo_hand_computed():
    # group 0: scores 1, 0 -> mean .5, unbiased std .7071; group 1: 1, 1 -> 0 advantage
    inp = inputs([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], [2, 3, 1, 4])
    adv, _ = ADV_ESTIMATORS["grpo"](inp, CFG)
    s = 0.5 / (2**0.5 / 2 + 1e-6)
    expected = torch.tensor([[s, s, 0, 0], [-s, -s, -s, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(adv, expected)


def test_drgrpo_and_norm_switch_equal():
    inp = inputs([1.0, 0.0, 0.0, 3.0], [0, 0, 0, 0], [1, 1, 1, 1])
    a, _ = ADV_ESTIMATORS["drgrpo"](inp, CFG)
    b, _ = ADV_ESTIMATORS["grpo"](inp, SimpleNamespace(norm_adv_by_std=False))
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a[:, 0], torch.tensor([0.0, -1.0, -1.0, 2.0]))


def test_grpo_matches_loop_reference():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (24,), generator=g).float()
    groups = torch.arange(24) // 6
    inp = inputs(scores.tolist(), groups.tolist(), [3] * 24)
    adv, _ = ADV_ESTIMATORS["grpo"](inp, CFG)
    for i in range(24):
        peers = scores[groups == groups[i]]
        ref = (scores[i] - peers.mean()) / (peers.std() + 1e-6)
        assert adv[i, 0].item() == pytest.approx(ref.item(), abs=1e-5)


def test_rloo_leave_one_out_loop():
    scores = [1.0, 0.0, 0.5, 2.0, 1.0, 1.0]
    groups = [0, 0, 0, 1, 1, 1]
    adv, _ = ADV_ESTIMATORS["rloo"](inputs(scores, groups, [1] * 6), CFG)
    for i in range(6):
        others = [scores[j] for j in range(6) if groups[j] == groups[i] and j != i]
        assert adv[i, 0].item() == pytest.approx(scores[i] - sum(others) / len(others), abs=1e-6)


def test_reinforce_batch_mean_baseline():
    adv, _ = ADV_ESTIMATORS["reinforce"](inputs([1.0, 0.0, 0.5], [0, 1, 2], [1, 2, 1]), CFG)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5, 0.0]))
    assert adv[1, 1].item() == pytest.approx(-0.5)


def test_remax_greedy_baseline():
    inp = inputs([1.0, 0.0], [0, 0], [2, 2], baseline=torch.tensor([1.0, 1.0]))
    adv, _ = ADV_ESTIMATORS["remax"](inp, CFG)
    torch.testing.assert_close(adv[:, :2], torch.tensor([[0.0, 0.0], [-1.0, -1.0]]))
    with pytest.raises(ValueError, match="baseline"):
        ADV_ESTIMATORS["remax"](inputs([1.0], [0], [1]), CFG)


def test_reinforce_pp_returns_and_global_whitening():
    # gamma=1: return at every token = final score; whiten over all valid tokens
    inp = inputs([1.0, 0.0], [0, 1], [2, 2])
    adv, returns = ADV_ESTIMATORS["reinforce_pp"](inp, CFG)
    torch.testing.assert_close(returns[:, :2], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    valid = adv[inp.response_mask > 0]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-3)


def test_reinforce_pp_baseline_subtracts_group_mean_first():
    inp = inputs([1.0, 0.0, 5.0, 5.0], [0, 0, 1, 1], [1, 1, 1, 1])
    adv, raw = ADV_ESTIMATORS["reinforce_pp_baseline"](inp, CFG)
    torch.testing.assert_close(raw[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    assert adv[2, 0].item() == pytest.approx(0.0, abs=1e-6)


def gae_loop(rewards, values, mask, gamma, lam):
    """Plain per-sequence reference: skip masked tokens, terminal value 0."""
    b, r = rewards.shape
    adv = torch.zeros(b, r)
    for i in range(b):
        idx = [t for t in range(r) if mask[i, t] > 0]
        running, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[i, t] + gamma * next_v - values[i, t]
            running = delta + gamma * lam * running
            adv[i, t] = running
            next_v = values[i, t]
    return adv


def test_gae_hand_computed_terminal():
    # one sequence of 3 tokens, reward 1 at the end, V = [.5, .6, .7], gamma=.9, lam=.8
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    m = torch.ones(1, 3)
    adv, ret = gae_advantages(r, v, m, 0.9, 0.8)
    d2 = 1.0 - 0.7
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2]]))
    torch.testing.assert_close(ret, adv + v)


def test_gae_matches_loop_with_masked_tool_tokens():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(5, 9, generator=g)
    values = torch.randn(5, 9, generator=g)
    mask = (torch.rand(5, 9, generator=g) > 0.3).float()
    adv, _ = gae_advantages(rewards, values, mask, 0.95, 0.9)
    torch.testing.assert_close(adv, gae_loop(rewards, values, mask, 0.95, 0.9) * mask)


def test_group_stats_and_whiten():
    mean, std, n = group_stats(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([7, 7, 2]))
    torch.testing.assert_close(mean, torch.tensor([2.0, 2.0, 5.0]))
    torch.testing.assert_close(std, torch.tensor([2**0.5, 2**0.5, 0.0]))
    torch.testing.assert_close(n, torch.tensor([2.0, 2.0, 1.0]))
    x = torch.tensor([[1.0, 2.0, 100.0]])
    w = masked_whiten(x, torch.tensor([[1.0, 1.0, 0.0]]))
    assert w[0, 2] == 0 and w[0, 0].item() == pytest.approx(-(0.5**0.5), abs=1e-4)


def test_unknown_estimator_lists_known():
    with pytest.raises(KeyError, match="known: .*grpo"):
        ADV_ESTIMATORS["nope"]


def test_informative_groups_drops_equal_reward_groups():
    from hybrid_rl.algorithms.filters import informative_groups

    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert informative_groups(scores, groups).tolist() == [False, False, True, True, False, False, False, False]


def test_gfpo_keeps_shortest_and_uses_kept_stats():
    from hybrid_rl.algorithms.advantages import gfpo_keep_mask

    # one group of 4: lengths 3,1,2,4 and scores 1,0,1,1; keep 2 shortest -> samples 1 (0) and 2 (1)
    scores = [1.0, 0.0, 1.0, 1.0]
    inp = inputs(scores, [0, 0, 0, 0], [3, 1, 2, 4])
    keep = gfpo_keep_mask(torch.tensor(scores), inp.response_mask.sum(-1), inp.group_ids, 2, "length")
    assert keep.tolist() == [False, True, True, False]
    adv, _ = ADV_ESTIMATORS["gfpo"](inp, GFPOParams(norm_adv_by_std=True, gfpo=GFPOSettings(keep=2, metric="length")))
    s = 0.5 / (2**0.5 / 2 + 1e-6)  # kept scores 0, 1: mean .5, unbiased std .7071
    assert adv[1, 0].item() == pytest.approx(-s, abs=1e-5)
    assert adv[2, 0].item() == pytest.approx(s, abs=1e-5)
    assert adv[0].abs().sum() == 0 and adv[3].abs().sum() == 0
    # reward per token: 1/3, 0, 1/2, 1/4 -> keep samples 2 and 0
    keep = gfpo_keep_mask(torch.tensor(scores), inp.response_mask.sum(-1), inp.group_ids, 2, "reward_per_token")
    assert keep.tolist() == [True, False, True, False]


def test_overlong_penalty_matches_dapo_formula():
    from hybrid_rl.algorithms.filters import overlong_penalty

    lengths = torch.tensor([10, 16, 18, 20, 21])
    # max 20, buffer 4: no penalty up to 16, linear to -1 at 20, -1 beyond
    pen = overlong_penalty(lengths, max_len=20, buffer=4, factor=1.0)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    assert overlong_penalty(lengths, 20, 0).abs().sum() == 0
