"""Model FLOPs of a decoder-only transformer: the numerator of MFU.

Counted as in the PaLM paper (Chowdhery et al. 2022, appendix B) and Megatron's MFU: only the
matrix multiplies the model needs, no recomputation, no padding. For a token at 0-based
position ``i`` of its sequence, one forward costs

    2 * N_mm + 4 * n_layers * (n_heads * head_dim) * (i + 1)

where ``N_mm`` counts the weights inside matrix multiplies (per layer the q, k, v and o
projections and the gated MLP's three matrices, plus the LM head; embedding lookups and norms are
not counted) and the second term is the attention scores ``Q K^T`` and ``A V`` over the ``i + 1``
keys a causal token sees. Training (forward + backward) is 3x the forward.

Generation: the prompt's prefill once per group (the G samples of a group share the prompt's KV
cache through vLLM's prefix cache; the prefill's last position yields the first token), then one
forward per further generated token at its position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderFlops:
    """FLOP counts for one model shape (:meth:`from_hf_config`)."""

    matmul_params: int  # N_mm
    attn_width: int  # n_layers * n_heads * head_dim

    @classmethod
    def from_hf_config(cls, c: Any) -> DecoderFlops:
        d, layers, heads = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
        kv = getattr(c, "num_key_value_heads", None) or heads
        hd = getattr(c, "head_dim", None) or d // heads
        per_layer = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * c.intermediate_size
        return cls(layers * per_layer + d * c.vocab_size, layers * heads * hd)

    def span(self, start: int, end: int) -> float:
        """Forward FLOPs of positions ``[start, end)`` of one sequence (earlier ones cached)."""
        if end <= start:
            return 0.0
        positions = end * (end + 1) // 2 - start * (start + 1) // 2  # sum of (i + 1) over the span
        return 2.0 * self.matmul_params * (end - start) + 4.0 * self.attn_width * positions

    def train(self, seq_lens: Sequence[int]) -> float:
        """Forward + backward over whole sequences (prompt + response): 3x the forward."""
        return 3.0 * sum(self.span(0, n) for n in seq_lens)

    def train_shared_prefix(self, prompt_lens: Sequence[int], response_lens: Sequence[int], groups: Sequence[int]) -> float:
        """Forward + backward with the shared-prefix forward (``actor.shared_prefix``): each
        group's prompt once, each response at its positions after it (whole groups per
        micro-batch, as the trainer forms them)."""
        return 3.0 * self._prompt_once(prompt_lens, response_lens, groups, 0)

    def _prompt_once(self, prompt_lens: Sequence[int], response_lens: Sequence[int], groups: Sequence[int], skip: int) -> float:
        prompts: dict[int, int] = {}
        for g, p in zip(groups, prompt_lens, strict=True):
            prompts.setdefault(g, p)
        rest = sum(self.span(p, p + r - skip) for p, r in zip(prompt_lens, response_lens, strict=True))
        return sum(self.span(0, p) for p in prompts.values()) + rest

    def generate(self, prompt_lens: Sequence[int], response_lens: Sequence[int], groups: Sequence[int]) -> float:
        """Prefill once per group, then one forward per generated token after the first;
        ``groups[i]`` names the prompt sample ``i`` answers."""
        return self._prompt_once(prompt_lens, response_lens, groups, 1)
