"""The rollout engine interface (no vllm import here: logic can be tested with a fake engine).

Named by what an engine does, after vLLM's own protocol: ``generate``, ``load_weights``,
``reset_prefix_cache``, ``sleep(level)``, ``wake_up(tags)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor


@dataclass
class SamplingSpec:
    """Sampling for one request; ``n`` samples share the prompt (and its KV cache blocks)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 64
    # One seed for the whole call, or (``seeds``) one per prompt, which wins. vLLM seeds child j
    # of an n-sample request with seed + j, so a shared seed makes sample j of every prompt draw
    # the same noise: training and pass@k pass per-prompt seeds from :func:`prompt_seed`.
    seed: int | None = None
    seeds: list[int] | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    # Return the sampler's log-prob of each generated token.
    logprobs: bool = True
    # Keep the stop string in the output (the agent loop needs the closing </tool_call>).
    include_stop_str_in_output: bool = False
    # Generate exactly max_tokens (benchmarks that need equal work per request).
    ignore_eos: bool = False


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def prompt_seed(*keys: int) -> int:
    """A sampling seed in ``[0, 2^31)`` that is a hash of ``keys`` (run seed, step, generation
    round, global prompt index, ...): independent across prompts, steps and ranks, and the same
    after a resume. Hashed, not summed, so the seed + j of a prompt's j-th child never lines up
    with another prompt's seed (as ``base + rank`` did)."""
    h = 0
    for k in keys:
        h = _splitmix64(h ^ (int(k) & _MASK64))
    return int(h >> 33)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    text: str = ""


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    completions: list[Completion]


@dataclass
class GenerateStats:
    """Prefix-cache accounting for one generate call (tokens)."""

    prompt_tokens: int = 0  # prompt tokens over all n samples (what prefill would cost without sharing)
    cached_prompt_tokens: int = 0  # served from the prefix cache
    generated_tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def computed_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.cached_prompt_tokens


class RolloutEngine(Protocol):
    """What the trainer and the hybrid switch need from an inference engine."""

    supports_sleep: bool
    last_stats: GenerateStats

    def generate(self, prompts: list[list[int]], spec: SamplingSpec) -> list[GenerationResult]: ...

    def submit(self, request_id: str, prompt_ids: list[int], spec: SamplingSpec) -> None: ...

    def poll(self) -> list[tuple[str, Completion]]: ...

    def has_pending(self) -> bool: ...

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None: ...

    # LoRA runs: replace the policy's adapter (PEFT adapter_config ``config``, trainer-named
    # tensors); the engine's base weights stay. Backends without adapters need not define it.
    def load_adapter(self, config: dict, tensors: Iterable[tuple[str, Tensor]], version: int) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def sleep(self, level: int = 1) -> bool: ...

    def wake_up(self, tags: list[str] | None = None) -> None: ...

    def memory_report(self) -> dict[str, int]: ...
