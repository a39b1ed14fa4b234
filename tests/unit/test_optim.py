"""The learning-rate schedule (``hybrid_rl.engine.optim.lr_lambda``), against hand-computed values."""

import math

import pytest

from hybrid_rl.engine.optim import OptimConfig, lr_lambda

pytestmark = pytest.mark.unit


def cfg(schedule: str, warmup: int, total: int = 10, min_ratio: float = 0.1) -> OptimConfig:
    return OptimConfig(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), warmup_steps=warmup, schedule=schedule,
                       min_lr_ratio=min_ratio, total_steps=total, grad_clip=1.0)  # fmt: skip


def test_linear_warmup_starts_above_zero_and_reaches_the_peak():
    """Optimizer step 0 already trains (1/warmup of the peak, not 0), step warmup-1 is at the peak."""
    f = lr_lambda(cfg("constant", warmup=4))
    assert [f(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_from_the_peak_to_min_lr_ratio_after_warmup():
    f = lr_lambda(cfg("cosine", warmup=2, total=10, min_ratio=0.1))
    assert f(0) == 0.5 and f(2) == pytest.approx(1.0)
    # halfway through the 8 decay steps: min + (1 - min) * 0.5 * (1 + cos(pi / 2))
    assert f(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(10) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)  # held at the floor past the end
    assert all(f(s) > f(s + 1) for s in range(2, 10))


def test_no_warmup_constant_is_one():
    f = lr_lambda(cfg("constant", warmup=0))
    assert {f(s) for s in range(5)} == {1.0}
