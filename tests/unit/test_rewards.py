"""Reward functions and the pool's failure policy (real worker processes, real timeouts)."""

import logging
import math
from types import SimpleNamespace

import pytest

from hybrid_rl.rewards.functions import format_reward, last_boxed, load_custom, math_reward, resolve
from hybrid_rl.rewards.pool import RewardFailure, RewardPool

pytestmark = pytest.mark.unit

BAD = """
import math, time
def raises(ds, s, gt, extra=None):
    raise RuntimeError("boom")
def hangs(ds, s, gt, extra=None):
    time.sleep(60)
def nan(ds, s, gt, extra=None):
    return math.nan
def none(ds, s, gt, extra=None):
    return None
def text(ds, s, gt, extra=None):
    return "1.0"
def as_dict(ds, s, gt, extra=None):
    return {"score": 0.5, "length": len(s)}
def by_text(ds, s, gt, extra=None):
    if s == "hang":
        time.sleep(60)
    if s == "raise":
        raise ValueError("bad")
    return 1.0
def np_score(ds, s, gt, extra=None):
    import numpy as np
    return {"score": np.float32(0.25), "hits": np.int64(3), "note": "text", "bad": float("nan")}
def sleeps(ds, s, gt, extra=None):
    time.sleep(float(s))
    return 1.0
"""


