"""The mode switch between training (FSDP2) and rollout (vLLM) on the same processes.

The order is code, each phase under a timer with a memory reading:

to_rollout:
    1. offload_optimizer  - optimizer state to host (CUDA; on CPU there is nowhere to move it)
       offload_idle       - the reference's and critic's parameters and the critic's optimizer
                            state to host (CUDA): the rollout needs none of them
    2. wake_weights       - re-allocate vLLM's weight memory (CUDA sleep mode, tag "weights")
    3. sync_weights       - stream parameters out of the shards (one flat all-gather per
                            bucket, the next bucket in flight, or shared memory between the
                            ranks of a host; engine/gather.py) into the engine's in-place loader;
                            with LoRA only the adapters go, in memory, as the engine's adapter
                            (the base weights it loaded at start-up never change); on one rank
                            the tensors handed over are the trainer's own, which the engine
                            only reads (an adapter it copies: vLLM scales B in place)
    4. wake_kv_cache      - re-allocate the KV cache (tag "kv_cache") after the weights, so
                            the gathered tensors are freed before the cache comes back
    5. reset_prefix_cache - cached prompt KV was computed with the old weights
    6. trim_host_heap     - hand the freed gather buckets and vLLM's replaced weights back to
                            the OS (glibc ``malloc_trim``; tcmalloc's release when preloaded),
                            after a push of at least one sync bucket;
                            without it RSS grows by ~1.7x the model's bytes over the first ~10
                            switches (heap fragmentation, measured on the 100M model) before it
                            levels off
    7. stamp the engine with the trainer's weights version (only here, after the load
                            returned: a sync that was skipped or failed leaves the engine's
                            version behind, and the trainer's guard refuses its rollouts)

to_train:
    1. sleep_engine       - free the KV cache and offload (level 1) or drop (level 2) weights
    2. reload_optimizer   - optimizer state back to the device
       reload_idle        - reference and critic back to the device

Every report lists the bytes each item moved (``moved_bytes``).

On CPU vLLM has no sleep mode: the KV cache stays allocated and vLLM keeps its own (repacked)
copy of the weights, so to_train frees nothing; the switch reports ``freed=False`` and the
bytes that stay resident instead of pretending.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybrid_rl.errors import StaleWeightsError
from hybrid_rl.rollout.base import RolloutEngine
from hybrid_rl.timing import PhaseTimer


def _heap_trimmers() -> list:
    """The release calls of the allocators in this process: glibc's ``malloc_trim(0)`` and, when
    tcmalloc is preloaded (``trainer.preload``), its ``MallocExtension_ReleaseFreeMemory()``
    (tcmalloc serves malloc then, so glibc's trim alone would find nothing to return)."""
    import ctypes

    calls = []
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
        calls.append(lambda: trim(0))
    except (OSError, AttributeError):  # not glibc
        pass
    try:
        calls.append(ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory)
    except (OSError, AttributeError):  # tcmalloc not loaded
        pass
    return calls


_TRIMMERS = _heap_trimmers()


def trim_host_heap() -> None:
    """Return free heap pages to the OS (glibc and tcmalloc; a no-op elsewhere)."""
    for release in _TRIMMERS:
        release()


class ShardedWeights(Protocol):
    """What the switch needs from the training engine."""

    def iter_full_params(
        self, bucket_bytes: int = ..., dtype: torch.dtype | None = ..., transport: str = ..., trainable_only: bool = ...
    ): ...

    def offload_optimizer(self) -> int: ...

    def reload_optimizer(self) -> int: ...


class IdleEngine(Protocol):
    """An engine the rollout does not use (reference, critic): offloaded while generating."""

    def offload_params(self) -> int: ...

    def reload_params(self) -> int: ...

    def offload_optimizer(self) -> int: ...

    def reload_optimizer(self) -> int: ...


@dataclass
class SwitchReport:
    direction: str
    seconds: dict[str, float]
    memory: dict[str, dict[str, float]]
    weights_version: int
    freed: bool = False
    notes: list[str] = field(default_factory=list)
    # Bytes moved to host (to_rollout) or back (to_train) per item: "actor.optimizer",
    # "ref.params", "critic.params", "critic.optimizer" (0 where there is no separate device memory),
    # and "sync.tensors": the bytes handed to the rollout engine (weights, or a LoRA run's adapters).
    moved_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


class HybridSwitch:
    """Owns the order of the switch and the weights version; composition of the two engines."""

    def __init__(
        self,
        trainer: ShardedWeights,
        rollout: RolloutEngine,
        *,
        sync_dtype: torch.dtype | None,
        bucket_bytes: int,
        sleep_level: int = 1,
        device: torch.device | None = None,
        offload_optimizer: bool = True,
        idle: dict[str, IdleEngine] | None = None,
        transport: str = "auto",
        adapter: dict | None = None,
    ) -> None:
        # LoRA: the adapter_config (engine/lora.py) that the pushed adapter tensors follow.
        self.adapter = adapter
        self.transport = transport  # rollout.sync_transport: auto | collective | shm
        self.trainer = trainer
        # Engines the rollout does not need (reference, critic): parameters and optimizer state
        # go to host memory while generating, back before training (CUDA; no-ops on CPU).
        self.idle = {k: v for k, v in (idle or {}).items() if v is not None}
        self.rollout = rollout
        self.sync_dtype = sync_dtype
        self.bucket_bytes = bucket_bytes
        self.sleep_level = sleep_level
        self.device = device
        self.offload_optimizer_state = offload_optimizer  # actor.offload_optimizer
        # Two versions: the trainer's weights (bumped by policy_updated after each update) and
        # the weights the engine really holds (set only after a completed load). Rollouts are
        # stamped with the engine's; check_version compares it with the trainer's.
        self.weights_version = 0
        self.engine_version = 0
        self.mode = "rollout"  # a fresh engine already holds the initial weights
        self.history: list[SwitchReport] = []

    def policy_updated(self) -> None:
        """The trainer changed its weights (an optimizer step): the engine is now behind."""
        self.weights_version += 1

    def to_rollout(self, skip_sync: bool = False) -> SwitchReport:
        """Push the trainer's current weights into the engine and make it ready to generate.

        ``skip_sync`` is fault injection only (``HYBRID_RL_FAULT=skip_sync@step``): the engine
        keeps its old weights, so the next update must fail with :class:`StaleWeightsError`.
        """
        timer = PhaseTimer("switch", self.device)
        notes: list[str] = []
        moved: dict[str, int] = {}
        with timer.phase("offload_optimizer"):
            if not self.offload_optimizer_state:
                notes.append("optimizer state stays in device memory (actor.offload_optimizer=false)")
            else:
                moved["actor.optimizer"] = self.trainer.offload_optimizer()
                if moved["actor.optimizer"] == 0:
                    notes.append("optimizer state stays in place (host memory already)")
        with timer.phase("offload_idle"):
            for name, engine in self.idle.items():
                moved[f"{name}.params"] = engine.offload_params()
                moved[f"{name}.optimizer"] = engine.offload_optimizer()
        sleeping = self.rollout.supports_sleep and self.mode == "train"
        with timer.phase("wake_weights"):
            if sleeping:
                self.rollout.wake_up(["weights"])
        with timer.phase("sync_weights"):
            if not skip_sync:
                moved["sync.tensors"] = self._push()
                self.engine_version = self.weights_version
        with timer.phase("wake_kv_cache"):
            if sleeping:
                self.rollout.wake_up(["kv_cache"])
        with timer.phase("reset_prefix_cache"):
            self.rollout.reset_prefix_cache()
        with timer.phase("trim_host_heap"):
            # A push under one bucket (a LoRA run's adapters, a toy model) leaves too little to
            # hand back to pay for the trim's walk of the heap (~35 ms at 100M parameters).
            if moved.get("sync.tensors", 0) >= self.bucket_bytes:
                trim_host_heap()
        if skip_sync:
            notes.append(f"weight sync skipped (fault injection): engine holds version {self.engine_version}")
        self.mode = "rollout"
        return self._report("to_rollout", timer, freed=False, notes=notes, moved=moved)

    def _push(self) -> int:
        """Stream the trainer's tensors (all of them, or a LoRA run's adapters) into the engine;
        returns the bytes handed over."""
        sent = [0]

        def counted(pairs):
            for name, t in pairs:
                sent[0] += t.numel() * t.element_size()
                yield name, t

        lora = self.adapter is not None
        tensors = counted(self.trainer.iter_full_params(self.bucket_bytes, self.sync_dtype, self.transport, trainable_only=lora))
        if lora:
            self.rollout.load_adapter(self.adapter, tensors, self.weights_version)
        else:
            self.rollout.load_weights(tensors)
        return sent[0]

    def to_train(self) -> SwitchReport:
        """Release what the engine holds (where the platform can) and bring the optimizer back."""
        timer = PhaseTimer("switch", self.device)
        notes = []
        with timer.phase("sleep_engine"):
            freed = self.rollout.sleep(self.sleep_level)
        if not freed:
            kv = self.rollout.memory_report().get("kv_cache_bytes", 0)
            notes.append(f"engine has no sleep mode here: KV cache ({kv / 2**20:.0f} MiB) and vLLM's weights stay resident")
        moved: dict[str, int] = {}
        with timer.phase("reload_optimizer"):
            if self.offload_optimizer_state:
                moved["actor.optimizer"] = self.trainer.reload_optimizer()
        with timer.phase("reload_idle"):
            for name, engine in self.idle.items():
                moved[f"{name}.params"] = engine.reload_params()
                moved[f"{name}.optimizer"] = engine.reload_optimizer()
        self.mode = "train"
        return self._report("to_train", timer, freed=freed, notes=notes, moved=moved)

    def check_version(self, rollout_version: int, max_staleness: int = 0) -> None:
        """Refuse to train on rollouts from weights more than ``max_staleness`` versions old."""
        lag = self.weights_version - rollout_version
        if lag < 0 or lag > max_staleness:
            raise StaleWeightsError(
                f"rollout was generated with weights version {rollout_version} but the trainer is at "
                f"{self.weights_version} (allowed lag trainer.max_staleness={max_staleness}); "
                "a weight sync was skipped or a stale rollout was reused"
            )

    def _report(
        self, direction: str, timer: PhaseTimer, freed: bool, notes: list[str], moved: dict[str, int]
    ) -> SwitchReport:
        report = SwitchReport(direction, dict(timer.seconds), dict(timer.memory), self.weights_version, freed, notes, moved)
        self.history.append(report)
        return report
