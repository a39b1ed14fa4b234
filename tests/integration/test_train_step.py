"""The RL trainer's update on one batch, in-process (no vLLM, no subprocess): the real FSDP2 actor
on the micro model, the trainer's own log-prob, advantage and update code, a fake rollout engine
behind the switch. The samples that scored higher must become more likely: a flipped advantage
sign fails this test."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from hybrid_rl.batch import Rollout, Sample, collate
from hybrid_rl.config import register_configs
from hybrid_rl.engine.builders import build_policy_engine
from hybrid_rl.hybrid.switch import HybridSwitch
from hybrid_rl.trainer.build import RLParts, conf_dir
from hybrid_rl.trainer.rl import RLTrainer
from tests.fakes import NullEngine

pytestmark = pytest.mark.integration
register_configs()


def make_trainer(ctx, micro_path, tmp_path, *overrides):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=["+recipe=grpo_math", "trainer.nproc_per_node=1", "data.train_batch_size=2", "rollout.n=4",
                       f"trainer.output_dir={tmp_path}", "trainer.resume=none", "logger.backends=[jsonl]",
                       "logger.progress_bar=false", "actor.lr=1e-2", "actor.packing=false", *overrides],
        )  # fmt: skip
    actor = build_policy_engine(micro_path, cfg.model, cfg.actor, ctx, total_steps=10)
    engine = NullEngine()
    switch = HybridSwitch(actor, engine, sync_dtype=None, bucket_bytes=1 << 20)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(micro_path)
    parts = RLParts(tok, [], [], [], None, actor, None, None, engine, switch, None, None, None)
    return RLTrainer(cfg, ctx, parts)


def rollout() -> Rollout:
    """Two prompts x 4 answers; in each group the answers starting with token 7 scored 1."""
    samples = []
    for g in range(2):
        for k in range(4):
            first = 7 if k % 2 == 0 else 9
            resp = [first, 11 + k, 13]
            samples.append(Sample([3, 4, 5 + g], resp, [-1.0] * 3, [1] * 3, "stop", g, score=float(first == 7)))
    return Rollout(samples, weights_version=0)


@pytest.mark.parametrize("loss", ["token-mean", "seq-mean-token-sum-norm"])
def test_one_update_makes_the_rewarded_answers_more_likely(ctx, micro_path, tmp_path, loss):
    trainer = make_trainer(ctx, micro_path, tmp_path, f"algorithm.loss_agg_mode={loss}")
    data = rollout()
    batch = collate(data.samples, 0)
    before = trainer.actor.forward_logprobs(batch)
    m = trainer.train_on_batch(data)
    after = trainer.actor.forward_logprobs(batch)
    assert m["advantage/abs_mean"] > 0 and m["actor/grad_norm"] > 0
    assert trainer.switch.weights_version == 1  # the update bumps the trainer's version
    good = torch.tensor([s.score == 1.0 for s in data.samples])
    delta = (after - before)[:, 0]  # the first response token is what the reward depends on
    # the rewarded first token gains on the other (a flipped advantage reverses this)
    assert delta[good].mean() - delta[~good].mean() > 0.05, delta
