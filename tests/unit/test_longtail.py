"""The long-tailed task (synthetic level 7, running sums): verifiable answers, the split by fact
line by line, answer lengths long-tailed in the recipe's own tokens, and the default levels untouched."""

import hashlib
import json
import random
import re

import numpy as np
import pytest

from hybrid_rl.data import longtail, synth_math
from hybrid_rl.rewards.functions import math_reward

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def splits():
    return synth_math.make_splits(4000, 512, 128, seed=0, levels=[7])


def test_running_sums_add_the_question_operands_one_line_each():
    """The question lists the operands; the worked answer adds them in order, one line per operand
    after the first, each line right; the verifier accepts the boxed total and rejects another."""
    rng = random.Random(0)
    for _ in range(300):
        p = synth_math.make_problem(rng, 7)
        counts = re.search(r"has (\d+) boxes with (.*) \w+ in them", p.question)
        operands = [int(x) for x in counts.group(2).replace(" and", ",").split(", ")]
        assert int(counts.group(1)) == len(operands) >= 3 and all(1 <= x <= 9 for x in operands)
        lines = synth_math.facts(p)
        assert len(lines) == len(operands) - 1 and p.level == 7
        total = operands[0]
        for line, x in zip(lines, operands[1:], strict=True):
            assert line == f"{total} + {x} = {total + x}"
            total += x
        assert p.answer == total == sum(operands)
        assert math_reward("x", synth_math.format_solution(p), str(p.answer)) == 1.0
        assert math_reward("x", synth_math.format_solution(p), str(p.answer + 1)) == 0.0
        call = synth_math.tool_turns(p)[0][1]
        assert f"print({' + '.join(map(str, operands))})" in call


def test_the_split_is_by_fact_line_by_line_and_keeps_the_tail(splits):
    """No training line states a held-out fact (either order), every validation problem has at
    least one, in-distribution problems state only trained facts; and the operand counts of
    train and val are the same heavy tail (whole-problem rejection would have emptied it:
    a 40-line problem has no held-out line with probability 0.8**40)."""
    held = lambda f: synth_math.is_held_out(f, 0, 0.2)  # noqa: E731
    trained = {synth_math.fact_key(f) for r in splits["train"] for f in r["extra_info"]["facts"]}
    assert not any(held(f) for r in splits["train"] for f in r["extra_info"]["facts"])
    for r in splits["val"]:
        new = [f for f in r["extra_info"]["facts"] if held(f) and synth_math.fact_key(f) not in trained]
        assert new, r["extra_info"]["solution"]
        assert r["data_source"] == synth_math.HELDOUT_SOURCE
    exact = {f for r in splits["train"] for f in r["extra_info"]["facts"]}
    assert len(splits["val_seen"]) == 128 and all(set(r["extra_info"]["facts"]) <= exact for r in splits["val_seen"])
    texts = {s: {r["prompt"][0]["content"] for r in rows} for s, rows in splits.items()}
    assert not texts["train"] & texts["val"] and not texts["train"] & texts["val_seen"]
    k = {s: np.array([len(r["extra_info"]["facts"]) + 1 for r in splits[s]]) for s in ("train", "val")}
    for counts in k.values():
        assert np.median(counts) == 4 and (counts >= 30).mean() > 0.01 and counts.max() <= longtail.MAX_OPERANDS
    assert abs((k["train"] >= 10).mean() - (k["val"] >= 10).mean()) < 0.05


def test_answer_lengths_are_long_tailed_in_the_recipes_tokens(splits, tokenizer):
    """In tokens of the builtin tokenizer (the same for every preset: trained on the task's corpus
    with the same size and seed), answers as SFT and the rollout end them (worked lines, boxed
    answer, end of turn) have a median under 64 and a p99 at least 8x it; the longest answer and
    prompt the generator can make at all fit grpo_longtail's budgets."""
    from benchmarks.longtail_lengths import compose, lengths, worst_case

    measured = lengths(splits["train"], tokenizer)["answer"]
    median, p99 = np.median(measured), np.percentile(measured, 99)
    assert median < 64 and p99 >= 8 * median, (median, p99)
    cfg = compose("grpo_longtail")
    worst = worst_case(tokenizer)
    assert max(measured) <= worst["answer_tokens"] <= cfg.rollout.max_response_length and cfg.rollout.max_response_length >= 1024
    assert worst["prompt_tokens"] <= cfg.data.max_prompt_length
    assert list(cfg.data.synth.levels) == [7] and cfg.model.preset == "tiny-long"


def test_splits_are_fixed_by_seed(splits):
    again = synth_math.make_splits(4000, 512, 128, seed=0, levels=[7])
    assert json.dumps(again, sort_keys=True) == json.dumps(splits, sort_keys=True)
    other = synth_math.make_splits(200, 32, 0, seed=1, levels=[7])["train"]
    assert [r["prompt"] for r in other] != [r["prompt"] for r in splits["train"][:200]]


def test_the_default_levels_are_unchanged():
    """Level 7 takes no draw from the other levels' streams: their splits are byte for byte what
    generator version 5 wrote, so the data caches and warm starts keyed by that version stay valid
    (a change here must bump GENERATOR_VERSION, and this digest with it)."""
    rows = synth_math.make_splits(600, 120, 40, seed=0, levels=[1, 2, 3, 4, 5, 6], direct_share=0.3)
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    assert synth_math.GENERATOR_VERSION == 5 and digest == "d31b07c99ac8fbd6"


def test_a_line_no_operand_can_take_gives_up_the_problem():
    """A rule no line can satisfy: the generator returns None for that draw and the split says
    how many problems it could make instead of looping."""
    nothing = longtail.StepRule(ok=lambda f: False)
    assert longtail.running_sum(random.Random(0), nothing) is None
    with pytest.raises(ValueError, match="could only make 0 unique train problems"):
        synth_math.generate_rows(5, "train", 0, [7], rule=nothing)
