"""Padding-free packing: same log-probs, entropies, values and gradients as the padded layout."""

import random

import pytest
import torch

from hybrid_rl.batch import Sample, collate
from hybrid_rl.engine.heads import PolicyModule, ValueModule, pack_plan

pytestmark = pytest.mark.unit


def batch(seed: int = 0, rows: int = 9):
    rng = random.Random(seed)
    samples = []
    for g in range(rows):
        p = [rng.randrange(8, 200) for _ in range(rng.randint(3, 20))]
        r = [rng.randrange(8, 200) for _ in range(rng.randint(1, 30))]
        samples.append(Sample(p, r, [0.0] * len(r), [1] * len(r), "stop", g))
    return collate(samples, pad_id=0).trimmed()


def test_pack_plan_places_every_token_once_in_fewer_rows():
    b = batch()
    src, dst, filler, rows = pack_plan(b.attention_mask)
    assert len(src) == int(b.attention_mask.sum()) == len(dst)
    assert len(set(dst.tolist())) == len(dst) and len(set(src.tolist())) == len(src)
    assert rows < b.input_ids.shape[0]
    assert b.attention_mask.reshape(-1)[src].all()
    assert filler.shape == (rows * b.input_ids.shape[1],)


@pytest.mark.parametrize("kind", ["policy", "value"])
def test_packed_matches_padded(micro_path, kind):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(micro_path, dtype=torch.float32, attn_implementation="sdpa")
    b = batch()
    real = b.attention_mask[:, b.prompt_len :].float()
    outs, grads = [], []
    for packing in (False, True):
        mod = PolicyModule(lm, 64, packing) if kind == "policy" else ValueModule(lm.model, lm.config.hidden_size, packing)
        if kind == "value":
            torch.manual_seed(1)
            torch.nn.init.normal_(mod.value_head.weight)
        mod.zero_grad()
        out = mod(b.input_ids, b.attention_mask, b.position_ids, b.prompt_len)
        y = (out.logprobs if kind == "policy" else out.values) * real
        (y.sum() + (out.entropy * real).sum() if kind == "policy" else y.sum()).backward()
        outs.append(y.detach())
        grads.append(lm.model.layers[0].mlp.up_proj.weight.grad.clone())
        lm.zero_grad()
    assert (outs[0] != 0).any()
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(grads[1], grads[0], atol=2e-5, rtol=1e-3)
