"""Correctness of the pieces around truncated sampling and DAPO's filter, against hand-made inputs:
finite log-probs under top-k/top-p, KL of exactly 0 at identical weights, a non-finite loss is a
skipped step, DAPO filters on accuracy, and a short batch keeps whole groups."""


from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from hybrid_rl.algorithms.filters import refill_prompts, whole_groups
from hybrid_rl.algorithms.kl import AdaptiveKLController, kl_estimate
from hybrid_rl.algorithms.losses import make_actor_loss
from hybrid_rl.algorithms.params import KLLossSettings
from hybrid_rl.batch import ModelOutputs, Rollout, Sample, collate
from hybrid_rl.config import AlgorithmConfig, register_configs
from hybrid_rl.engine.heads import OUTSIDE_LOGPROB, Sampling, logprobs_and_entropy, logprobs_entropy_untruncated
from hybrid_rl.timing import PhaseTimer
from hybrid_rl.trainer.build import conf_dir
from hybrid_rl.trainer.collect import RolloutCollector

pytestmark = pytest.mark.unit
register_configs()


def _head(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(12, 8, generator=g), torch.randn(40, 8, generator=g), torch.randint(0, 40, (12,), generator=g)


def test_a_target_outside_top_k_gets_a_finite_logprob_not_minus_inf():
    h, w, t = _head()
    lp, ent = logprobs_and_entropy(h, w, t, Sampling(1.0, 3, 1.0))
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    outside = lp == OUTSIDE_LOGPROB
    assert outside.any()  # 3 of 40 tokens are kept: most random targets fall outside
    # masking such a position (as padding is) gives 0, not NaN
    assert (lp * (~outside).float()).isfinite().all()


def test_kl_is_zero_at_identical_weights_with_truncation_on():
    """Policy side: untruncated log-probs; reference side: temperature only (as the trainer runs it)."""
    h, w, t = _head(1)
    lp, _, full = logprobs_entropy_untruncated(h, w, t, Sampling(0.8, 20, 0.9))
    ref, _ = logprobs_and_entropy(h, w, t, 0.8)
    assert not torch.equal(lp, full)  # truncation changed the sampling log-probs...
    for kind in ("k1", "k2", "k3"):
        assert kl_estimate(full, ref, kind).abs().max().item() == 0.0  # ...but not the KL's side
    assert kl_estimate(lp, ref, "k3").abs().max().item() > 0  # the old code's floor


def test_kl_loss_uses_the_untruncated_logprobs():
    cfg = AlgorithmConfig(clip_ratio_c=None, kl_loss=KLLossSettings(enable=True, coef=1.0, type="k3"))
    mb = collate([Sample([1, 2], [3, 4, 5], [0.0] * 3, [1] * 3, "stop", 0)], 0)
    mb.advantages, mb.loss_weights = torch.zeros(1, 3), torch.full((1, 3), 1 / 3)
    ref = torch.tensor([[-1.0, -2.0, -3.0]])
    mb.ref_logprobs = ref
    out = ModelOutputs(logprobs=torch.tensor([[-0.5, -1.0, -1.5]]), kl_logprobs=ref.clone())
    _, metrics = make_actor_loss(cfg)(out, mb)
    assert float(metrics["actor/kl_loss"]) == 0.0


def test_adaptive_kl_controller_ignores_a_non_finite_kl():
    ctrl = AdaptiveKLController(0.1, 0.1, 100)
    ctrl.update(float("nan"), 10)
    ctrl.update(float("inf"), 10)
    assert ctrl.value == 0.1


def test_whole_groups_never_cut_a_group():
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2]  # 3 groups of 3 on 2 ranks: 6 rows (two whole groups)
    assert whole_groups(groups, cap=9, world_size=2) == 6
    assert whole_groups(groups, cap=9, world_size=3) == 9
    assert whole_groups(groups, cap=5, world_size=1) == 3
    assert whole_groups([0, 0, 1, 1], cap=4, world_size=2) == 4


class _Words:
    """A tokenizer whose token ids decode to fixed answers (the scoring reads only the text)."""

    def __init__(self, texts: dict[int, str]) -> None:
        self.texts = texts

    def batch_decode(self, ids, skip_special_tokens=True):
        return [self.texts[seq[0]] for seq in ids]


def _sample(group: int, answer_id: int, length: int) -> Sample:
    return Sample([1, 2], [answer_id] * length, [0.0] * length, [1] * length, "stop", group, ground_truth="4")


