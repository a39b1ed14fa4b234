"""Attention over the padded segments of a shared-prefix forward, with a CPU kernel of its own.

:func:`segment_attention` computes ``softmax(q k^T * scale + mask) v`` for ``S`` segments of
``Lq`` queries and ``Lk`` keys (:class:`hybrid_rl.engine.shared_prefix.PrefixLayout`). On CUDA,
or when the scores would be large, it calls ``F.scaled_dot_product_attention``. On CPU it uses
:class:`MatmulAttention`: torch's CPU flash-attention backward with a mask runs ~7x slower than
its forward (bf16, 72 segments x 14 heads x 64 x 110, one thread of an AMX Xeon, 2026-12-05:
~30 ms forward, ~210 ms backward), while the same math as batched GEMMs with a hand-written
backward takes ~40 + ~62 ms (``benchmarks/profile_update.py --levers sdpa`` measures it inside an
update: 1.28x on the whole update there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Largest score tensor (elements, S * H * Lq * Lk) the CPU kernel keeps for backward: its bf16
# probabilities are saved per layer (2 bytes each, 64 MiB at this size), where flash attention
# saves one log-sum-exp per query. Above it, SDPA's memory-lean kernel runs instead.
MATMUL_MAX_SCORES = 32 * 2**20


class MatmulAttention(torch.autograd.Function):
    """Masked softmax attention as batched GEMMs, with grouped-query heads kept grouped.

    Forward, per segment and kv head: ``S = scale * Q K^T + B`` (fp32 scores from the
    compute-dtype GEMM inputs; ``B`` 0 or -inf), ``P = softmax(S)`` (stored in the compute dtype),
    ``O = P V``. Backward (standard attention's, as in Dao et al. 2022, FlashAttention, appendix B.2):
    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - rowsum(dO * O))``, ``dQ = scale dS K``,
    ``dK = scale dS^T Q``; every product is a GEMM in the compute dtype (AMX/avx512-bf16 on CPUs
    that have them), the row sums in fp32.

    Shapes: ``q [S, KV, G * Lq, D]`` (the ``G`` query heads that share a kv head stacked along the
    query axis), ``k``, ``v [S, KV, Lk, D]``, ``bias [S, 1, 1, Lq, Lk]`` fp32 -> ``[S, KV, G * Lq, D]``.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
        s, kv, glq, _ = q.shape
        lq, lk = bias.shape[-2], bias.shape[-1]
        scores = torch.matmul(q.float() * scale, k.float().transpose(-1, -2))  # scale on the small operand
        scores = scores.view(s, kv, glq // lq, lq, lk).add_(bias).view(s, kv, glq, lk)
        p = torch.softmax(scores, dim=-1).to(q.dtype)
        o = torch.matmul(p, v)
        ctx.save_for_backward(q, k, v, p, o)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, p, o = ctx.saved_tensors
        do = do.contiguous()
        dv = torch.matmul(p.transpose(-1, -2), do)
        dp = torch.matmul(do, v.transpose(-1, -2))
        delta = (do.float() * o.float()).sum(-1, keepdim=True)
        # mixed-dtype ops compute in fp32 without materialising fp32 copies of dP and P
        ds = torch.sub(dp, delta).mul_(p).to(q.dtype)
        dq = torch.matmul(ds, k).mul_(ctx.scale)
        dk = torch.matmul(ds.transpose(-1, -2), q).mul_(ctx.scale)
        return dq, dk, dv, None, None


def matmul_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """:class:`MatmulAttention` on SDPA's layout: ``q [S, H, Lq, D]``, ``k``, ``v [S, KV, Lk, D]``
    (``H`` a multiple of ``KV``; query head ``h`` reads kv head ``h // (H / KV)``, transformers'
    ``repeat_kv``), ``mask [S, 1, Lq, Lk]`` bool -> ``[S, H, Lq, D]``."""
    s, h, lq, d = q.shape
    kv = k.shape[1]
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    out = MatmulAttention.apply(q.reshape(s, kv, (h // kv) * lq, d), k, v, bias[:, :, None], scale)
    return out.view(s, h, lq, d)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """``F.scaled_dot_product_attention`` on the same layout as :func:`matmul_attention`."""
    h, kv = q.shape[1], k.shape[1]
    if kv != h:
        k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def segment_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, kernel: str = "matmul") -> Tensor:
    """:func:`matmul_attention` when ``kernel`` is ``"matmul"`` (``actor.prefix_attention``), on
    CPU, while its saved scores stay under :data:`MATMUL_MAX_SCORES` elements; else
    :func:`sdpa_attention`."""
    s, h, lq, _ = q.shape
    if kernel == "matmul" and q.device.type == "cpu" and s * h * lq * k.shape[2] <= MATMUL_MAX_SCORES:
        return matmul_attention(q, k, v, mask, scale)
    return sdpa_attention(q, k, v, mask, scale)
