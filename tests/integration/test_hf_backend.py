"""The second rollout backend (transformers' generate) against the real vLLM engine and the trainer."""

import pytest
import torch

from hybrid_rl.batch import Sample, collate
from hybrid_rl.rollout.base import SamplingSpec, prompt_seed

pytestmark = pytest.mark.integration


def chat(tokenizer, text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


@pytest.fixture(scope="module")
def hf_engine(ctx, tiny_path):
    from hybrid_rl.config import RolloutConfig
    from hybrid_rl.rollout.backends import build_backend

    return build_backend("hf", tiny_path, RolloutConfig(), "float32", 0, ctx.device, 512, False)


def test_greedy_tokens_and_logprobs_equal_vllm(hf_engine, vllm_engine, tokenizer):
    """Same greedy tokens as vLLM (prompts of different lengths: left padding must not leak),
    log-probs within 1e-4 in fp32, and the same finish reasons."""
    prompts = [chat(tokenizer, f"Gia has {i} pens{' and ' + str(3 * i) + ' cards' * i if i else ''}.") for i in range(5)]
    assert len({len(p) for p in prompts}) > 1
    spec = SamplingSpec(n=1, temperature=0.0, max_tokens=24)
    ours = hf_engine.generate(prompts, spec)
    theirs = vllm_engine.generate(prompts, spec)
    for a, b in zip(ours, theirs, strict=True):
        ca, cb = a.completions[0], b.completions[0]
        assert ca.token_ids == cb.token_ids
        assert ca.finish_reason == cb.finish_reason
        assert max(abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs, strict=True)) < 1e-4
    assert hf_engine.last_stats.generated_tokens == sum(len(r.completions[0].token_ids) for r in ours)
    assert hf_engine.last_stats.cached_prompt_tokens == 0  # no prefix sharing, said honestly


def test_sampler_logprobs_match_the_trainer_after_a_sync(ctx, tiny_path, hf_engine, tokenizer):
    """After a training step and a weight push through the switch: the backend's sampler log-probs
    (temperature, top-k, top-p, renormalised) equal the trainer head's to 1e-4; per-prompt seeds
    give different groups for the same prompt and the same groups again."""
    from safetensors.torch import load_file

    from hybrid_rl.algorithms.losses import agg_weights, make_sft_loss
    from hybrid_rl.config import ActorConfig, ModelConfig
    from hybrid_rl.engine.builders import build_policy_engine
    from hybrid_rl.engine.heads import Sampling
    from hybrid_rl.hybrid.switch import HybridSwitch

    actor = build_policy_engine(
        tiny_path, ModelConfig(attn_implementation="sdpa"), ActorConfig(lr=1e-3, param_dtype=None), ctx, 10
    )
    prompts = [chat(tokenizer, f"Hugo has {i} coins.") for i in range(3)]
    warm = collate([Sample(p, p[-6:], [0.0] * 6, [1] * 6, "stop", i) for i, p in enumerate(prompts)], tokenizer.pad_token_id)
    warm.loss_weights = agg_weights(warm.response_mask, "token-mean", float(warm.response_mask.sum()), 3.0)
    actor.train_batch(warm, make_sft_loss())
    before = {n: p.clone() for n, p in hf_engine.model.named_parameters()}
    switch = HybridSwitch(actor, hf_engine, sync_dtype=torch.float32, bucket_bytes=1 << 20)
    switch.policy_updated()
    switch.to_rollout()
    assert switch.engine_version == 1
    assert any(not torch.equal(before[n], p) for n, p in hf_engine.model.named_parameters())
    try:
        same = [prompts[0]] * 3
        spec = SamplingSpec(n=4, max_tokens=16, temperature=0.7, top_k=20, top_p=0.8, seeds=[prompt_seed(3, i) for i in range(3)])
        res = hf_engine.generate(same, spec)
        groups = [tuple(tuple(c.token_ids) for c in g.completions) for g in res]
        assert len(set(groups)) == 3
        again = hf_engine.generate(same, spec)
        assert [tuple(tuple(c.token_ids) for c in g.completions) for g in again] == groups
        samples = [Sample(r.prompt_ids, c.token_ids, c.logprobs, [1] * len(c.token_ids), c.finish_reason, i)
                   for i, r in enumerate(res) for c in r.completions]  # fmt: skip
        batch = collate(samples, tokenizer.pad_token_id)
        lp = actor.forward_logprobs(batch, Sampling(0.7, 20, 0.8))
        diff = ((lp - batch.rollout_logprobs).abs() * batch.response_mask).max().item()
        assert diff < 1e-4, f"max |trainer - hf sampler| = {diff}"
        full = actor.forward_logprobs(batch, 0.7)  # without the truncation the comparison fails
        assert ((full - batch.rollout_logprobs).abs() * batch.response_mask).max().item() > 1e-2
    finally:
        hf_engine.load_weights(load_file(f"{tiny_path}/model.safetensors").items())


def test_stop_reasons_and_multi_turn_queue(hf_engine, tokenizer):
    """EOS ends a row (kept, like vLLM); max_tokens gives "length"; a stop string ends a row and
    stays in the text when asked; submit/poll serve the agent loop."""
    p = chat(tokenizer, "Ivy has 2 shells.")
    long = hf_engine.generate([p], SamplingSpec(n=2, max_tokens=3, temperature=1.0, ignore_eos=True, seed=1))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 3 for c in long[0].completions)
    res = hf_engine.generate([p], SamplingSpec(n=8, max_tokens=64, temperature=1.0, seed=2))
    for c in res[0].completions:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] in hf_engine.eos_ids
        else:
            assert len(c.token_ids) == 64
    text = hf_engine.generate([p], SamplingSpec(n=1, max_tokens=40, temperature=0.0, ignore_eos=True))[0].completions[0].text
    stop = text[5:7]
    hit = hf_engine.generate([p], SamplingSpec(n=1, max_tokens=40, temperature=0.0, stop=[stop], include_stop_str_in_output=True))
    c = hit[0].completions[0]
    assert c.finish_reason == "stop" and c.text.endswith(stop) and len(c.token_ids) < 40
    hf_engine.submit("a", p, SamplingSpec(n=1, max_tokens=4, temperature=1.0, seed=5))
    hf_engine.submit("b", p, SamplingSpec(n=1, max_tokens=6, temperature=1.0, seed=6))
    assert hf_engine.has_pending()
    done = {}
    while hf_engine.has_pending():
        done.update(dict(hf_engine.poll()))
    assert set(done) == {"a", "b"} and len(done["a"].token_ids) <= 4 and len(done["b"].token_ids) <= 6
