"""The default model in transformers and in the real vLLM engine; the FSDP2 engine on one rank."""

import math

import pytest
import torch

from hybrid_rl.algorithms.losses import agg_weights, make_sft_loss
from hybrid_rl.batch import Sample, collate
from hybrid_rl.engine.heads import logprobs_and_entropy
from hybrid_rl.rollout.base import SamplingSpec

pytestmark = pytest.mark.integration


def chat(tokenizer, text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_default_model_loads_in_transformers_and_generates(tiny_path, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    ids = torch.tensor([chat(tokenizer, "Ann has 3 apples.")])
    out = model.generate(ids, max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(ids))
    assert out.shape[1] > ids.shape[1]
    assert 2e6 < sum(p.numel() for p in model.parameters()) < 6e6


def test_vllm_generates_groups_with_logprobs_and_prefix_sharing(vllm_engine, tokenizer):
    # prompts over two 32-token blocks, so the siblings have full blocks to share (a prompt shorter
    # than one block is never cached, and prefix caching switched off would pass)
    story = "Ben has {i} coins and {i} cards. Ann has 7 books and 3 pens. Dan finds 5 shells and 2 stamps. "
    prompts = [chat(tokenizer, story.format(i=i) * 2 + "Put the final answer in \\boxed{}.") for i in range(4)]
    assert all(len(p) >= 64 for p in prompts), [len(p) for p in prompts]
    res = vllm_engine.generate(prompts, SamplingSpec(n=8, max_tokens=16, temperature=1.0, seed=1))
    assert len(res) == 4 and all(len(r.completions) == 8 for r in res)
    c = res[0].completions[0]
    assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs)
    assert c.finish_reason in ("stop", "length")
    st = vllm_engine.last_stats
    # 4 prompts x 8 samples; with n=8 the 7 siblings reuse the prompt's full 32-token blocks
    assert st.prompt_tokens == sum(len(p) for p in prompts) * 8
    full_blocks = sum(len(p) // 32 * 32 for p in prompts)
    assert full_blocks >= 4 * 64 and st.cached_prompt_tokens >= 7 * full_blocks, (st.cached_prompt_tokens, full_blocks)
    assert st.generated_tokens == sum(len(x.token_ids) for r in res for x in r.completions)


def test_vllm_seeded_sampling_is_reproducible(vllm_engine, tokenizer):
    p = [chat(tokenizer, "Cara has 5 pens.")]
    a = vllm_engine.generate(p, SamplingSpec(n=4, max_tokens=12, seed=7))
    b = vllm_engine.generate(p, SamplingSpec(n=4, max_tokens=12, seed=7))
    assert [c.token_ids for c in a[0].completions] == [c.token_ids for c in b[0].completions]
    assert len({tuple(c.token_ids) for c in a[0].completions}) > 1  # siblings differ


def test_chunked_logprobs_equal_naive():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (37,), generator=g)
    lp, ent = logprobs_and_entropy(h, w, t, temperature=0.7, chunk=8)
    logits = (h @ w.T) / 0.7
    ref_lp = torch.log_softmax(logits, -1).gather(-1, t[:, None])[:, 0]
    p = torch.softmax(logits, -1)
    ref_ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    (lp.sum() + ent.sum()).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad, w.grad = None, None
    (ref_lp.sum() + ref_ent.sum()).backward()
    # fp32 GEMMs over chunks of 8 vs one [37, 50] product sum in another order: on an avx2-only
    # CPU the gradients differ by up to ~2e-5 relative (avx512 kernels happened to agree to 1e-6).
    torch.testing.assert_close(gh, h.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-4)


def _engine(ctx, path, micro):
    from hybrid_rl.config import ActorConfig, ModelConfig
    from hybrid_rl.engine.builders import build_policy_engine

    mc = ModelConfig(attn_implementation="sdpa")
    ac = ActorConfig(lr=1e-3, micro_batch_size=micro, logprob_chunk=7, packing=False, param_dtype=None)
    return build_policy_engine(path, mc, ac, ctx, total_steps=10)


def _samples(n=6):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        p = torch.randint(3, 400, (3 + i % 3,), generator=g).tolist()
        r = torch.randint(3, 400, (2 + (i * 2) % 5,), generator=g).tolist()
        out.append(Sample(p, r, [0.0] * len(r), [1] * len(r), "stop", i))
    return out


def test_fsdp_logprobs_match_hf_forward(ctx, micro_path):
    from transformers import AutoModelForCausalLM

    engine = _engine(ctx, micro_path, micro=2)
    batch = collate(_samples(), pad_id=0)
    lp = engine.forward_logprobs(batch)
    hf = AutoModelForCausalLM.from_pretrained(micro_path, dtype=torch.float32)
    for i, smp in enumerate(_samples()):
        ids = torch.tensor([smp.prompt_ids + smp.response_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0]
        ref = torch.log_softmax(logits[len(smp.prompt_ids) - 1 : -1], -1).gather(-1, ids[0, len(smp.prompt_ids) :, None])[:, 0]
        torch.testing.assert_close(lp[i, : len(ref)], ref, atol=1e-5, rtol=1e-5)


def test_micro_batching_gives_the_same_update(ctx, micro_path):
    """Gradient accumulation over micro-batches equals one big batch (global loss weights)."""
    results = []
    for micro in (6, 2):
        engine = _engine(ctx, micro_path, micro)
        batch = collate(_samples(), pad_id=0)
        batch.loss_weights = agg_weights(batch.response_mask, "token-mean", float(batch.response_mask.sum()), 6.0)
        m = engine.train_batch(batch, make_sft_loss())
        results.append((m["actor/grad_norm"], m["actor/loss"], engine.forward_logprobs(batch)))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-4)
    assert results[0][1] == pytest.approx(results[1][1], rel=1e-5)
    torch.testing.assert_close(results[0][2], results[1][2], atol=1e-5, rtol=1e-5)


def test_nonfinite_gradient_skips_the_update(ctx, micro_path):
    engine = _engine(ctx, micro_path, micro=6)
    batch = collate(_samples(), pad_id=0)
    batch.loss_weights = agg_weights(batch.response_mask, "token-mean", float(batch.response_mask.sum()), 6.0)
    before = engine.forward_logprobs(batch)

    def nan_loss(out, mb):
        return (out.logprobs * mb.loss_weights).sum() * float("nan"), {}

    m = engine.train_batch(batch, nan_loss)
    assert m["actor/skipped_steps"] == 1.0 and engine.consecutive_bad_steps == 1
    torch.testing.assert_close(engine.forward_logprobs(batch), before)


def test_metrics_are_token_weighted_over_micro_batches(ctx, micro_path):
    """A micro-batch of 2 tokens and one of 20 must not weigh the same (the old engine averaged
    micro-batch means, and the demo showed pg_loss shares divided by micro-batches x ranks)."""
    engine = _engine(ctx, micro_path, micro=1)
    samples = [
        Sample([5, 6, 7], [8, 9], [0.0] * 2, [1] * 2, "stop", 0),
        Sample([5, 6], list(range(10, 30)), [0.0] * 20, [1] * 20, "stop", 1),
    ]
    batch = collate(samples, pad_id=0)
    batch.loss_weights = agg_weights(batch.response_mask, "token-mean", float(batch.response_mask.sum()), 2.0)
    expected = float((-engine.forward_logprobs(batch) * batch.response_mask).sum() / batch.response_mask.sum())
    m = engine.train_batch(batch, make_sft_loss())
    assert m["actor/micro_batches"] == 2.0
    assert m["sft/nll"] == pytest.approx(expected, rel=1e-5)
    assert m["actor/loss"] == pytest.approx(expected, rel=1e-5)


def test_master_weights_and_adam_state_stay_fp32_with_bf16_compute(ctx, micro_path):
    """actor.param_dtype=bfloat16 computes in bf16; masters and AdamW moments stay fp32, so a
    small update changes (almost) every parameter (bf16 masters at lr 1e-6 changed ~2%)."""
    from hybrid_rl.config import ActorConfig, ModelConfig
    from hybrid_rl.engine.builders import build_policy_engine

    ac = ActorConfig(lr=1e-6, micro_batch_size=8, packing=False, param_dtype="bfloat16")
    engine = build_policy_engine(micro_path, ModelConfig(attn_implementation="sdpa"), ac, ctx, total_steps=10)
    params = dict(engine.module.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    before = {k: p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone() for k, p in params.items()}
    batch = collate(_samples(), pad_id=0)
    batch.loss_weights = agg_weights(batch.response_mask, "token-mean", float(batch.response_mask.sum()), 6.0)
    engine.train_batch(batch, make_sft_loss())
    states = [s for s in engine.optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32 for s in states)
    changed = total = 0
    for k, p in params.items():
        now = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        changed += int((now != before[k]).sum())
        total += now.numel()
    assert changed / total > 0.9, f"only {changed / total:.1%} of parameters changed"


def test_per_prompt_seeds_decorrelate_groups(vllm_engine, tokenizer):
    """The same prompt 4 times in one call: one shared seed gives 4 identical groups (vLLM seeds
    child j with seed + j); one seed per prompt gives 4 different ones."""
    from hybrid_rl.rollout.base import prompt_seed

    p = chat(tokenizer, "Eve has 4 cups.")
    shared = vllm_engine.generate([p] * 4, SamplingSpec(n=3, max_tokens=12, seed=11))
    assert len({tuple(tuple(c.token_ids) for c in g.completions) for g in shared}) == 1  # the old defect
    spec = SamplingSpec(n=3, max_tokens=12, seeds=[prompt_seed(0, 1, 0, i) for i in range(4)])
    own = vllm_engine.generate([p] * 4, spec)
    assert len({tuple(tuple(c.token_ids) for c in g.completions) for g in own}) == 4
    again = vllm_engine.generate([p] * 4, spec)
    assert [[c.token_ids for c in g.completions] for g in again] == [[c.token_ids for c in g.completions] for g in own]


def test_seeded_sampling_survives_a_prefill_larger_than_one_step(vllm_engine):
    """Seeded requests whose prompts together exceed vLLM's per-step token budget (2,048): with
    chunked prefill, one request's prompt is split across steps, and vLLM rewinds that request's
    generator offset, which a CPU generator does not have ("CPU Generator does not use offset").
    The agentic recipe's validation (pass@4 on 512 two-turn prompts) crashed on it."""
    from hybrid_rl.rollout.base import prompt_seed

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 400, (400,), generator=g).tolist() for _ in range(12)]  # 4,800 tokens
    spec = SamplingSpec(n=2, max_tokens=4, seeds=[prompt_seed(0, 1, i) for i in range(12)])
    out = vllm_engine.generate(prompts, spec)
    assert [len(grp.completions) for grp in out] == [2] * 12
    assert all(1 <= len(c.token_ids) <= 4 for grp in out for c in grp.completions)
    again = vllm_engine.generate(prompts, spec)  # and the seeds still decide the samples
    assert [[c.token_ids for c in grp.completions] for grp in again] == [[c.token_ids for c in grp.completions] for grp in out]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.0, -1, 0.8), (0.7, 20, 0.8)])
