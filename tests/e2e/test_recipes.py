"""Every RL recipe composes and runs a few steps on CPU through the main entry point."""

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
LENGTH_REWARD = ROOT / "tests" / "e2e" / "length_reward.py"
FAST = [
    "+overlay=ci_tiny",
    "trainer.nproc_per_node=1",
    "rollout.max_response_length=24",
    "trainer.total_steps=2",
    "actor.micro_batch_size=16",
    # a random-init model gets no math right; a length reward gives the groups some variance
    f"reward.functions=[{{name: custom, weight: 1.0, path: {LENGTH_REWARD}, function: score}}]",
    # every training sample with its score, group and advantage (generations/train_step_XXXX.jsonl)
    "logger.generations=100000",
    "logger.generations_every=1",
]
RECIPES = {
    "grpo_math": ["trainer.profile_steps=[2]"],
    "dapo_math": [],
    "gspo_math": [],
    "gfpo_math": ["rollout.n=8", "algorithm.gfpo.keep=4"],
    "rloo_math": [],
    "drgrpo_math": [],
    "reinforce_math": [],
    "reinforce_pp_math": [],
    "reinforce_pp_baseline_math": [],
    "remax_math": [],
    "ppo_math": ["critic.warmup_steps=1"],
}
# agentic_math_tool runs through the main entry point in test_agentic_tools.py, from a model that
# calls the tool (a random-init one never does, so a case here would run no tool call)


