"""Held-out evaluation: per-problem hits in record order whatever the sharding, the accuracy's
standard error, and the paired gain between two evaluations of the same problems."""

import math
from types import SimpleNamespace

import pytest
import torch

from hybrid_rl.data.dataset import PromptRecord
from hybrid_rl.rewards.pool import RewardPool
from hybrid_rl.trainer.validation import evaluate, gains_by_source, paired_gain

pytestmark = pytest.mark.unit


def test_paired_gain_by_hand():
    before = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0])
    after = torch.tensor([1.0, 1, 0, 1, 1, 1, 0, 0])
    gain, se = paired_gain(before, after)
    d = [0, 1, 0, 0, 1, 0, -1, 0]  # mean 1/8; sample variance (3 - 8/64) / 7
    assert gain == pytest.approx(1 / 8)
    assert se == pytest.approx(math.sqrt((3 - 8 * (1 / 8) ** 2) / 7) / math.sqrt(8))
    assert sum(d) / 8 == gain
    # The point of pairing: problems right (or wrong) both times add no noise. Unpaired, the
    # s.e. of the same difference is sqrt(se_a^2 + se_b^2), larger here.
    unpaired = math.sqrt(sum(p * (1 - p) / 8 for p in (before.mean().item(), after.mean().item())))
    assert se < unpaired
    assert paired_gain(after, after) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same problems"):
        paired_gain(before, after[:5])


def test_gain_per_source_pairs_each_sources_problems_only():
    """Two validation sets in one evaluation (the synthetic task's held-out and in-distribution
    ones): each source's gain is paired over its own problems, and one source gets no breakdown."""
    recs = [SimpleNamespace(data_source=s) for s in ("held", "seen", "held", "seen", "held")]
    before = torch.tensor([0.0, 1, 0, 0, 1])
    after = torch.tensor([1.0, 1, 1, 0, 0])
    out = gains_by_source(recs, before, after)
    assert out["val/gain/held"] == pytest.approx(paired_gain(torch.tensor([0.0, 0, 1]), torch.tensor([1.0, 1, 0]))[0])
    assert out["val/gain/held"] == pytest.approx(1 / 3) and out["val/gain/seen"] == 0.0
    assert out["val/gain_se/seen"] == 0.0 and out["val/gain_se/held"] > 0
    assert gains_by_source(recs[:1] * 3, before[:3], after[:3]) == {}


@pytest.fixture(scope="module")
def pool():
    p = RewardPool(
        SimpleNamespace(
            functions=[SimpleNamespace(name="math", weight=1.0, path=None, function=None)],
            num_workers=1, timeout_s=30.0, failure_score=0.0, max_failed_steps=0,
        )
    )  # fmt: skip
    yield p
    p.close()


def test_hits_are_in_record_order_for_every_shard(pool):
    records = [
        PromptRecord([i], str(i), "math", {"level": 1 + i % 2}, [], f"val:{i}") for i in range(7)
    ]
    right = {0, 3, 4, 6}  # the sampler answers these correctly

    def sample(recs, spec):
        return [[f"The answer is \\boxed{{{r.ground_truth if int(r.ground_truth) in right else -1}}}."] for r in recs], {}

    ctx = SimpleNamespace(rank=0, world_size=1)
    whole, hits, samples = evaluate(sample, records, pool, ctx, 8, keep_samples=2)
    assert [s["ground_truth"] for s in samples] == ["0", "1"] and samples[0]["score"] == 1.0 and samples[1]["score"] == 0.0
    assert "\\boxed{-1}" in samples[1]["response"] and samples[0]["data_source"] == "math"
    # per data source (verl's per-data_source figures) and per level
    assert whole["val/accuracy/math"] == pytest.approx(4 / 7) and whole["val/n/math"] == 7
    assert whole["val/accuracy_se/math"] == pytest.approx(math.sqrt(4 / 7 * 3 / 7 / 7))
    assert whole["val/accuracy/math_level2"] == pytest.approx(1 / 3) and whole["val/n/math_level2"] == 3
    assert whole["val/accuracy_level1"] == pytest.approx(3 / 4) and whole["val/accuracy_level2"] == pytest.approx(1 / 3)
    assert hits.tolist() == [float(i in right) for i in range(7)]
    assert whole["val/accuracy"] == pytest.approx(4 / 7)
    assert whole["val/accuracy_se"] == pytest.approx(math.sqrt(4 / 7 * 3 / 7 / 7))
    # Sampled: a sampler right on every even answer of k=2 draws gives pass@2 over the records that
    # have one right answer in their group, per source and level too.
    def sample_k(recs, spec):
        return [[f"\\boxed{{{r.ground_truth if (j + int(r.ground_truth)) % 2 == 0 else -1}}}" for j in range(spec.n)] for r in recs], {}

    k2 = evaluate(sample_k, records, pool, ctx, 8, pass_k=2)[0]
    # pass@k samples as training does: the nucleus and top-k reach the sampler with the temperature
    specs = []
    evaluate(lambda recs, spec: (specs.append(spec), sample_k(recs, spec))[1], records, pool, ctx, 8, pass_k=2,
             temperature=0.7, top_p=0.9, top_k=20)  # fmt: skip
    assert (specs[-1].n, specs[-1].temperature, specs[-1].top_p, specs[-1].top_k) == (2, 0.7, 0.9, 20)
    assert k2["val/pass@2"] == 1.0 and k2["val/mean@2"] == 0.5
    assert k2["val/pass@2/math_level1"] == 1.0 and k2["val/mean@2/math"] == 0.5
    # Two ranks' shards (no process group here, so each keeps its own part): the parts add up
    # to the whole vector, each problem at its own index.
    parts = [evaluate(sample, records, pool, ctx, 8, shard=(r, 2))[1] for r in range(2)]
    assert (parts[0] + parts[1]).tolist() == hits.tolist()
    assert parts[0][1::2].sum() == 0 and parts[1][0::2].sum() == 0