def test_trainer_logprobs_match_vllm_sampler_logprobs_after_a_sync(
    ctx, tiny_path, vllm_engine, tokenizer, temperature, top_k, top_p
):
    """The log-probs TIS and the mismatch metric use: vLLM's sampler log-probs (processed: after
    temperature and top-k/top-p, renormalised) against the trainer's head with the same
    truncation, after one training step and a weight sync. fp32: < 1e-4."""
    from safetensors.torch import load_file

    from hybrid_rl.config import ActorConfig, ModelConfig
    from hybrid_rl.engine.builders import build_policy_engine
    from hybrid_rl.engine.heads import Sampling
    from hybrid_rl.hybrid.switch import HybridSwitch
    from hybrid_rl.rollout.base import prompt_seed

    ac = ActorConfig(lr=1e-3, micro_batch_size=16, packing=True, param_dtype=None)
    actor = build_policy_engine(tiny_path, ModelConfig(attn_implementation="sdpa"), ac, ctx, total_steps=10)
    prompts = [chat(tokenizer, f"Fay has {i} hats and {2 * i} bags.") for i in range(3)]
    warm = collate([Sample(p, p[-6:], [0.0] * 6, [1] * 6, "stop", i) for i, p in enumerate(prompts)], tokenizer.pad_token_id)
    warm.loss_weights = agg_weights(warm.response_mask, "token-mean", float(warm.response_mask.sum()), 3.0)
    actor.train_batch(warm, make_sft_loss())
    switch = HybridSwitch(actor, vllm_engine, sync_dtype=torch.float32, bucket_bytes=1 << 20)
    try:
        switch.policy_updated()
        switch.to_rollout()
        spec = SamplingSpec(n=4, max_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p,
                            seeds=[prompt_seed(5, i) for i in range(3)])  # fmt: skip
        res = vllm_engine.generate(prompts, spec)
        samples = [Sample(r.prompt_ids, c.token_ids, c.logprobs, [1] * len(c.token_ids), c.finish_reason, i)
                   for i, r in enumerate(res) for c in r.completions]  # fmt: skip
        batch = collate(samples, tokenizer.pad_token_id)
        lp = actor.forward_logprobs(batch, Sampling(temperature, top_k, top_p))
        diff = ((lp - batch.rollout_logprobs).abs() * batch.response_mask).max().item()
        assert diff < 1e-4, f"T={temperature} top_k={top_k} top_p={top_p}: max |trainer - vLLM| = {diff}"
        if top_p < 1.0:  # the full softmax is measurably off: the comparison can fail
            full = actor.forward_logprobs(batch, temperature)
            assert ((full - batch.rollout_logprobs).abs() * batch.response_mask).max().item() > 1e-2
    finally:  # the session's engine goes back to the file's weights for the other tests
        vllm_engine.load_weights(load_file(f"{tiny_path}/model.safetensors").items())
        vllm_engine.reset_prefix_cache()