@pytest.mark.parametrize(
    ("text", "gt", "want"),
    [
        ("3 + 4 = 7. The answer is \\boxed{7}.", "7", 1.0),
        # An integer ground truth needs an integer: an unevaluated expression is not an answer
        # (math-verify evaluates it, and GRPO learned to box the question's sum instead of computing it).
        ("\\boxed{\\frac{14}{2}}", "7", 0.0),
        ("41 + 35 = 71. The answer is \\boxed{41 + 35}.", "76", 0.0),
        ("The answer is \\boxed{12 \\times 3}.", "36", 0.0),
        ("\\boxed{30-14}", "16", 0.0),
        ("41 + 35", "76", 0.0),
        ("The answer is 76.", "76", 1.0),
        ("\\boxed{$-7$}", "-7", 1.0),
        ("\\boxed{12 \\text{ apples}}", "12", 1.0),
        ("\\boxed{12.0}", "12", 1.0),
        # Other ground truths are compared symbolically by math-verify.
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("The answer is \\boxed{8}.", "7", 0.0),
        ("seven", "7", 0.0),
        ("\\boxed{1,234}", "1234", 1.0),
        ("#### is not here \\boxed{72}", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
        ("\\boxed{7} then \\boxed{9}", "9", 1.0),
    ],
)
def test_math_reward(text, gt, want):
    assert math_reward("x", text, gt) == want


def test_format_and_boxed():
    assert format_reward("x", "a \\boxed{3}", "3") == 1.0
    assert format_reward("x", "no box", "3") == 0.0
    assert format_reward("x", "\\boxed{1} \\boxed{2}", "3") == 0.0
    assert last_boxed("x \\boxed{\\frac{1}{2}} y") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None


def test_custom_loader_errors_name_file_and_function(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(BAD)
    assert callable(load_custom(str(f), "nan"))
    with pytest.raises(AttributeError, match="has no function 'missing'.*raises"):
        load_custom(str(f), "missing")
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_custom(str(tmp_path / "nope.py"), "f")
    with pytest.raises(KeyError, match="known: code, format, math"):
        resolve("mathh")


def pool_for(tmp_path, functions, timeout=1.0, max_failed=2):
    f = tmp_path / "bad_rewards.py"
    f.write_text(BAD)
    fns = [SimpleNamespace(name="custom", weight=1.0, path=str(f), function=fn) for fn in functions]
    return RewardPool(
        SimpleNamespace(functions=fns, num_workers=2, timeout_s=timeout, failure_score=0.0, max_failed_steps=max_failed)
    )


def test_pool_scores_failures_per_policy_and_keeps_going(tmp_path):
    pool = pool_for(tmp_path, ["by_text"])
    try:
        res = pool.score([("d", "ok", "1", {}), ("d", "hang", "1", {}), ("d", "raise", "1", {}), ("d", "ok", "1", {})])
        assert [r.score for r in res] == [1.0, 0.0, 0.0, 1.0]
        assert res[1].timed_out and "timed out" in res[1].error
        assert "ValueError: bad" in res[2].error
        pool.check_failures(res)  # some succeeded: no stop
        assert pool.failed_steps == 0
        # the pool still works after a worker was killed for a timeout
        assert pool.score([("d", "ok", "1", {})])[0].score == 1.0
    finally:
        pool.close()


@pytest.mark.parametrize("fn", ["nan", "none", "text", "raises"])
def test_invalid_returns_score_failure(tmp_path, fn):
    pool = pool_for(tmp_path, [fn])
    try:
        (r,) = pool.score([("d", "s", "1", {})])
        assert r.score == 0.0 and r.failed == 1 and r.error
    finally:
        pool.close()


def test_dict_rewards_and_always_failing_stops_run(tmp_path):
    pool = pool_for(tmp_path, ["as_dict", "raises"], max_failed=2)
    try:
        (r,) = pool.score([("d", "abcd", "1", {})])
        assert r.components == {"as_dict": 0.5, "raises": 0.0}
        assert math.isclose(r.score, 0.5) and r.failed == 1
        assert r.extra.get("length") == 4.0
    finally:
        pool.close()
    pool = pool_for(tmp_path, ["raises"], max_failed=2)
    try:
        pool.check_failures(pool.score([("d", "s", "1", {})]))
        with pytest.raises(RewardFailure, match="2 consecutive steps.*boom"):
            pool.check_failures(pool.score([("d", "s", "1", {})]))
    finally:
        pool.close()


def test_a_reward_raising_on_some_answers_logs_one_traceback_then_counts(tmp_path, caplog):
    """A reward raising on 6 of 10 answers left nothing but reward/failed=6: now its first
    ValueError is printed with the worker's traceback (the line that raised), naming the
    function; the other 5 are not printed each but counted in one line (at the latest on close)."""
    pool = pool_for(tmp_path, ["by_text"])
    try:
        with caplog.at_level(logging.WARNING, logger="hybrid_rl"):
            res = pool.score([("d", "raise" if i % 5 < 3 else "ok", "1", {}) for i in range(10)])
            assert sum(r.failed for r in res) == 6
            full = [r.getMessage() for r in caplog.records if "Traceback" in r.getMessage()]
            assert len(full) == 1, caplog.text
            assert "by_text" in full[0] and "ValueError: bad" in full[0] and 'raise ValueError("bad")' in full[0]
            pool.score([("d", "raise", "1", {})])  # the same kind again: counted, not printed in full
            assert sum("Traceback" in r.getMessage() for r in caplog.records) == 1
    finally:
        with caplog.at_level(logging.WARNING, logger="hybrid_rl"):
            pool.close()
    assert "by_text: ValueError x6" in caplog.text  # 5 + 1 repeats, said once at the end


def test_a_timeout_is_said_with_the_function_and_the_setting_and_a_slow_wait_too(tmp_path, caplog):
    pool = pool_for(tmp_path, ["sleeps"], timeout=1.0)
    pool.slow_report_s = 0.4
    try:
        with caplog.at_level(logging.WARNING, logger="hybrid_rl"):
            res = pool.score([("d", "30", "1", {}), ("d", "0", "1", {})])
    finally:
        pool.close()
    assert [r.timed_out for r in res] == [True, False]
    lines = [r.getMessage() for r in caplog.records]
    timeouts = [m for m in lines if "timed out" in m]
    assert len(timeouts) == 1 and "1 of 2 responses" in timeouts[0]
    assert "reward.timeout_s=1 s" in timeouts[0] and "sleeps" in timeouts[0]
    assert any("still scoring after" in m and "1 of 2 responses done" in m for m in lines), lines


def test_numpy_scores_count_and_extras_that_cannot_be_logged_are_said(tmp_path, caplog):
    """verl-style functions often return numpy numbers: they are numbers, not failures. An extra
    that is not a finite number is left out of reward/<key>, and said once."""
    pool = pool_for(tmp_path, ["np_score"])
    try:
        with caplog.at_level(logging.WARNING, logger="hybrid_rl"):
            res = pool.score([("d", "s", "1", {})] * 3)
    finally:
        pool.close()
    assert [(r.score, r.failed) for r in res] == [(0.25, 0)] * 3 and res[0].extra == {"hits": 3.0}
    notes = [r.getMessage() for r in caplog.records if "not logged as" in r.getMessage()]
    assert sorted(n.split("returned ")[1].split(" =")[0] for n in notes) == ["'bad'", "'note'"]


@pytest.mark.parametrize(("field", "value"), [("num_workers", 0), ("timeout_s", 0.0), ("timeout_s", -1.0)])
def test_reward_settings_pebble_would_quietly_change_are_refused(tmp_path, field, value):
    """pebble takes timeout 0 as no timeout at all (a hung reward hangs the run), a negative one
    times every response out, and num_workers=0 was raised to 1 without a word."""
    f = tmp_path / "r.py"
    f.write_text(BAD)
    cfg = dict(num_workers=1, timeout_s=1.0, failure_score=0.0, max_failed_steps=1)
    cfg[field] = value
    fns = [SimpleNamespace(name="custom", weight=1.0, path=str(f), function="nan")]
    with pytest.raises(ValueError, match=f"reward.{field}="):
        RewardPool(SimpleNamespace(functions=fns, **cfg))


def test_two_functions_of_one_name_keep_their_own_component(tmp_path, caplog):
    f = tmp_path / "r.py"
    f.write_text(BAD)
    fns = [SimpleNamespace(name="custom", weight=1.0, path=str(f), function="as_dict"),
           SimpleNamespace(name="custom", weight=1.0, path=str(f), function="as_dict")]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hybrid_rl"):
        pool = RewardPool(SimpleNamespace(functions=fns, num_workers=1, timeout_s=5.0, failure_score=0.0, max_failed_steps=1))
    try:
        (r,) = pool.score([("d", "ab", "1", {})])
    finally:
        pool.close()
    assert r.components == {"as_dict": 0.5, "as_dict_1": 0.5} and r.score == 1.0
    assert "reward.functions[1] is reported as reward/as_dict_1" in caplog.text
