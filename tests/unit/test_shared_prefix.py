"""Shared-prefix training forward (hybrid_rl/engine/shared_prefix.py): each distinct
prompt runs through the body once and its G responses attend to its cached keys and values. It must
give the plain forward's log-probs, entropies and gradients (fp32, 1e-5) on the real micro model,
for the policy and the critic, with left-padded prompts of different lengths, right-padded
responses, groups of different sizes and a row whose prompt nobody shares."""

import copy

import pytest
import torch

from hybrid_rl.engine.heads import PolicyModule, ValueModule
from hybrid_rl.engine.shared_prefix import prompt_groups

pytestmark = pytest.mark.unit


def batch(vocab: int, seed: int = 0):
    """Rows of a TrainBatch: left-padded prompts (width P), right-padded responses (width R)."""
    g = torch.Generator().manual_seed(seed)
    p, r = 12, 10
    prompt_lens = [12, 7, 3]  # three prompts; groups of 3, 2 and 1 rows
    group_of = [0, 0, 0, 1, 1, 2]
    prompts = [torch.randint(1, vocab, (n,), generator=g) for n in prompt_lens]
    ids, mask, pos = [], [], []
    for row, k in enumerate(group_of):
        n = prompt_lens[k]
        resp_len = [10, 4, 7, 1, 9, 5][row]
        row_ids = torch.zeros(p + r, dtype=torch.long)
        row_ids[p - n : p] = prompts[k]
        row_ids[p : p + resp_len] = torch.randint(1, vocab, (resp_len,), generator=g)
        m = torch.zeros(p + r, dtype=torch.long)
        m[p - n : p + resp_len] = 1
        ids.append(row_ids)
        mask.append(m)
        pos.append((m.cumsum(0) - 1).clamp(min=0))
    return torch.stack(ids), torch.stack(mask), torch.stack(pos), p


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kernel", ["matmul", "sdpa"])
@pytest.mark.parametrize("head", ["policy", "critic"])
def test_shared_prefix_matches_the_plain_forward(micro_path, head, kernel, monkeypatch):
    """With either segment kernel (actor.prefix_attention), and the chosen one is the one that runs."""
    from transformers import AutoModelForCausalLM

    from hybrid_rl.engine import segment_attention

    calls = []
    real_apply = segment_attention.MatmulAttention.apply
    monkeypatch.setattr(segment_attention.MatmulAttention, "apply", lambda *a: calls.append(1) or real_apply(*a))

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(micro_path, dtype=torch.float32, attn_implementation="sdpa")
    if head == "policy":
        plain = PolicyModule(lm, logprob_chunk=7, packing=True)
    else:
        plain = ValueModule(lm.model, lm.config.hidden_size, packing=True)
        torch.nn.init.normal_(plain.value_head.weight)  # a zero head would pass anything
    shared = copy.deepcopy(plain)
    shared.shared_prefix, shared.prefix_kernel = True, kernel
    ids, mask, pos, p = batch(lm.config.vocab_size)
    first, inverse = prompt_groups(ids, mask, p)
    assert first.shape[0] == 3 and inverse.tolist() == [inverse[0]] * 3 + [inverse[3]] * 2 + [inverse[5]]
    resp = mask[:, p:].float()
    outs = []
    for m in (plain, shared):
        out = m(ids, mask, pos, p, 0.8)
        value = out.logprobs if head == "policy" else out.values
        ((value * resp).sum() + (out.entropy * resp).sum() if head == "policy" else (value * resp).sum()).backward()
        outs.append((value * resp, out.entropy * resp if head == "policy" else None, grads(m)))
    (v0, e0, g0), (v1, e1, g1) = outs
    assert (len(calls) > 0) == (kernel == "matmul"), len(calls)
    assert (v0 - v1).abs().max() < 1e-5
    if head == "policy":
        assert (e0 - e1).abs().max() < 1e-5
    assert g0.keys() == g1.keys() and len(g0) > 0
    for n in g0:
        assert (g0[n] - g1[n]).abs().max() < 1e-5 * max(1.0, float(g0[n].abs().max())), n
