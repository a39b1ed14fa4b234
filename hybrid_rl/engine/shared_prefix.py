"""Shared-prefix training forward: each distinct prompt of a micro-batch through the model once.

The G responses of a GRPO group share their prompt. :func:`shared_prefix_hidden` packs every
distinct prompt once and every response into one row and runs the model with a segment attention
(:func:`prefix_attention`, a registered transformers attention function) that gives each token
exactly the keys, positions and mask of the plain forward; :mod:`hybrid_rl.engine.heads` calls it
when ``actor.shared_prefix`` is on and some rows of a micro-batch share a prompt.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

from hybrid_rl.engine.segment_attention import segment_attention


def prompt_groups(input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> tuple[Tensor, Tensor]:
    """Rows with the same prompt (same token ids and padding in the first ``prompt_len``
    columns): ``first [U]``, a row holding each distinct prompt, and ``inverse [B]``, each row's
    prompt in ``0..U-1``."""
    keys = torch.cat([input_ids[:, :prompt_len], attention_mask[:, :prompt_len].to(input_ids.dtype)], dim=1)
    uniq, inverse = torch.unique(keys, dim=0, return_inverse=True)
    b = input_ids.shape[0]
    rows = torch.arange(b, device=input_ids.device)
    first = torch.full((uniq.shape[0],), b, dtype=torch.long, device=input_ids.device).scatter_reduce(0, inverse, rows, "amin")
    return first, inverse


class PrefixLayout(NamedTuple):
    """Index plan of a shared-prefix forward (:func:`prefix_layout`).

    The body runs on one packed row of ``N`` real tokens: every distinct prompt once, then every
    response. Attention runs per *segment*: a prompt's tokens (queries) over its own tokens
    (keys), causal; a response's tokens over its prompt's tokens and its own, causal in its own.
    ``S`` segments are padded to ``Lq`` queries and ``Lk`` keys.
    """

    ids: Tensor  # [1, N] packed token ids
    positions: Tensor  # [1, N] position ids (a response continues its prompt's)
    q_index: Tensor  # [S, Lq] packed index of each segment's queries (0 on padding)
    k_index: Tensor  # [S, Lk] packed index of each segment's keys (0 on padding)
    mask: Tensor  # [S, 1, Lq, Lk] bool: query may attend key (padded query rows keep key 0)
    q_real: Tensor  # [S * Lq] bool: a real query (its output goes back to the packed row)
    rows: Tensor  # [B * T] packed index of each (row, column) of the padded batch (0 on padding)
    real: Tensor  # [B * T] bool: a real token


def prefix_layout(
    input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int, groups: tuple[Tensor, Tensor] | None = None
) -> PrefixLayout:
    """The plan for rows ``[B, T]`` of a TrainBatch (left-padded prompts in the first
    ``prompt_len`` columns, right-padded responses after them); ``groups`` is
    :func:`prompt_groups` of them if already computed."""
    b, t = input_ids.shape
    p = prompt_len
    first, inverse = groups if groups is not None else prompt_groups(input_ids, attention_mask, p)
    mask_cpu = attention_mask.bool().cpu()
    prompt_cols = [torch.nonzero(mask_cpu[r, :p]).flatten() for r in first.tolist()]
    resp_cols = [p + torch.nonzero(mask_cpu[r, p:]).flatten() for r in range(b)]
    flat_ids, flat_pos = input_ids.reshape(-1), position_ids.reshape(-1)
    src, prompt_at, resp_at, n = [], [], [], 0
    for u, r in enumerate(first.tolist()):
        src.append(r * t + prompt_cols[u])
        prompt_at.append(torch.arange(n, n + len(prompt_cols[u])))
        n += len(prompt_cols[u])
    for r in range(b):
        src.append(r * t + resp_cols[r])
        resp_at.append(torch.arange(n, n + len(resp_cols[r])))
        n += len(resp_cols[r])
    src_t = torch.cat(src).to(input_ids.device)
    segments = [(q, q, 0) for q in prompt_at]  # (queries, keys, keys before the causal part)
    segments += [(resp_at[r], torch.cat([prompt_at[g], resp_at[r]]), len(prompt_at[g])) for r, g in enumerate(inverse.tolist())]
    lq = max(len(q) for q, _, _ in segments)
    lk = max(len(k) for _, k, _ in segments)
    s = len(segments)
    q_index, k_index = torch.zeros(s, lq, dtype=torch.long), torch.zeros(s, lk, dtype=torch.long)
    mask = torch.zeros(s, 1, lq, lk, dtype=torch.bool)
    q_real = torch.zeros(s, lq, dtype=torch.bool)
    for i, (q, k, offset) in enumerate(segments):
        q_index[i, : len(q)], k_index[i, : len(k)], q_real[i, : len(q)] = q, k, True
        # query j sees the prefix keys and keys offset..offset+j of its own segment
        mask[i, 0, : len(q), : len(k)] = torch.arange(len(k))[None, :] <= offset + torch.arange(len(q))[:, None]
        mask[i, 0, len(q) :, 0] = True  # padded queries: one key, so the softmax stays finite
    rows = torch.zeros(b, t, dtype=torch.long)
    for r in range(b):
        rows[r, prompt_cols[int(inverse[r])]] = prompt_at[int(inverse[r])]
        rows[r, resp_cols[r]] = resp_at[r]
    dev = input_ids.device
    return PrefixLayout(
        flat_ids[src_t][None], flat_pos[src_t][None], q_index.to(dev), k_index.to(dev), mask.to(dev),
        q_real.flatten().to(dev), rows.flatten().to(dev), attention_mask.bool().flatten(),
    )  # fmt: skip


def prefix_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                     dropout: float = 0.0, prefix_layout: PrefixLayout | None = None, prefix_kernel: str = "matmul",
                     **kwargs) -> tuple[Tensor, None]:  # fmt: skip
    """A transformers attention function over a :class:`PrefixLayout`: ``query [1, H, N, D]``,
    ``key``/``value [1, KV, N, D]`` -> ``[1, N, H, D]``. Each segment's queries and keys are
    gathered into ``[S, H, Lq, D]`` / ``[S, KV, Lk, D]`` and one call with the segment masks
    (:func:`hybrid_rl.engine.segment_attention.segment_attention`, with ``prefix_kernel``)
    computes them all; outputs go back to their packed positions."""
    lay = prefix_layout
    h, kv = query.shape[1], key.shape[1]
    s, lq = lay.q_index.shape
    q = query[0][:, lay.q_index.flatten()].view(h, s, lq, -1).transpose(0, 1)
    k = key[0][:, lay.k_index.flatten()].view(kv, s, lay.k_index.shape[1], -1).transpose(0, 1)
    v = value[0][:, lay.k_index.flatten()].view(kv, s, lay.k_index.shape[1], -1).transpose(0, 1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = segment_attention(q, k, v, lay.mask, scale, prefix_kernel)  # [S, H, Lq, D]
    out = out.transpose(1, 2).reshape(s * lq, h, -1)[lay.q_real]
    n = query.shape[2]
    packed = out.new_zeros(n, h, out.shape[-1]).index_copy(0, lay.q_index.flatten()[lay.q_real], out)
    return packed[None], None


AttentionInterface.register("hybrid_rl_prefix", prefix_attention)


def shared_prefix_unsupported(lm: nn.Module) -> str | None:
    """Why ``lm`` cannot run :func:`shared_prefix_hidden` (None if it can): the model must route
    attention through transformers' attention interface with its keyword arguments, and have no
    sliding-window layers (the segment masks are full-causal)."""
    if not getattr(lm, "_supports_attention_backend", False):
        return f"{type(lm).__name__} does not take transformers' attention functions"
    if "sliding_attention" in (getattr(lm.config, "layer_types", None) or []):
        return "the model has sliding-window attention layers"
    return None


def shared_prefix_hidden(
    body: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    prompt_len: int,
    groups: tuple[Tensor, Tensor] | None = None,
    kernel: str = "matmul",
) -> Tensor:
    """Last hidden states ``[B, T, H]`` with each distinct prompt computed once, padding-free.

    The G responses of a GRPO group share their prompt; the plain (packed) forward computes it G
    times. Here the body runs on one packed row holding every distinct prompt once and then every
    response (:func:`prefix_layout`); the projections and MLPs see ``U P + sum(R_i)`` tokens
    instead of ``B P + sum(R_i)``. Attention (:func:`prefix_attention`, switched in for this call
    only, with the segment ``kernel``: ``actor.prefix_attention``) lets a response's tokens see
    exactly the keys they see in the plain forward (their prompt's and their own earlier ones) at
    the same positions, so log-probs and gradients match it to float rounding (in backward the G responses' gradients into their prompt add up at its
    one copy). The hidden states are scattered back to the padded ``[B, T]`` layout (zeros on
    padding; a prompt's states repeated on each of its rows). Verl's prefix grouper computes the
    same split of attention.
    """
    lay = prefix_layout(input_ids, attention_mask, position_ids, prompt_len, groups)
    config = body.config
    saved = config._attn_implementation
    config._attn_implementation = "hybrid_rl_prefix"
    try:
        out = body(
            input_ids=lay.ids, position_ids=lay.positions, attention_mask=None, use_cache=False, prefix_layout=lay, prefix_kernel=kernel
        )
    finally:
        config._attn_implementation = saved
    flat = out.last_hidden_state[0]
    b, t = input_ids.shape
    hidden = flat.index_select(0, lay.rows) * lay.real[:, None].to(flat.dtype)
    return hidden.view(b, t, -1)
