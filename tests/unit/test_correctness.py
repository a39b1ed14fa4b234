"""Each defect of the RL-correctness review has a test here that fails on the old code:
per-prompt sampling seeds, truncated samples in group statistics, the stale-weight guard,
top-k/top-p in the trainer's log-prob head, the KL estimate's clamp, token-weighted metrics,
DAPO's multi-round reward metrics, ReMax's greedy baseline, metrics rows after a resume, and
the config errors (temperature 0, group estimators with n = 1, the removed model.dtype).
"""

import itertools
import json
from types import SimpleNamespace

import pytest
import torch

from hybrid_rl.algorithms.kl import kl_estimate, make_kl_controller
from hybrid_rl.algorithms.params import GroupNormParams, KLRewardSettings
from hybrid_rl.algorithms.registry import ADV_ESTIMATORS
from hybrid_rl.batch import Rollout, Sample, collate
from hybrid_rl.config import AlgorithmConfig
from hybrid_rl.engine.heads import Sampling, logprobs_and_entropy, truncate_logits
from hybrid_rl.hybrid.switch import HybridSwitch, StaleWeightsError
from hybrid_rl.rollout.base import Completion, GenerateStats, GenerationResult, prompt_seed
from hybrid_rl.trainer.collect import RolloutCollector, merge_round_metrics
from hybrid_rl.trainer.logger import MetricsLogger
from hybrid_rl.trainer.rl import RLTrainer
from tests.fakes import NullEngine

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- 1. sampling seeds
def test_prompt_seeds_are_distinct_and_their_child_ranges_never_overlap():
    """vLLM seeds child j of a request with seed + j; the old scheme (one seed per call, + rank)
    gave sample j of every prompt the same noise and made rank r's child j+1 rank r+1's child j."""
    g = 16
    seeds = sorted(prompt_seed(0, step, rnd, i) for step in range(4) for rnd in range(2) for i in range(256))
    assert len(set(seeds)) == len(seeds)
    assert all(b - a >= g for a, b in itertools.pairwise(seeds))  # [s, s + G) ranges are disjoint
    assert all(0 <= s < 2**31 for s in seeds)
    assert prompt_seed(3, 1, 0, 7) == prompt_seed(3, 1, 0, 7)  # a resumed run draws the same
    assert prompt_seed(3, 1, 0, 7) != prompt_seed(4, 1, 0, 7)


# ---------------------------------------------------------------- 3. truncated samples
def _trainer_stub():
    a = AlgorithmConfig()
    return SimpleNamespace(
        cfg=SimpleNamespace(algorithm=a),
        kl_ctrl=make_kl_controller(KLRewardSettings(coef=0.0)),
        adv_fn=ADV_ESTIMATORS["grpo"],
        adv_params=GroupNormParams(),
        ctx=SimpleNamespace(world_size=1),
    )


def test_a_truncated_sample_keeps_its_true_score_in_the_group_statistics():
    """Group [1, 0, 0, -1 (truncated)]: the truncated sample's -1 must enter mean and std; the
    old code zeroed its mask first and the group was seen as [1, 0, 0, 0]."""
    scores = [1.0, 0.0, 0.0, -1.0]
    samples = [Sample([1, 2], [3, 4, 5], [0.0] * 3, [1] * 3, "length" if s < 0 else "stop", 0, score=s) for s in scores]
    stub = _trainer_stub()
    stub.cfg.algorithm.overlong.mask_truncated = True
    batch = RLTrainer.make_batch(SimpleNamespace(cfg=stub.cfg, tokenizer=SimpleNamespace(pad_token_id=0)), Rollout(samples, 0))
    RLTrainer.compute_advantages(stub, batch)
    s = torch.tensor(scores)
    expected = (s - s.mean()) / (s.std() + 1e-6)
    torch.testing.assert_close(batch.advantages[:3, 0], expected[:3])
    assert batch.response_mask[3].sum() == 0  # ... and it is out of the loss
    assert batch.response_mask[:3].sum() == 9


# ---------------------------------------------------------------- 5. stale-weight guard
class _Weights:
    def iter_full_params(self, bucket_bytes=0, dtype=None, transport="auto", trainable_only=False):
        yield "w", torch.zeros(1)

    def offload_optimizer(self):
        return 0

    def reload_optimizer(self):
        return 0


def test_stale_weight_guard_fires_when_a_sync_is_skipped_or_fails():
    engine = NullEngine()
    sw = HybridSwitch(_Weights(), engine, sync_dtype=None, bucket_bytes=1)
    sw.check_version(sw.engine_version)  # fresh engine holds the initial weights
    sw.policy_updated()
    sw.to_rollout()
    sw.check_version(sw.engine_version)  # synced: fine
    sw.policy_updated()
    sw.to_rollout(skip_sync=True)  # fault injection: engine keeps version 1
    with pytest.raises(StaleWeightsError, match="weights version 1 but the trainer is at 2"):
        sw.check_version(sw.engine_version)
    sw.check_version(sw.engine_version, max_staleness=1)  # allowed lag
    failing = HybridSwitch(_Weights(), NullEngine(fail=True), sync_dtype=None, bucket_bytes=1)
    failing.policy_updated()
    with pytest.raises(RuntimeError, match="load failed"):
        failing.to_rollout()
    assert failing.engine_version == 0  # a failed load does not stamp the engine


