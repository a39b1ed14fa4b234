"""Tests that fail when the update is wrong: the real stack (vLLM + FSDP2 on 2 torchrun ranks)
must raise a reward that a random-init model can move in a few steps (the share of digits in
the answer, ~0.01 at the start). With the advantage's sign flipped these runs drive the reward
to 0 and fail (see the README's "Tests that can fail" section for the measured figures).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.learning
ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "tests" / "learning" / "digit_reward.py"

COMMON = [
    "+overlay=ci_tiny",
    "algorithm.filter_groups=false",
    "trainer.nproc_per_node=2",
    "data.train_batch_size=8",
    "rollout.n=8",
    "actor.lr=1e-3",
    "trainer.total_steps=12",
    f"reward.functions=[{{name: custom, weight: 1.0, path: {DIGITS}, function: score}}]",
]


def train(out: Path, recipe: str, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "hybrid_rl.main", f"+recipe={recipe}", *COMMON, f"trainer.output_dir={out}", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stderr[-6000:]
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]


def assert_learns(rows: list[dict], trained_from: int = 1) -> None:
    rewards = [r["reward/mean"] for r in rows]
    start, end = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    # measured: GRPO 0.013 -> 0.68, PPO 0.009 -> 0.55 over 12 steps; flipped sign: -> 0.00
    assert end > start + 0.2, f"reward did not rise: {[round(x, 3) for x in rewards]}"
    for r in rows[trained_from - 1 :]:
        assert r["advantage/abs_mean"] > 0, r
        assert r["actor/grad_norm"] > 0, r


def test_grpo_raises_the_reward(tmp_path):
    assert_learns(train(tmp_path, "grpo_math"))


def test_ppo_with_a_critic_raises_the_reward(tmp_path):
    rows = train(tmp_path, "ppo_math", "critic.warmup_steps=2")
    assert all(r["critic/value_loss"] > 0 for r in rows)
    assert_learns(rows, trained_from=3)


def test_default_recipe_raises_sampled_accuracy(tmp_path):
    """The main job itself (+recipe=grpo_math: the short SFT warm start, built and cached on first
    use, at 100 of its 300 GRPO steps, on the strict math verifier), validated on 512 held-out problems:
    the train reward and the held-out sampled accuracy (mean@4, T=1) must rise, and greedy
    accuracy must not collapse. Measured (2 cores, AMX-bf16): train reward, steps 1-20 -> 81-100,
    0.240 -> 0.302 (seed 0) and 0.235 -> 0.284 (seed 1), +5 to +7 points in all eight runs tried
    (fp32, G=16, another warm start); held-out mean@4 0.248 -> 0.322 (seed 0), 0.243 -> 0.281
    (seed 1), s.e. of the difference ~0.013; greedy 0.336 -> 0.342 / 0.332. On 2 avx512_bf16 cores
    (session 10): train reward 0.225 -> 0.276, mean@4 (1,024 held-out) 0.227 -> 0.268, greedy 0.319
    -> 0.312. With the advantage's sign flipped it fails: train reward 0.079 -> 0.001. Not a
    +10-point greedy gain: the default job does not make one honestly (see the README; the earlier
    +43 was the model boxing unevaluated expressions)."""
    cmd = [
        sys.executable, "-m", "hybrid_rl.main", "+recipe=grpo_math", f"trainer.output_dir={tmp_path}",
        "trainer.total_steps=100", "trainer.val_every=100", "data.val_size=512", "trainer.export_hf=false", "logger.progress_bar=false",
        "trainer.save_every=0",
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT, timeout=1200)
    assert p.returncode == 0, p.stderr[-6000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r for r in rows if "val/accuracy" in r}
    assert set(val) == {0, 100}, sorted(val)
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert last >= first + 0.03, f"train reward {first:.3f} -> {last:.3f}"
    m0, m1 = val[0]["val/mean@4"], val[100]["val/mean@4"]
    assert m1 >= m0 + 0.02, f"held-out mean@4 {m0:.3f} -> {m1:.3f}"
    g0, g1 = val[0]["val/accuracy"], val[100]["val/accuracy"]
    assert g1 >= g0 - 0.03, f"held-out greedy accuracy fell: {g0:.3f} -> {g1:.3f}"


@pytest.mark.slow
def test_agentic_recipe_learns_to_call_the_tool(tmp_path):
    """The agentic recipe at 20 of its 60 steps (the mixed tool-use warm start is built and cached
    on first use, ~7.5 min on 2 cores; not in CI): greedy decoding starts by answering level-5
    products in its head and must learn to call the tool. Measured: held-out greedy 0.002 -> 0.834
    on 512 problems, greedy tool calls 0% -> 100% at step 20 (twice, identical)."""
    cmd = [
        sys.executable, "-m", "hybrid_rl.main", "+recipe=agentic_math_tool", f"trainer.output_dir={tmp_path}",
        "trainer.total_steps=20", "trainer.val_every=20", "data.val_size=256", "rollout.val_pass_k=0",
        "trainer.export_hf=false", "logger.progress_bar=false", "trainer.save_every=0",
    ]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT, timeout=2400)
    assert p.returncode == 0, p.stderr[-6000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r for r in rows if "val/accuracy" in r}
    assert val[0]["val/tool_call_rate"] < 0.2 and val[0]["val/accuracy"] < 0.1, val[0]
    assert val[20]["val/tool_call_rate"] > 0.9, val[20]
    assert val[20]["val/gain"] > 0.4 and val[20]["val/gain"] > 5 * val[20]["val/gain_se"], val[20]
