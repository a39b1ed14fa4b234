"""Model wrappers whose ``forward`` returns what a loss needs, aligned with the response.

Wrapping the HF model in one ``nn.Module`` whose forward computes the head as well means FSDP2's
root hooks gather the root-level parameters (embeddings, final norm, tied LM head) for the whole
computation, including the chunked log-prob head and its recomputation in backward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from hybrid_rl.batch import ModelOutputs
from hybrid_rl.engine.shared_prefix import prompt_groups, shared_prefix_hidden


class Sampling(NamedTuple):
    """The distribution the rollout engine sampled from: ``softmax(logits / T)`` restricted to
    the ``top_k`` most likely tokens (``-1`` = all) and then to the nucleus of mass ``top_p``,
    renormalised. The trainer's log-probs use the same one, so PPO ratios, TIS weights and the
    rollout/trainer mismatch compare like with like."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    @classmethod
    def of(cls, s: Sampling | float) -> Sampling:
        return s if isinstance(s, Sampling) else cls(temperature=float(s))


def truncate_logits(logits: Tensor, top_k: int = -1, top_p: float = 1.0) -> Tensor:
    """Set logits outside the top-k / top-p set to ``-inf``, as vLLM's sampler does.

    vLLM (``apply_top_k_top_p``): top-k keeps logits >= the k-th largest; top-p then sorts the
    (top-k) probabilities ascending and drops those whose cumulative sum is <= ``1 - top_p``,
    always keeping the most likely token. ``logits [N, V]`` -> ``[N, V]``.
    """
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, idx = logits.sort(dim=-1, descending=False)
        cum = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1.0 - top_p
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


# The log-prob a truncated head gives a target outside the top-k / top-p set (padding targets,
# or a sampled token that the trainer's numerics put just outside it): finite, so that masking it
# with a 0 gives 0 (-inf x 0 is NaN) and a ratio with it is 0 rather than NaN; its gradient is 0.
OUTSIDE_LOGPROB = -1.0e4


def _chunk_logprobs_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0
) -> tuple[Tensor, Tensor, Tensor]:
    with record_function("hybrid_rl/logprob_head"):  # a torch.profiler label (forward and its recompute)
        logits = F.linear(hidden, weight).float()
        if temperature != 1.0:
            logits = logits / temperature
        full = None
        if top_k > 0 or top_p < 1.0:
            full = logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
            logits = truncate_logits(logits, top_k, top_p)
        lse = torch.logsumexp(logits, dim=-1)
        logprobs = logits.gather(-1, targets[:, None])[:, 0] - lse
        if full is not None:
            logprobs = torch.where(torch.isfinite(logprobs), logprobs, torch.full_like(logprobs, OUTSIDE_LOGPROB))
        probs = torch.softmax(logits, dim=-1)
        # 0 * -inf is nan: truncated tokens contribute nothing to the entropy
        entropy = lse - torch.where(probs > 0, probs * logits, torch.zeros_like(logits)).sum(-1)
        return logprobs, entropy, logprobs if full is None else full


def logprobs_and_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: Sampling | float = 1.0, chunk: int = 1024
) -> tuple[Tensor, Tensor]:
    r"""Per-token :math:`\log\pi(y_t)` and entropy from hidden states, ``chunk`` tokens at a time.

    ``hidden [N, H]``, ``weight [V, H]``, ``targets [N]`` -> two ``[N]`` fp32 tensors.
    The naive ``log_softmax`` over a 150k vocabulary keeps ~3 ``[N, V]`` fp32 tensors alive
    through backward; here each chunk's logits are recomputed in backward
    (activation checkpointing), so memory stays ~``chunk x V`` whatever N is. With top-k/top-p
    (:class:`Sampling`) the log-probs are those of the truncated, renormalised distribution
    (a sampled token is always inside it; the set is piecewise constant, so gradients flow
    through the kept logits only); a target outside the set gets :data:`OUTSIDE_LOGPROB`.
    """
    lp, ent, _ = logprobs_entropy_untruncated(hidden, weight, targets, temperature, chunk)
    return lp, ent


