"""Policy losses, KL estimators and aggregation modes against hand-computed values and loops."""

import math
from types import SimpleNamespace

import pytest
import torch

from hybrid_rl.algorithms.kl import AdaptiveKLController, kl_estimate, kl_in_reward
from hybrid_rl.algorithms.losses import agg_loss, agg_weights, make_actor_loss, tis_weights
from hybrid_rl.algorithms.params import KLLossSettings, TISSettings
from hybrid_rl.algorithms.registry import POLICY_LOSSES
from hybrid_rl.batch import ModelOutputs, TrainBatch

pytestmark = pytest.mark.unit
PPO = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def test_ppo_clip_hand_computed():
    old = torch.zeros(1, 4)
    # ratios 1.5, 0.5, 1.1, 5.0
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 5.0]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, m = POLICY_LOSSES["ppo_clip"](new, old, adv, mask, PPO)
    # t0: A>0, ratio 1.5 clipped to 1.28 -> max(-1.5, -1.28) = -1.28
    # t1: A>0, ratio .5 -> max(-.5, -.8) = -.5
    # t2: A<0, ratio 1.1 -> max(1.1, 1.1) = 1.1
    # t3: A<0, ratio 5 -> max(5, 1.28) = 5, dual clip min(5, 3) = 3
    torch.testing.assert_close(loss, torch.tensor([[-1.28, -0.5, 1.1, 3.0]]))
    assert m["actor/pg_clipfrac"].item() == pytest.approx(0.25)  # only t0 is clipped (pg2 > pg1)
    assert m["actor/pg_clipfrac_lower"].item() == pytest.approx(0.25)


def test_ppo_clip_matches_loop():
    g = torch.Generator().manual_seed(0)
    new, old, adv = torch.randn(3, 5, generator=g) * 0.3, torch.randn(3, 5, generator=g) * 0.3, torch.randn(3, 5, generator=g)
    loss, _ = POLICY_LOSSES["ppo_clip"](new, old, adv, torch.ones(3, 5), PPO)
    for i in range(3):
        for t in range(5):
            r = math.exp(new[i, t] - old[i, t])
            a = adv[i, t].item()
            ref = max(-a * r, -a * min(max(r, 0.8), 1.28))
            if a < 0:
                ref = min(ref, -a * 3.0)
            assert loss[i, t].item() == pytest.approx(ref, abs=1e-5)


