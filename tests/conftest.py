"""Test session set-up: the process environment first, then shared (session-scoped) real parts.

One vLLM engine and one reward pool serve the whole session (engine start and spawned workers
cost seconds each on 2 cores). Tests that need several ranks run their own torchrun.
"""

from __future__ import annotations

import os

from hybrid_rl.env import setup_process_env

setup_process_env(threads_per_rank=int(os.environ.get("OMP_NUM_THREADS", "2")))

import pytest  # noqa: E402

# What the CI machine is set up to have (.ci/run sets HYBRID_RL_CI_REQUIRES): a test needing one
# of these fails there instead of skipping, so a broken install step cannot pass as green.
CI_REQUIRES = set(os.environ.get("HYBRID_RL_CI_REQUIRES", "").split())


def need(what: str, available: bool, why: str) -> None:
    """Skip (one line saying why) where ``what`` is missing, or fail where CI requires it."""
    if available:
        return
    if what in CI_REQUIRES:
        pytest.fail(f"{what} is required on this machine (HYBRID_RL_CI_REQUIRES) but missing: {why}")
    pytest.skip(why)


@pytest.fixture(scope="session")
def ctx():
    """A 1-rank gloo process group (the engine and sync code always run under one)."""
    from hybrid_rl.dist import init_distributed

    return init_distributed("cpu")


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from hybrid_rl.models.tiny import tiny_model_path

    return str(tiny_model_path("tiny"))


@pytest.fixture(scope="session")
def micro_path() -> str:
    from hybrid_rl.models.tiny import tiny_model_path

    return str(tiny_model_path("micro"))


@pytest.fixture(scope="session")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="session")
def vllm_engine(ctx, tiny_path):
    """The session's one real vLLM engine (in-process, CPU), on the tiny model in fp32."""
    from hybrid_rl.config import RolloutConfig
    from hybrid_rl.rollout.vllm_engine import VLLMRollout

    cfg = RolloutConfig(block_size=32, kv_cache_gib=0.25)
    return VLLMRollout(tiny_path, cfg, "float32", seed=0, device=ctx.device, max_model_len=512)


@pytest.fixture(scope="session")
def reward_pool():
    from types import SimpleNamespace

    from hybrid_rl.rewards.pool import RewardPool

    fns = [SimpleNamespace(name="math", weight=1.0, path=None, function=None)]
    pool = RewardPool(SimpleNamespace(functions=fns, num_workers=1, timeout_s=10.0, failure_score=0.0, max_failed_steps=3))
    yield pool
    pool.close()
