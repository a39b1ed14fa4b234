"""Model wrappers whose ``forward`` returns what a loss needs, aligned with the response.

Wrapping the HF model in one ``nn.Module`` whose forward computes the head as well means FSDP2's
root hooks gather the root-level parameters (embeddings, final norm, tied LM head) for the whole
computation, including the chunked log-prob head and its recomputation in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from hybrid_rl.batch import ModelOutputs


def _chunk_logprobs_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    logits = F.linear(hidden, weight).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[:, None])[:, 0] - lse
    probs = torch.softmax(logits, dim=-1)
    entropy = lse - (probs * logits).sum(-1)
    return logprobs, entropy


def logprobs_and_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, chunk: int = 1024
) -> tuple[Tensor, Tensor]:
    r"""Per-token :math:`\log\pi(y_t)` and entropy from hidden states, ``chunk`` tokens at a time.

    ``hidden [N, H]``, ``weight [V, H]``, ``targets [N]`` -> two ``[N]`` fp32 tensors.
    The naive ``log_softmax`` over a 150k vocabulary keeps ~3 ``[N, V]`` fp32 tensors alive
    through backward; here each chunk's logits are recomputed in backward
    (activation checkpointing), so memory stays ~``chunk x V`` whatever N is.
    """
    outs_lp, outs_ent = [], []
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            lp, ent = checkpoint(_chunk_logprobs_entropy, h, weight, t, temperature, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs_entropy(h, weight, t, temperature)
        outs_lp.append(lp)
        outs_ent.append(ent)
    if not outs_lp:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(outs_lp), torch.cat(outs_ent)


class PolicyModule(nn.Module):
    """A causal LM whose forward returns response log-probs and entropies ``[b, R]``.

    Inputs follow :class:`hybrid_rl.batch.TrainBatch`: hidden state ``P - 1 + j`` predicts
    response token ``j``.
    """

    def __init__(self, lm: nn.Module, logprob_chunk: int = 1024) -> None:
        super().__init__()
        self.lm = lm
        self.logprob_chunk = logprob_chunk

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        prompt_len: int,
        temperature: float = 1.0,
    ) -> ModelOutputs:
        hidden = self.lm.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        b, t = input_ids.shape
        r = t - prompt_len
        h = hidden[:, prompt_len - 1 : t - 1].reshape(b * r, -1)
        targets = input_ids[:, prompt_len:].reshape(b * r)
        lp, ent = logprobs_and_entropy(h, self.lm.lm_head.weight, targets, temperature, self.logprob_chunk)
        # Not views of the flat tensors: FSDP2 hooks module outputs and warns about views.
        return ModelOutputs(logprobs=lp.reshape(b, r).clone(), entropy=ent.reshape(b, r).clone())

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.lm.model.layers)

    def hf_model(self) -> nn.Module:
        return self.lm


class ValueModule(nn.Module):
    """A critic: the policy's transformer body with a scalar head; forward returns ``values [b, R]``.

    ``values[:, j]`` is V(s_j), the value of the state *before* response token j is generated
    (hidden state at position P - 1 + j), the same alignment as the log-probs.
    """

    def __init__(self, body: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.body = body
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int, temperature: float = 1.0
    ) -> ModelOutputs:
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
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
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int, temperature: float = 1.0
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