def logprobs_entropy_untruncated(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: Sampling | float = 1.0, chunk: int = 1024
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`logprobs_and_entropy` plus the targets' log-probs under ``softmax(logits / T)``
    without top-k/top-p (the same tensor when nothing truncates): the KL terms compare the policy
    and the reference on this one, as verl does, so identical weights give a KL of exactly 0."""
    s = Sampling.of(temperature)
    outs: list[tuple[Tensor, Tensor, Tensor]] = []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            outs.append(checkpoint(_chunk_logprobs_entropy, h, weight, t, *s, use_reentrant=False))
        else:
            outs.append(_chunk_logprobs_entropy(h, weight, t, *s))
    if not outs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty, empty
    lp, ent = torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
    return lp, ent, torch.cat([o[2] for o in outs]) if s.truncates else lp


def pack_plan(attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """Where each row's real tokens go when rows are packed padding-free.

    Every row of a :class:`~hybrid_rl.batch.TrainBatch` holds one contiguous run of real tokens
    (left-padded prompt, right-padded response). Runs are dealt first-fit-decreasing into packed
    rows of the same width ``T``, so ``R <= B`` rows carry the same tokens with less padding.

    ``attention_mask [B, T]`` -> ``src [N]`` (flat indices into ``[B*T]``), ``dst [N]`` (flat
    indices into ``[R*T]``), ``filler_pos [R*T]`` (position ids for the unused tail of each packed
    row: its own segment, counting from 0) and ``R``; ``N`` is the number of real tokens.
    """
    b, t = attention_mask.shape
    lengths = attention_mask.sum(1).tolist()
    starts = attention_mask.float().argmax(1).tolist()
    used: list[int] = []
    src, dst = [], []
    for i in sorted(range(b), key=lambda i: -lengths[i]):
        n = int(lengths[i])
        r = next((k for k, u in enumerate(used) if u + n <= t), None)
        if r is None:
            used.append(0)
            r = len(used) - 1
        src.append(torch.arange(i * t + starts[i], i * t + starts[i] + n))
        dst.append(torch.arange(r * t + used[r], r * t + used[r] + n))
        used[r] += n
    rows = len(used)
    col = torch.arange(t).repeat(rows)
    tail_start = torch.tensor(used).repeat_interleave(t)
    filler_pos = (col - tail_start).clamp(min=0)
    dev = attention_mask.device
    return torch.cat(src).to(dev), torch.cat(dst).to(dev), filler_pos.to(dev), rows


def body_hidden(body: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, packing: bool) -> Tensor:
    """Last hidden states ``[B, T, H]`` of a HF decoder body, padded or packed.

    Packed (``packing=True``): rows are repacked by :func:`pack_plan`, the body runs on ``[R, T]``
    with no attention mask and position ids that restart at 0 for each sequence, from which
    transformers builds a block-diagonal causal mask (``find_packed_sequence_indices``); the
    hidden states are scattered back to the padded layout (zeros on padding). Same results as
    padded up to float rounding, with fewer rows (the FLOPs of the padding are not spent);
    with flash-attn's varlen kernel the attention is also per sequence.
    """
    if not packing or input_ids.shape[0] == 1:
        return body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
    b, t = input_ids.shape
    src, dst, filler_pos, rows = pack_plan(attention_mask)
    ids = input_ids.new_zeros(rows * t)
    ids[dst] = input_ids.reshape(-1)[src]
    pos = filler_pos.to(position_ids.dtype)
    pos[dst] = position_ids.reshape(-1)[src]
    hidden = body(
        input_ids=ids.view(rows, t), attention_mask=None, position_ids=pos.view(rows, t), use_cache=False
    ).last_hidden_state
    flat = hidden.reshape(rows * t, -1)
    out = flat.new_zeros(b * t, flat.shape[-1]).index_copy(0, src, flat.index_select(0, dst))
    return out.view(b, t, -1)


def hidden_states(
    body: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int, packing: bool,
    shared_prefix: bool, prefix_kernel: str = "matmul",
) -> Tensor:  # fmt: skip
    """``[B, T, H]``: :func:`shared_prefix_hidden` (its segment attention by ``prefix_kernel``)
    when asked and some rows share a prompt, else :func:`body_hidden` (packed or padded)."""
    if shared_prefix and input_ids.shape[0] > 1 and prompt_len < input_ids.shape[1]:
        groups = prompt_groups(input_ids, attention_mask, prompt_len)
        if groups[0].shape[0] < input_ids.shape[0]:  # some rows share a prompt
            return shared_prefix_hidden(body, input_ids, attention_mask, position_ids, prompt_len, groups, prefix_kernel)
    return body_hidden(body, input_ids, attention_mask, position_ids, packing)


class PolicyModule(nn.Module):
    """A causal LM whose forward returns response log-probs and entropies ``[b, R]``.

    Inputs follow :class:`hybrid_rl.batch.TrainBatch`: hidden state ``P - 1 + j`` predicts
    response token ``j``.
    """

    def __init__(
        self, lm: nn.Module, logprob_chunk: int = 1024, packing: bool = False, shared_prefix: bool = False, prefix_kernel: str = "matmul"
    ) -> None:
        super().__init__()
        self.lm = lm
        self.logprob_chunk = logprob_chunk
        self.packing = packing
        self.shared_prefix = shared_prefix
        self.prefix_kernel = prefix_kernel

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        prompt_len: int,
        temperature: Sampling | float = 1.0,
    ) -> ModelOutputs:
        hidden = hidden_states(
            self.lm.model, input_ids, attention_mask, position_ids, prompt_len, self.packing, self.shared_prefix, self.prefix_kernel
        )
        b, t = input_ids.shape
        r = t - prompt_len
        h = hidden[:, prompt_len - 1 : t - 1].reshape(b * r, -1)
        targets = input_ids[:, prompt_len:].reshape(b * r)
        lp, ent, full = logprobs_entropy_untruncated(h, self.lm.lm_head.weight, targets, temperature, self.logprob_chunk)
        # Not views of the flat tensors: FSDP2 hooks module outputs and warns about views.
        kl_lp = full.reshape(b, r).clone() if Sampling.of(temperature).truncates else None
        return ModelOutputs(logprobs=lp.reshape(b, r).clone(), entropy=ent.reshape(b, r).clone(), kl_logprobs=kl_lp)

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.lm.model.layers)

    def hf_model(self) -> nn.Module:
        return self.lm


class ValueModule(nn.Module):
    """A critic: the policy's transformer body with a scalar head; forward returns ``values [b, R]``.

    ``values[:, j]`` is V(s_j), the value of the state *before* response token j is generated
    (hidden state at position P - 1 + j), the same alignment as the log-probs.
    """

    def __init__(
        self, body: nn.Module, hidden_size: int, packing: bool = False, shared_prefix: bool = False, prefix_kernel: str = "matmul"
    ) -> None:
        super().__init__()
        self.body = body
        self.packing = packing
        self.shared_prefix = shared_prefix
        self.prefix_kernel = prefix_kernel
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        prompt_len: int,
        temperature: Sampling | float = 1.0,
    ) -> ModelOutputs:
        hidden = hidden_states(
            self.body, input_ids, attention_mask, position_ids, prompt_len, self.packing, self.shared_prefix, self.prefix_kernel
        )
        t = input_ids.shape[1]
        h = hidden[:, prompt_len - 1 : t - 1]
        return ModelOutputs(values=self.value_head(h).squeeze(-1).float())

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.body.layers)


class RewardModule(nn.Module):
    """A reward model: an HF ``*ForSequenceClassification`` with one label; forward returns
    ``scores [b]``, the head's output at each row's last real token (prompt + response)."""

    def __init__(self, cls_model: nn.Module) -> None:
        super().__init__()
        self.rm = cls_model

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        prompt_len: int,
        temperature: Sampling | float = 1.0,
    ) -> ModelOutputs:
        hidden = self.rm.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        # right-padded responses: the last real token is the last position with attention 1
        idx = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = torch.where(attention_mask > 0, idx, torch.zeros_like(idx)).max(-1).values
        h = hidden[torch.arange(input_ids.shape[0], device=input_ids.device), last]
        return ModelOutputs(scores=self.rm.score(h).squeeze(-1).float())

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.rm.model.layers)

    def hf_model(self) -> nn.Module:
        return self.rm
