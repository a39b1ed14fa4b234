"""The default model in transformers and in the real vLLM engine; the FSDP2 engine on one rank."""

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
    prompts = [chat(tokenizer, f"Ben has {i} coins and {i} cards. Put the final answer in \\boxed{{}}.") for i in range(4)]
    res = vllm_engine.generate(prompts, SamplingSpec(n=8, max_tokens=16, temperature=1.0, seed=1))
    assert len(res) == 4 and all(len(r.completions) == 8 for r in res)
    c = res[0].completions[0]
    assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs)
    assert c.finish_reason in ("stop", "length")
    st = vllm_engine.last_stats
    # 4 prompts x 8 samples; with n=8 the 7 siblings reuse the prompt's full 32-token blocks
    assert st.prompt_tokens == sum(len(p) for p in prompts) * 8
    full_blocks = sum(len(p) // 32 * 32 for p in prompts)
    assert st.cached_prompt_tokens >= 7 * full_blocks
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
    torch.testing.assert_close(gh, h.grad)
    torch.testing.assert_close(gw, w.grad)


def _engine(ctx, path, micro):
    from hybrid_rl.config import ActorConfig, ModelConfig
    from hybrid_rl.engine.fsdp import build_policy_engine

    mc = ModelConfig(dtype="float32", attn_implementation="sdpa")
    ac = ActorConfig(lr=1e-3, micro_batch_size=micro, logprob_chunk=7, packing=False)
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