def run(out: Path, recipe: str, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "hybrid_rl.main", f"+recipe={recipe}", *FAST, f"trainer.output_dir={out}", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-6000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_runs(tmp_path, recipe):
    rows = [r for r in run(tmp_path, recipe, *RECIPES[recipe]) if "weights_version" in r]
    assert [r["step"] for r in rows] == [1, 2]
    updated = [r for r in rows if "actor/loss" in r or "critic/vf_loss" in r]
    assert updated, "no update ran"
    for r in updated:
        for k in ("actor/loss", "actor/grad_norm", "critic/vf_loss"):
            if k in r:
                assert r[k] == r[k] and abs(r[k]) < 1e6
    if recipe == "ppo_math":
        assert "critic/vf_loss" in rows[0] and "actor/loss" not in rows[0]  # warm-up: critic only
        assert "actor/loss" in rows[1]
    if recipe == "grpo_math":  # verl's names for the same quantities
        verl = {"critic/score/mean", "critic/score/max", "critic/advantages/min", "response_length/mean", "response_length/clip_ratio",
                "prompt_length/mean", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/step",
                "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm"}  # fmt: skip
        assert verl <= set(rows[0]), verl - set(rows[0])
        assert rows[0]["critic/score/min"] <= rows[0]["critic/score/mean"] <= rows[0]["critic/score/max"]
        # the overlay's data.train_size: the first 1,024 of the 20,000 training prompts are read
        assert "data.train_files: 1024 rows read (train.parquet 1024)" in (tmp_path / "main.log").read_text()
        # trainer.profile_steps=[2]: that step's buckets (GEMMs in generation and the update) and a
        # Chrome trace labelled with the step's phases and the engine's own ranges
        assert "profile/gemm_s" not in rows[0] and rows[1]["profile/gemm_s"] > 0
        assert sum(v for k, v in rows[1].items() if k.startswith("profile/") and k != "profile/wall_s") == pytest.approx(rows[1]["profile/wall_s"], rel=0.05)
        trace = json.loads(gzip.decompress((tmp_path / "profile" / "step_000002_rank0.json.gz").read_bytes()))
        labels = {"phase/generate", "phase/update", "hybrid_rl/forward", "hybrid_rl/backward", "hybrid_rl/optimizer"}
        assert labels <= {e.get("name") for e in trace["traceEvents"]}
    if recipe == "dapo_math":
        assert "dapo/gen_rounds" in rows[0]
    if recipe == "remax_math":
        assert "rollout/greedy_baseline_mean" in rows[0]
    if recipe in ADVANTAGES:  # the recipe's own estimator, recomputed from the logged scores
        for step in (1, 2):
            samples = [json.loads(x) for x in (tmp_path / "generations" / f"train_step_{step:04d}.jsonl").read_text().splitlines()]
            got, want = [r["advantage"] for r in samples], ADVANTAGES[recipe](samples)
            assert got == pytest.approx(want, rel=1e-3, abs=1e-4), (recipe, step)


def _groups(rows: list[dict]) -> list[list[int]]:
    out: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        out.setdefault(r["group"], []).append(i)
    return list(out.values())


def _by_group(rows: list[dict], fn) -> list[float]:
    """``fn(scores of one group)`` -> that group's advantages, placed back in row order."""
    adv = [0.0] * len(rows)
    for idx in _groups(rows):
        for i, a in zip(idx, fn([rows[i]["score"] for i in idx]), strict=True):
            adv[i] = a
    return adv


def _grpo(s: list[float]) -> list[float]:
    m = sum(s) / len(s)
    sd = math.sqrt(sum((x - m) ** 2 for x in s) / (len(s) - 1)) if len(s) > 1 else 0.0
    return [(x - m) / (sd + 1e-6) for x in s]


def _centred(s: list[float], scale: float = 1.0) -> list[float]:
    return [(x - sum(s) / len(s)) * scale for x in s]


def _whitened_over_tokens(rows: list[dict], adv: list[float]) -> list[float]:
    """masked_whiten of per-sample values broadcast over each response's tokens (unbiased variance)."""
    n = [r["response_tokens"] for r in rows]
    mean = sum(a * k for a, k in zip(adv, n, strict=True)) / sum(n)
    var = sum(k * (a - mean) ** 2 for a, k in zip(adv, n, strict=True)) / (sum(n) - 1)
    return [(a - mean) / math.sqrt(var + 1e-8) for a in adv]


# Hand-written from each paper's formula (not the library's): a recipe wired to another estimator
# (rloo mapped to grpo, drgrpo still dividing by the std, a batch baseline in place of a group
# one) fails here even though it trains.
ADVANTAGES = {
    "grpo_math": lambda rows: _by_group(rows, _grpo),
    "dapo_math": lambda rows: _by_group(rows, _grpo),
    "gspo_math": lambda rows: _by_group(rows, _grpo),
    "drgrpo_math": lambda rows: _by_group(rows, _centred),
    "rloo_math": lambda rows: _by_group(rows, lambda s: _centred(s, len(s) / (len(s) - 1))),
    "reinforce_math": lambda rows: [r["score"] - sum(x["score"] for x in rows) / len(rows) for r in rows],
    "reinforce_pp_baseline_math": lambda rows: _whitened_over_tokens(rows, _by_group(rows, _centred)),
}


# rollout.backend=hf cases; the agentic one also runs here (the recipe table above has no agentic row)
HF_BACKEND = {"grpo_math": RECIPES["grpo_math"], "ppo_math": RECIPES["ppo_math"], "agentic_math_tool": ["rollout.agent.max_response_tokens=64"]}


@pytest.mark.parametrize("recipe", sorted(HF_BACKEND))
def test_transformers_rollout_backend_trains(tmp_path, recipe):
    """rollout.backend=hf (no vLLM): single-turn groups, PPO with a critic (the switch's idle
    engines) and the multi-turn agent loop (submit/poll) train through the same trainer."""
    rows = [r for r in run(tmp_path, recipe, "rollout.backend=hf", *HF_BACKEND[recipe]) if "weights_version" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert any("actor/loss" in r for r in rows)
    assert all(r["rollout/prefix_cached_tokens"] == 0 for r in rows if "rollout/prefix_cached_tokens" in r)
    assert any(r.get("reward/std", 0) > 0 for r in rows)  # a signal to learn from


def test_rlhf_ppo_with_a_learned_reward_model(tmp_path):
    """rm_math trains a reward model; rlhf_ppo scores with it and a second one (an untrained
    head on the base model) as a worst-case ensemble, standardised over both ranks' batch."""
    from tests.e2e.test_preference import write_pairs

    write_pairs(tmp_path / "pairs.jsonl", 64, 0)
    cmd = [
        sys.executable,
        "-m",
        "hybrid_rl.main",
        "+recipe=rm_math",
        "model.path=builtin:tiny",
        f"data.train_files=[{tmp_path / 'pairs.jsonl'}]",
        f"data.val_files=[{tmp_path / 'pairs.jsonl'}]",
        f"trainer.output_dir={tmp_path / 'rm'}",
        "trainer.total_steps=4",
        "data.train_batch_size=16",
        "logger.progress_bar=false",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-5000:]
    rows = [
        r
        for r in run(
            tmp_path / "ppo",
            "rlhf_ppo",
            "reward.functions=[]",
            f"reward.reward_model.path={tmp_path / 'rm' / 'hf'}",
            "reward.reward_model.ensemble=[builtin:tiny]",
            "reward.reward_model.ensemble_reduce=min",
            "critic.warmup_steps=0",
        )
        if "weights_version" in r
    ]
    assert all("reward/reward_model" in r and "actor/reward_kl_penalty" in r for r in rows)
    # two different models scored every step; the min of standardised scores is below their mean (0)
    assert all(r["reward/reward_model_0"] != r["reward/reward_model_1"] and r["reward/reward_model_disagreement"] > 0 for r in rows)
    assert all(r["reward/reward_model"] < 0 for r in rows)
    assert rows[0]["actor/reward_kl_penalty_coeff"] == pytest.approx(0.01)
    assert rows[1]["actor/reward_kl_penalty_coeff"] != rows[0]["actor/reward_kl_penalty_coeff"]  # the adaptive controller moved it


# top-k / top-p sampling with KL in the reward, a KL loss and the adaptive controller
TRUNCATED = [
    "rollout.top_k=20", "rollout.top_p=0.9", "algorithm.kl_reward.enable=true", "algorithm.kl_loss.enable=true",
    "algorithm.kl_reward.ctrl=adaptive", "trainer.total_steps=3",
]  # fmt: skip


@pytest.mark.parametrize("recipe", ["grpo_math", "gspo_math"])
def test_truncated_sampling_with_kl_stays_finite(tmp_path, recipe):
    """A truncated head gave padding targets log-prob -inf, and -inf x 0 = NaN reached the old
    log-probs, the KL-in-reward advantages, GSPO's sequence ratio and the KL controller."""
    rows = [r for r in run(tmp_path, recipe, *TRUNCATED) if "weights_version" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (r["step"], bad)
        assert r["actor/grad_norm"] > 0 and r["actor/skipped_steps"] == 0
    # Step 1's policy is the reference: untruncated on both sides, the KL is 0 (it was ~0.005 at top_p=0.9).
    assert abs(rows[0]["actor/ref_kl_k3"]) < 1e-6 and abs(rows[0]["actor/reward_kl_penalty"]) < 1e-6
    assert rows[2]["actor/reward_kl_penalty"] > 0 and rows[1]["actor/reward_kl_penalty_coeff"] != rows[0]["actor/reward_kl_penalty_coeff"]