def test_gspo_sequence_ratio_and_gradient():
    cfg = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.2)
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.3, 0.0, -0.6], [0.1, 0.1, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    loss, _ = POLICY_LOSSES["gspo"](new, old, adv, mask, cfg)
    s0 = math.exp((0.3 + 0.0 - 0.6) / 3)  # 0.905: inside the clip range
    s1 = math.exp(0.2 / 2)  # 1.105: inside
    assert loss[0, 0].item() == pytest.approx(-s0, abs=1e-6)
    assert loss[1, 1].item() == pytest.approx(s1, abs=1e-6)
    # seq-mean-token-mean aggregation equals the sequence-level objective mean_i(-A_i s_i)
    total = agg_loss(loss, mask, "seq-mean-token-mean")
    assert total.item() == pytest.approx((-s0 + s1) / 2, abs=1e-6)
    total.backward()
    # d/d logp_{i,t} of the sequence objective: -A_i s_i / |y_i| / N
    assert new.grad[0, 0].item() == pytest.approx(-s0 / 3 / 2, abs=1e-6)
    assert new.grad[1, 0].item() == pytest.approx(s1 / 2 / 2, abs=1e-6)


@pytest.mark.parametrize("recipe", ["gspo_math", "grpo_math"])
def test_recipe_policy_loss_is_its_own(recipe):
    """The loss a recipe really builds, off-policy: per-token log-ratios +0.5 and -0.5 average to a
    sequence ratio of 1, inside GSPO's tiny clip (loss -A), while PPO-clip clips the first token at
    1 + eps and keeps the second at e^-0.5. A GSPO recipe that fell back to PPO-clip (a wrong key,
    a wrong registry entry) gives the second value, which on-policy runs cannot tell apart."""
    from hybrid_rl.config import register_configs
    from hybrid_rl.config.compose import compose_recipe

    register_configs()
    a = compose_recipe(recipe, "tiny").algorithm
    old, new = torch.zeros(1, 2), torch.tensor([[0.5, -0.5]])
    mask = torch.ones(1, 2)
    mb = SimpleNamespace(response_mask=mask, old_logprobs=old, advantages=torch.ones(1, 2), rollout_logprobs=None,
                         ref_logprobs=None, loss_weights=mask / 2)  # fmt: skip
    loss, _ = make_actor_loss(a)(ModelOutputs(logprobs=new), mb)
    # GSPO: s = 1 on both tokens; PPO-clip: min(e^0.5, 1 + clip_ratio_high) and e^-0.5
    want = -1.0 if recipe == "gspo_math" else -(1.0 + a.clip_ratio_high + math.exp(-0.5)) / 2
    assert loss.item() == pytest.approx(want, abs=1e-5)


def test_vanilla_pg():
    lp = torch.tensor([[-1.0, -2.0]])
    loss, _ = POLICY_LOSSES["reinforce"](lp, lp, torch.tensor([[2.0, -1.0]]), torch.ones(1, 2), PPO)
    torch.testing.assert_close(loss, torch.tensor([[2.0, -2.0]]))


def test_agg_modes_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", max_len=5).item() == pytest.approx(10 / (2 * 5))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_weights_split_into_micro_batches_is_exact(mode):
    """Globally normalised weights make the micro-batch sum equal the whole-batch aggregate."""
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(8, 6, generator=g)
    mask = (torch.rand(8, 6, generator=g) > 0.3).float()
    mask[:, 0] = 1
    n_tok, n_seq = float(mask.sum()), 8.0
    whole = agg_loss(loss, mask, mode, max_len=6)
    parts = sum((agg_weights(mask[i : i + 3], mode, n_tok, n_seq, 6) * loss[i : i + 3]).sum() for i in range(0, 8, 3))
    assert parts.item() == pytest.approx(whole.item(), abs=1e-5)


def test_kl_estimators_hand_computed():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    # log r = ref - lp = -0.5
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert kl_estimate(lp, ref, "abs").item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(lp, ref, "k9")


def test_k3_is_unbiased_estimate_of_kl():
    """E_{x~p}[k3] = KL(p||q) for two categoricals (Monte Carlo)."""
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    true = (p * (p / q).log()).sum().item()
    x = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    est = kl_estimate(p[x].log(), q[x].log(), "k3").mean().item()
    assert est == pytest.approx(true, rel=0.03)


def test_kl_in_reward_places_score_on_last_token():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    r = kl_in_reward(torch.tensor([2.0, 1.0]), mask, torch.full((2, 3), 0.5), 0.1)
    torch.testing.assert_close(r, torch.tensor([[-0.05, 1.95, 0.0], [-0.05, -0.05, 0.95]]))


def test_adaptive_kl_controller():
    c = AdaptiveKLController(0.1, target=1.0, horizon=100)
    c.update(current_kl=2.0, n_steps=10)  # error clipped to +0.2 -> x(1 + .02)
    assert c.value == pytest.approx(0.102)
    c.update(current_kl=0.9, n_steps=100)  # error -0.1 -> x0.9
    assert c.value == pytest.approx(0.102 * 0.9)


def test_tis_weights_token_and_sequence():
    old = torch.tensor([[0.0, 0.0]])
    rollout = torch.log(torch.tensor([[0.5, 2.0]]))
    mask = torch.ones(1, 2)
    torch.testing.assert_close(tis_weights(old, rollout, mask, "token", 1.5), torch.tensor([[1.5, 0.5]]))
    torch.testing.assert_close(tis_weights(old, rollout, mask, "sequence", 1.5), torch.tensor([[1.0, 1.0]]))
    # ratios whose product is not 1 (a sequence mode returning ones, or the token weights, fails):
    # per token 1/0.8 = 1.25 and 1/0.5 = 2 (capped at 3); the sequence's product 2.5, and a masked
    # third token (ratio 4) counts in neither.
    rollout = torch.log(torch.tensor([[0.8, 0.5, 0.25], [0.8, 0.5, 0.25]]))
    old, mask = torch.zeros(2, 3), torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    torch.testing.assert_close(tis_weights(old, rollout, mask, "token", 3.0)[:, :2], torch.tensor([[1.25, 2.0], [1.25, 2.0]]))
    torch.testing.assert_close(tis_weights(old, rollout, mask, "sequence", 3.0), torch.full((2, 3), 2.5))
    torch.testing.assert_close(tis_weights(old, rollout, mask, "sequence", 2.0), torch.full((2, 3), 2.0))  # capped


def _batch(mask, adv, old, ref=None):
    b, r = mask.shape
    return TrainBatch(
        input_ids=torch.zeros(b, r + 1, dtype=torch.long),
        attention_mask=torch.ones(b, r + 1, dtype=torch.long),
        position_ids=torch.zeros(b, r + 1, dtype=torch.long),
        response_mask=mask,
        prompt_len=1,
        group_ids=torch.zeros(b, dtype=torch.long),
        scores=torch.zeros(b),
        old_logprobs=old,
        ref_logprobs=ref,
        advantages=adv,
        rollout_logprobs=old,
        loss_weights=agg_weights(mask, "token-mean", float(mask.sum()), float(b)),
    )


def test_actor_loss_composes_pg_entropy_and_kl():
    cfg = SimpleNamespace(
        policy_loss="ppo_clip",
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        clip_ratio_c=None,
        tis=TISSettings(),
        entropy_coeff=0.1,
        kl_loss=KLLossSettings(enable=True, coef=0.5, type="k1"),
    )
    mask = torch.ones(1, 2)
    lp = torch.tensor([[-1.0, -1.0]])
    mb = _batch(mask, torch.tensor([[1.0, 1.0]]), lp, ref=torch.tensor([[-1.5, -0.5]]))
    loss, m = make_actor_loss(cfg)(ModelOutputs(logprobs=lp, entropy=torch.tensor([[2.0, 4.0]])), mb)
    # pg = -1 per token; entropy bonus -0.1*[2,4]; k1 = lp - ref = [0.5, -0.5] * 0.5
    expected = ((-1 - 0.2 + 0.25) + (-1 - 0.4 - 0.25)) / 2
    assert loss.item() == pytest.approx(expected)
    assert m["actor/entropy"].item() == pytest.approx(3.0)
    # a reference whose k1 terms do not cancel: the KL term is weighted by kl_loss_coef (0.5)
    mb = _batch(mask, torch.tensor([[1.0, 1.0]]), lp, ref=torch.tensor([[-1.5, -1.5]]))
    loss, _ = make_actor_loss(cfg)(ModelOutputs(logprobs=lp, entropy=torch.tensor([[2.0, 4.0]])), mb)
    assert loss.item() == pytest.approx(((-1 - 0.2) + (-1 - 0.4)) / 2 + 0.5 * 0.5)


def test_clipped_value_loss_hand_computed():
    from hybrid_rl.algorithms.losses import clipped_value_loss

    v = torch.tensor([1.0, 0.0])
    old = torch.tensor([0.0, 0.0])
    ret = torch.tensor([2.0, 1.0])
    # t0: err (1-2)^2 = 1; clipped v = 0 + clip(1, -.5, .5) = .5 -> (.5-2)^2 = 2.25 -> .5*2.25
    # t1: err 1; clipped = 0 -> 1 -> .5
    torch.testing.assert_close(clipped_value_loss(v, old, ret, 0.5), torch.tensor([1.125, 0.5]))
    torch.testing.assert_close(clipped_value_loss(v, old, ret, None), torch.tensor([0.5, 0.5]))


def test_dpo_loss_hand_computed():
    from hybrid_rl.algorithms.preference import dpo_loss

    loss, rc, rr = dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.5)
    # margin = .5*(1) - .5*(-1) = 1 -> -log sigmoid(1)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-1))))
    assert rc.item() == pytest.approx(0.5) and rr.item() == pytest.approx(-0.5)


def test_rm_losses_hand_computed():
    from hybrid_rl.algorithms.preference import listwise_rm_loss, margin_rm_loss, pairwise_rm_loss

    assert pairwise_rm_loss(torch.tensor([2.0]), torch.tensor([0.0])).item() == pytest.approx(math.log(1 + math.exp(-2)))
    torch.testing.assert_close(margin_rm_loss(torch.tensor([2.0, 0.5]), torch.tensor([0.0, 0.0]), 1.0), torch.tensor([0.0, 0.5]))
    scores = torch.tensor([[1.0, 0.0, -1.0]])
    ranks = torch.tensor([[0, 1, 2]])
    p = torch.softmax(torch.tensor([0.0, -1.0, -2.0]), -1)
    logq = torch.log_softmax(scores[0], -1)
    assert listwise_rm_loss(scores, ranks).item() == pytest.approx(-(p * logq).sum().item(), abs=1e-6)
    # a perfectly ordered list scores lower loss than the reversed one
    assert listwise_rm_loss(scores, ranks) < listwise_rm_loss(-scores, ranks)
