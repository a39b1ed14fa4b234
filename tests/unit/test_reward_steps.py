"""What the collector makes of the reward pool's results over a whole step: the extras reward
functions return, logged as ``reward/<key>``, and the failure stop counted in steps when DAPO's
dynamic sampling scores several generation rounds per step (real pool workers, no engine)."""

from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from hybrid_rl.batch import Rollout, Sample
from hybrid_rl.config import register_configs
from hybrid_rl.errors import RankFailure
from hybrid_rl.rewards.pool import RewardPool, ScoredResponse
from hybrid_rl.timing import PhaseTimer
from hybrid_rl.trainer import collect, step_metrics
from hybrid_rl.trainer.build import conf_dir
from hybrid_rl.trainer.collect import RolloutCollector
from hybrid_rl.trainer.step_metrics import reduce_metrics

pytestmark = pytest.mark.unit
register_configs()

REWARDS = """
def with_extras(ds, s, gt, extra=None):
    out = {"score": float("{4}" in s), "chars": len(s), "failed": 7}
    if "{4}" in s:
        out["right_chars"] = len(s)
    return out
def nan(ds, s, gt, extra=None):
    return float("nan")
"""
RIGHT, WRONG = 7, 9


class _Words:
    """A tokenizer whose token ids decode to fixed answers (the scoring reads only the text)."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return [{RIGHT: "\\boxed{4}", WRONG: "\\boxed{15}"}[seq[0]] for seq in ids]


def _collector(ctx, tmp_path, function, overrides, max_failed_steps=3):
    f = tmp_path / "rewards.py"
    f.write_text(REWARDS)
    fns = [SimpleNamespace(name="custom", weight=1.0, path=str(f), function=function)]
    pool = RewardPool(
        SimpleNamespace(functions=fns, num_workers=1, timeout_s=10.0, failure_score=0.0, max_failed_steps=max_failed_steps)
    )
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", ["+recipe=grpo_math", "data.train_batch_size=2", "rollout.n=2", *overrides])
    parts = SimpleNamespace(rollout_engine=None, switch=None, tokenizer=_Words(), tools=[], train_records=[],
                            sampler=None, reward_pool=pool, reward_models=[])  # fmt: skip
    c = RolloutCollector(cfg, ctx, parts)
    c.next_prompts = lambda count=None: [None] * (count or 2)
    return c, pool


def _answers(*answers):
    """A round of groups of two: ``answers`` in pairs."""
    return Rollout(
        [Sample([1, 2], [a] * 3, [0.0] * 3, [1] * 3, "stop", i // 2, ground_truth="4") for i, a in enumerate(answers)], 0
    )


def test_a_rewards_extras_are_logged_per_step_as_the_mean_of_the_answers_that_reported_them(ctx, tmp_path, caplog):
    """README: a dict's other numeric entries are logged as reward/<key>. They were computed and
    dropped. ``chars`` is reported by all 4 answers, ``right_chars`` by the 3 right ones only;
    an extra named ``failed`` does not overwrite reward/failed (a count, summed over ranks)."""
    c, pool = _collector(ctx, tmp_path, "with_extras", ["algorithm.filter_groups.enable=false"])
    c.generate = lambda prompts, round_idx=0, first_group=0: _answers(RIGHT, WRONG, RIGHT, RIGHT)
    try:
        _, m = c.collect(0, PhaseTimer())
    finally:
        pool.close()
    m = reduce_metrics(m)
    assert m["reward/chars"] == pytest.approx((9 + 10 + 9 + 9) / 4)
    assert m["reward/right_chars"] == pytest.approx(9.0)
    assert m["reward/failed"] == 0.0 and m["reward/extra/failed"] == 7.0
    assert "logged as reward/extra/failed" in caplog.text


def test_extras_are_one_global_mean_on_every_rank_and_never_summed(monkeypatch):
    """Ranks may report different keys (reduce_metrics needs the same keys on every rank) and
    different numbers of answers per key: the mean is over the answers, gathered from all ranks."""
    mine = [ScoredResponse(1.0, {}, {"right_chars": 9.0}), ScoredResponse(0.0, {}, {})]
    other_rank = {"right_chars": [30.0, 1.0], "answer_tokens": [8.0, 2.0]}
    monkeypatch.setattr(collect, "all_gather_objects", lambda local: [local, other_rank])
    m = collect.extra_metrics(mine, {}, lambda key, message: None)
    assert m == {"reward/right_chars": pytest.approx((9 + 30) / 2), "reward/answer_tokens": 4.0}
    # two ranks holding the same values: means stay, counts (``*_tokens``) are summed, but a
    # reward extra is a mean whatever its name
    monkeypatch.setattr(step_metrics, "all_reduce_sum", lambda values: [2 * v for v in values])
    monkeypatch.setattr(step_metrics, "mean_over_ranks", lambda d: d)
    out = reduce_metrics({**m, "response_tokens": 5.0})
    assert out["reward/answer_tokens"] == 4.0 and out["response_tokens"] == 10.0


def test_the_failure_stop_counts_steps_not_dapo_generation_rounds(ctx, tmp_path):
    """A reward returning NaN everywhere: no group is informative, so DAPO runs all 3 rounds of
    each step. With max_failed_steps=3 the run stopped inside step 1 ("3 consecutive steps")."""
    c, pool = _collector(ctx, tmp_path, "nan", ["algorithm.filter_groups.max_gen_rounds=3"], max_failed_steps=3)
    c.generate = lambda prompts, round_idx=0, first_group=0: _answers(*[RIGHT, WRONG] * len(prompts))
    try:
        for step in range(2):
            _, m = c.collect(step, PhaseTimer())
            assert m["dapo/gen_rounds"] == 3 and m["reward/failed"] == 12  # every answer of 3 rounds
        assert pool.failed_steps == 2
        with pytest.raises(RankFailure, match="rollout at step 3 failed.*every response for 3 consecutive steps"):
            c.collect(2, PhaseTimer())
    finally:
        pool.close()


def test_a_step_with_one_scored_answer_is_not_a_failed_step(ctx, tmp_path):
    """Rounds are counted together: a failing first round and a working second one make a step
    that did not fail, and the count starts over."""
    c, pool = _collector(ctx, tmp_path, "with_extras", ["algorithm.filter_groups.max_gen_rounds=2"], max_failed_steps=1)
    real, calls = pool.score, []

    def first_round_fails(items):
        calls.append(len(items))
        return [ScoredResponse(0.0, {"with_extras": 0.0}, failed=1) for _ in items] if len(calls) == 1 else real(items)

    pool.score = first_round_fails
    c.generate = lambda prompts, round_idx=0, first_group=0: _answers(*[RIGHT, RIGHT] * len(prompts))
    try:
        _, m = c.collect(0, PhaseTimer())  # round 1 fails everywhere, round 2 scores: no stop at max_failed_steps=1
    finally:
        pool.close()
    assert m["dapo/gen_rounds"] == 2 and pool.failed_steps == 0


def test_dynamic_sampling_says_when_it_trains_a_short_batch_or_nothing(ctx, tmp_path, caplog):
    """A step whose rounds found fewer informative groups than the batch trains on what it has and
    says so; one that found none keeps the generated lengths in its metrics (there is no batch)."""
    c, pool = _collector(ctx, tmp_path, "with_extras", ["algorithm.filter_groups.max_gen_rounds=2"])

    def rounds(first, later):  # the first round's answers, then every later round's, in new groups
        def generate(prompts, round_idx=0, first_group=0):
            out = _answers(*(later if round_idx else first))
            for s in out.samples:
                s.group += first_group
            return out

        return generate

    try:
        c.generate = rounds((RIGHT, WRONG, RIGHT, RIGHT), (RIGHT, RIGHT, WRONG, WRONG))  # one group of 4 differs
        rollout, m = c.collect(0, PhaseTimer())
        assert len(rollout.samples) == 2 and "step 1: trained on 2 of 4 samples" in caplog.text
        c.generate = rounds((RIGHT, RIGHT, WRONG, WRONG), (RIGHT, RIGHT, WRONG, WRONG))  # none differs
        rollout, m = c.collect(1, PhaseTimer())
    finally:
        pool.close()
    assert not rollout.samples and m["response_length/mean"] == 3.0 and m["dapo/used_samples"] == 0.0