# ---------------------------------------------------------------- 6. top-k / top-p head
def _reference_truncation(logits, top_k, top_p):
    """vLLM's rule written as a loop over rows."""
    out = logits.clone()
    for r in range(logits.shape[0]):
        row = out[r]
        if top_k > 0:
            kth = torch.sort(row, descending=True).values[top_k - 1]
            row[row < kth] = float("-inf")
        if top_p < 1:
            probs = torch.softmax(row, -1)
            order = torch.argsort(probs)  # ascending
            cum = 0.0
            for j, idx in enumerate(order.tolist()):
                cum += probs[idx].item()
                if cum <= 1 - top_p + 1e-7 and j < len(order) - 1:
                    row[idx] = float("-inf")
    return out


@pytest.mark.parametrize(("top_k", "top_p"), [(-1, 0.8), (5, 1.0), (7, 0.6), (-1, 0.05)])
def test_truncate_logits_matches_the_sampler_rule(top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=g) * 2
    got = truncate_logits(logits, top_k, top_p)
    ref = _reference_truncation(logits, top_k, top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    assert (~torch.isinf(got)).sum(-1).min() >= 1


def test_truncated_head_gives_renormalised_logprobs_and_finite_entropy():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(9, 8, generator=g, requires_grad=True), torch.randn(30, 8, generator=g)
    logits = (h @ w.T) / 0.7
    kept = truncate_logits(logits.detach(), 4, 0.9)
    targets = torch.stack([torch.nonzero(~torch.isinf(r))[0, 0] for r in kept])  # a token inside the set
    lp, ent = logprobs_and_entropy(h, w, targets, Sampling(0.7, 4, 0.9), chunk=4)
    ref = torch.log_softmax(kept, -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp, ref)
    assert (lp > torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]).all()  # renormalised: higher
    assert torch.isfinite(ent).all() and (ent >= 0).all()
    lp.sum().backward()
    assert torch.isfinite(h.grad).all()


# ---------------------------------------------------------------- 10. k3 clamp
def test_k3_is_clamped_like_low_var_kl():
    lp, ref = torch.tensor([0.0]), torch.tensor([-30.0])  # log r clamps at -20 -> k3 ~ 19
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(10.0)
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(20.0)


# ---------------------------------------------------------------- 8. metrics
def test_dapo_reward_metrics_cover_every_round():
    rounds = [{"critic/score/mean": 0.2, "critic/score/max": 1.0, "reward/failed": 1.0},
              {"critic/score/mean": 0.6, "critic/score/max": 0.5, "reward/failed": 2.0}]  # fmt: skip
    m = merge_round_metrics(rounds, [256, 256])
    assert m == {"critic/score/mean": pytest.approx(0.4), "critic/score/max": 1.0, "reward/failed": 3.0}
    # a refill round of 64 samples weighs a quarter of a whole one
    assert merge_round_metrics(rounds, [256, 64])["critic/score/mean"] == pytest.approx((0.2 * 256 + 0.6 * 64) / 320)


def test_metrics_after_a_resume_appear_once_and_nan_is_kept(tmp_path):
    cfg = SimpleNamespace(backends=["jsonl"], project="p", progress_bar=False)
    log = MetricsLogger(cfg, tmp_path, {}, 10, True)
    for step in range(5):
        log.log(step, {"x": float(step)})
    assert log.truncate_after(2) == 2  # resumed from the step-2 checkpoint
    log.log(3, {"x": float("nan")})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[-1]["x"] != rows[-1]["x"]  # NaN logged, not dropped


# ---------------------------------------------------------------- ReMax's baseline in the loop
class _GreedyEngine:
    last_stats = GenerateStats()

    def generate(self, prompts, spec):
        assert spec.temperature == 0.0 and spec.n == 1
        return [GenerationResult(p, [Completion([len(p)], [0.0], "stop")]) for p in prompts]


def test_remax_greedy_baseline_is_each_prompts_greedy_reward():
    prompts = [SimpleNamespace(prompt_ids=[1] * k, ground_truth=None, data_source="", extra_info={}) for k in (2, 5)]
    samples = [Sample([1] * k, [9], [0.0], [1], "stop", i) for i, k in enumerate((2, 2, 5, 5))]
    rollout = Rollout(samples, 0)

    def score(r, training=True):
        for s in r.samples:
            s.score = float(s.response_ids[0])  # the greedy answer's token is the prompt length

    stub = SimpleNamespace(
        engine=_GreedyEngine(),
        cfg=SimpleNamespace(rollout=SimpleNamespace(max_response_length=4)),
        switch=SimpleNamespace(engine_version=0),
        score=score,
    )
    RolloutCollector.add_greedy_baseline(stub, prompts, rollout)
    assert [s.baseline_score for s in samples] == [2.0, 2.0, 5.0, 5.0]
    assert rollout.stats["rollout/greedy_baseline_mean"] == 3.5
    b = collate(samples, 0)
    assert b.baseline_scores.tolist() == [2.0, 2.0, 5.0, 5.0]