@pytest.mark.parametrize(("metric", "kept"), [("acc", 4), ("score", 8)])
def test_dapo_filter_drops_an_all_correct_group_that_differs_only_in_length(ctx, reward_pool, metric, kept):
    """dapo_math's overlong shaping (buffer 16 of 64 tokens): four right answers of lengths 20, 22,
    25, 52 score [1, 1, 1, 0.75]; on the shaped score the group looks informative and would train
    on length alone. On accuracy (the default) only the group with right and wrong answers stays."""
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", ["+recipe=dapo_math", "data.train_batch_size=2", "rollout.n=4",
                                 "algorithm.filter_groups.max_gen_rounds=1", f"algorithm.filter_groups.metric={metric}"])  # fmt: skip
    right, wrong = 7, 9
    samples = [_sample(0, right, n) for n in (20, 22, 25, 52)] + [_sample(1, i, 10) for i in (right, wrong, right, wrong)]
    parts = SimpleNamespace(rollout_engine=None, switch=None, tokenizer=_Words({right: "\\boxed{4}", wrong: "\\boxed{5}"}), tools=[],
                            train_records=[], sampler=None, reward_pool=reward_pool, reward_models=[])  # fmt: skip
    collector = RolloutCollector(cfg, ctx, parts)
    collector.next_prompts = lambda: []
    collector.generate = lambda prompts, round_idx=0: Rollout(list(samples), 0)
    out, m = collector.collect(0, PhaseTimer())
    assert [s.score for s in samples[:4]] == [1.0, 1.0, 1.0, 0.75] and [s.acc for s in samples[:4]] == [1.0] * 4
    assert len(out.samples) == kept and m["dapo/kept_samples"] == kept


def test_refill_draws_for_the_missing_groups_at_the_informative_rate():
    # 6 of 8 prompts varied, 2 groups missing: 2 / 0.75 = 2.67 -> 3 prompts; x1.25 -> 4
    assert refill_prompts(2, drawn=8, informative=6, batch=8, ranks=1, margin=1.0) == 3
    assert refill_prompts(2, drawn=8, informative=6, batch=8, ranks=1, margin=1.25) == 4
    assert refill_prompts(2, drawn=8, informative=6, batch=8, ranks=2, margin=1.0) == 4  # a multiple of the ranks
    assert refill_prompts(7, drawn=8, informative=1, batch=8, ranks=1, margin=1.25) == 8  # never over a batch
    assert refill_prompts(8, drawn=8, informative=0, batch=8, ranks=1, margin=1.25) == 8  # no rate yet: a batch


@pytest.mark.parametrize(("refill", "counts", "drawn"), [("full", [None, 8], 16), ("missing", [None, 3], 11)])
def test_dapo_refill_draws_the_missing_prompts_with_unique_groups(ctx, reward_pool, refill, counts, drawn):
    """8 prompts x G=2: 6 groups vary in round 1, so 2 are missing. ``full`` draws another 8
    prompts (verl), ``missing`` 2 / (6 / 8) -> 3. The second round's groups are numbered after the
    first's, the batch is filled with 8 whole groups, and the reward metrics are averaged over
    the 16 + 6 (or 16 + 16) samples, not over the two rounds."""
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", ["+recipe=grpo_math", "data.train_batch_size=8", "rollout.n=2",
                                 f"algorithm.filter_groups.refill={refill}", "algorithm.filter_groups.refill_margin=1.0"])  # fmt: skip
    right, wrong = 7, 9
    parts = SimpleNamespace(rollout_engine=None, switch=None, tokenizer=_Words({right: "\\boxed{4}", wrong: "\\boxed{5}"}), tools=[],
                            train_records=[], sampler=None, reward_pool=reward_pool, reward_models=[])  # fmt: skip
    collector = RolloutCollector(cfg, ctx, parts)
    asked, firsts = [], []
    collector.next_prompts = lambda count=None: asked.append(count) or [None] * (count or 8)

    def generate(prompts, round_idx=0, first_group=0):
        firsts.append(first_group)
        answers = [(right, wrong)] * 6 + [(right, right)] * 2 if round_idx == 0 else [(wrong, right)] * len(prompts)
        return Rollout([_sample(first_group + i, a, 5) for i in range(len(prompts)) for a in answers[i]], 0)

    collector.generate = generate
    out, m = collector.collect(0, PhaseTimer())
    assert asked == counts and firsts == [0, 8] and m["dapo/prompts_drawn"] == drawn
    assert len(out.samples) == 16 and len({s.group for s in out.samples}) == 8
    assert {s.group for s in out.samples} == {0, 1, 2, 3, 4, 5, 8, 9}
    second = 2 * counts[1]
    assert m["critic/score/mean"] == pytest.approx((10 + second / 2) / (16 + second))  # right answers / samples


def test_explained_variance_of_the_critic():
    """verl's critic/vf_explained_var over the response tokens only: 1 for a critic that predicts
    the returns, 0 for one that predicts their mean, below 0 for a worse one; padding is ignored."""
    from hybrid_rl.trainer.step_metrics import explained_variance

    returns = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, -7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(returns, torch.full_like(returns, 2.5), mask) == pytest.approx(0.0)
    assert explained_variance(returns, -returns, mask) < 0
    # Var(R - V) / Var(R) with R = [1, 2, 3, 4], V = [1, 2, 3, 3]: 1 - var([0, 0, 0, 1]) / var(R)
    v = torch.tensor([[1.0, 2.0, 0.0], [3.0, 3.0, 0.0]])
    assert explained_variance(returns, v, mask) == pytest.approx(1 - 0.25 / (5 / 3))
