"""The MFU numerator (hybrid_rl/engine/flops.py) against torch's own FLOP counter on the real
micro model: the matmul weights and the attention width must be what the model multiplies."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hybrid_rl.engine.flops import DecoderFlops

pytestmark = pytest.mark.unit


def counted(model, length: int) -> int:
    ids = torch.randint(0, model.config.vocab_size, (1, length))
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(input_ids=ids)
    return fc.get_total_flops()


def test_counts_match_torch_flop_counter(micro_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(micro_path, dtype=torch.float32, attn_implementation="eager").eval()
    f = DecoderFlops.from_hf_config(model.config)
    # Eager attention (torch does not count CPU SDPA kernels) multiplies the full L x L scores: F(L) = 2 N_mm L + 4 W L^2 (+ the rotary
    # embedding's tiny matmul). Two lengths separate the linear and the quadratic term.
    l1, l2 = 16, 48
    c1, c2 = counted(model, l1), counted(model, l2)
    quad = (c2 / l2 - c1 / l1) / (l2 - l1)
    lin = c1 / l1 - quad * l1
    assert quad == pytest.approx(4 * f.attn_width, rel=1e-6)
    assert lin == pytest.approx(2 * f.matmul_params, rel=1e-3)
    # Ours counts causal attention: i + 1 keys for position i.
    assert f.span(0, l1) == 2 * f.matmul_params * l1 + 4 * f.attn_width * l1 * (l1 + 1) // 2


def test_span_train_and_generate_compose():
    f = DecoderFlops(matmul_params=1000, attn_width=10)
    assert f.span(0, 5) + f.span(5, 9) == f.span(0, 9)
    assert f.train([9, 4]) == 3 * (f.span(0, 9) + f.span(0, 4))
    # Two samples of one group: one prefill of the 5-token prompt, then 3 and 1 decode forwards
    # (the prefill yields each sample's first token).
    assert f.generate([5, 5], [4, 2], [0, 0]) == f.span(0, 5) + f.span(5, 8) + f.span(5, 6)
    assert f.generate([5, 5], [4, 2], [0, 1]) == 2 * f.span(0, 5) + f.span(5, 8) + f.span(5, 6)
    # Shared-prefix training: the group's prompt once, both responses whole.
    assert f.train_shared_prefix([5, 5], [4, 2], [0, 0]) == 3 * (f.span(0, 5) + f.span(5, 9) + f.span(5, 7))
    assert f.train_shared_prefix([5, 5], [4, 2], [0, 1]) == f.train([9, 7])