@pytest.mark.parametrize("loss_name", ["ppo_clip", "gspo"])
def test_truncated_sampling_on_short_rows_stays_finite(ctx, micro_path, loss_name):
    """top-k: a padding target after a short row is outside the kept set. Its log-prob was -inf,
    and -inf x 0 made the old log-probs NaN and GSPO's sequence ratio (so its loss) NaN."""
    from transformers import AutoModelForCausalLM

    from hybrid_rl.algorithms.losses import make_actor_loss
    from hybrid_rl.config import AlgorithmConfig
    from hybrid_rl.engine.heads import Sampling

    engine = _engine(ctx, micro_path, micro=6)
    hf = AutoModelForCausalLM.from_pretrained(micro_path, torch_dtype=torch.float32)
    samples = []
    for s in _samples():  # greedy continuations: every response token is inside the top-k set
        ids = hf.generate(torch.tensor([s.prompt_ids]), do_sample=False, max_new_tokens=len(s.response_ids), min_new_tokens=len(s.response_ids))
        r = ids[0, len(s.prompt_ids) :].tolist()
        samples.append(Sample(s.prompt_ids, r, [0.0] * len(r), [1] * len(r), "stop", s.group))
    batch = collate(samples, pad_id=0)
    assert (batch.response_mask.sum(1) < batch.response_mask.shape[1]).any()  # some rows are padded
    top_k = Sampling(1.0, 3, 0.9)
    out = engine.forward_outputs(batch, top_k)
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.kl_logprobs).all()
    assert (out.logprobs[batch.response_mask == 0] == 0).all()
    batch.old_logprobs = out.logprobs
    batch.advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0)) * batch.response_mask
    batch.loss_weights = agg_weights(batch.response_mask, "token-mean", float(batch.response_mask.sum()), 6.0)
    cfg = AlgorithmConfig(policy_loss=loss_name)
    m = engine.train_batch(batch, make_actor_loss(cfg), top_k)
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["actor/grad_norm"] > 0 and m["actor/skipped_steps"] == 0


def test_a_nonfinite_loss_with_a_finite_gradient_is_a_skipped_step(ctx, micro_path):
    engine = _engine(ctx, micro_path, micro=6)
    batch = collate(_samples(), pad_id=0)
    batch.loss_weights = agg_weights(batch.response_mask, "token-mean", float(batch.response_mask.sum()), 6.0)
    before = engine.forward_logprobs(batch)

    def nan_constant(out, mb):  # the NaN is a constant: its gradient is 0, the norm stays finite
        return (out.logprobs * mb.loss_weights).sum() + float("nan"), {}

    m = engine.train_batch(batch, nan_constant)
    assert math.isfinite(m["actor/grad_norm"]) and m["actor/skipped_steps"] == 1.0
    torch.testing.assert_close(engine.forward_logprobs(batch), before)
