"""How agent episodes run (:class:`AgentSettings`), apart from the agent loop so that the config
schema can extend it without importing torch (the launcher validates a config in seconds)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol


class Scheduling(StrEnum):
    continuous = "continuous"
    lockstep = "lockstep"


class ToolResponseKeep(StrEnum):
    head = "head"
    tail = "tail"


@dataclass
class AgentSettings:
    """How episodes run; the one source of these defaults (``config.AgentConfig`` extends it with
    enable / tool_config / parser, and the trainer passes ``rollout.agent`` itself)."""

    # Model turns per episode, and the token budget of the whole response (model + tool tokens).
    max_turns: int = 3
    max_response_tokens: int = 128
    # Tool responses longer than this (tokens) are truncated, keeping the head or the tail.
    tool_response_max_tokens: int = 32
    tool_response_keep: ToolResponseKeep = ToolResponseKeep.head
    # continuous (a slow tool delays only its own trajectory) | lockstep
    scheduling: Scheduling = Scheduling.continuous


class EngineSettings(Protocol):
    """The part of the ``rollout`` config an engine is built from (``RolloutConfig`` has it)."""

    enforce_eager: bool | None
    block_size: int
    enable_prefix_caching: bool
    max_num_seqs: int
    tensor_parallel_size: int
    gpu_memory_utilization: float
    kv_cache_gib: float
