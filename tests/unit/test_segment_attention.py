"""The CPU attention kernel of the shared-prefix forward (hybrid_rl/engine/segment_attention.py)
must be SDPA's math: the same outputs and input gradients in fp32 (1e-5) with grouped-query heads
and padded query rows, a bf16 error against an fp32 reference of the same order as SDPA's own,
and the size cap must hand large score tensors to SDPA."""

import pytest
import torch

from hybrid_rl.engine import segment_attention as sa

pytestmark = pytest.mark.unit


def inputs(dtype, s=5, h=6, kv=2, lq=9, lk=13, d=8, seed=0):
    """Segments with a causal part after a prefix of different length each, and padded queries
    that keep key 0 (as :func:`hybrid_rl.engine.shared_prefix.prefix_layout` builds them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, h, lq, d, generator=g)
    k = torch.randn(s, kv, lk, d, generator=g)
    v = torch.randn(s, kv, lk, d, generator=g)
    do = torch.randn(s, h, lq, d, generator=g)
    mask = torch.zeros(s, 1, lq, lk, dtype=torch.bool)
    for i in range(s):
        n_q, offset = lq - i, i % 3
        mask[i, 0, :n_q, : n_q + offset] = torch.arange(n_q + offset)[None, :] <= offset + torch.arange(n_q)[:, None]
        mask[i, 0, n_q:, 0] = True
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    return leaves, do.to(dtype), mask


def run(fn, leaves, do, mask):
    out = fn(*leaves, mask, 0.35)
    out.backward(do)
    return [out.detach().float()] + [t.grad.float() for t in leaves]


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_matmul_attention_matches_sdpa_in_fp32():
    ref = run(sa.sdpa_attention, *inputs(torch.float32))
    got = run(sa.matmul_attention, *inputs(torch.float32))
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, ref):
        assert torch.isfinite(a).all(), name
        assert (a - b).abs().max() < 1e-5, name
    assert ref[2].abs().sum() > 0  # the kv heads get gradient from every query head of their group


def test_bf16_error_is_of_sdpa_order():
    ref = run(sa.sdpa_attention, *inputs(torch.float32, lq=64, lk=96, d=32))
    sdpa = run(sa.sdpa_attention, *inputs(torch.bfloat16, lq=64, lk=96, d=32))
    ours = run(sa.matmul_attention, *inputs(torch.bfloat16, lq=64, lk=96, d=32))
    for name, a, b, r in zip(["out", "dq", "dk", "dv"], ours, sdpa, ref):
        assert rel(a, r) < max(3 * rel(b, r), 1e-2), (name, rel(a, r), rel(b, r))


def test_large_scores_fall_back_to_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(sa, "matmul_attention", lambda *a: calls.append("matmul") or sa.sdpa_attention(*a))
    (q, k, v), _, mask = inputs(torch.float32)
    sa.segment_attention(q, k, v, mask, 0.35)
    assert calls == ["matmul"]
    monkeypatch.setattr(sa, "MATMUL_MAX_SCORES", q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] - 1)
    sa.segment_attention(q, k, v, mask, 0.35)
    assert calls == ["matmul"]
