"""Reward functions and the pool's failure policy (real worker processes, real timeouts)."""

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
