"""LoRA on the policy: adapters injected with PEFT, trained under FSDP2, synced to vLLM alone.

Each targeted linear layer computes ``y = W x + s B A x`` with ``A [r, in]``, ``B [out, r]``,
``s = alpha / r`` (Hu et al. 2021, arXiv:2106.09685). PEFT's ``inject_adapter_in_model`` swaps
the layers in place (no ``PeftModel`` wrapper), so the model keeps its HF structure: the engine's
heads, the sharded loader and FSDP2's per-layer wrapping see the same module tree as a full
fine-tune, with the base weight of a targeted layer at ``<layer>.base_layer.weight`` and the
adapter at ``<layer>.lora_A.default.weight`` / ``lora_B``. FSDP2 shards frozen and trainable
parameters together; only the trainable ones must share a dtype (fp32 here), so the frozen base
may be held in the compute dtype.

- The reference policy is the actor with its adapters off (:class:`AdapterOffReference`): the
  base is exactly the model the run started from, and no second copy is built.
- The weight sync gathers ``A`` and ``B`` only (:func:`is_lora`) and hands them to the rollout
  engine under PEFT's names (:func:`peft_name`); the engine's base weights never change.
- Checkpoints hold the adapters and their optimizer (DCP with ``ignore_frozen_params``); the
  export writes a PEFT adapter folder or a merged HF model (:mod:`hybrid_rl.export_lora`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

# Ranks vLLM can size its adapter slots to (vllm.config.lora.MaxLoRARanks).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER = "default"  # PEFT's adapter name; one adapter per run


def is_lora(name: str) -> bool:
    """Whether a parameter name is an adapter's ``A`` or ``B``."""
    return ".lora_A." in name or ".lora_B." in name


def engine_rank(rank: int) -> int:
    """The smallest rank vLLM sizes its slots to that holds ``rank``."""
    for r in VLLM_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"actor.lora.rank={rank} is above vLLM's largest LoRA rank {VLLM_RANKS[-1]}")


def adapter_config(lora: Any, base_model: str = "") -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for these settings (what vLLM's ``PEFTHelper`` and
    ``peft.PeftModel.from_pretrained`` read)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(lora.rank),
        "lora_alpha": float(lora.alpha),
        "lora_dropout": float(lora.dropout),
        "target_modules": sorted(lora.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
    }


def peft_name(hf_name: str) -> str:
    """A trainer name (``model.layers.0.self_attn.q_proj.lora_A.default.weight``) -> the name a
    saved PEFT adapter uses (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    return "base_model.model." + hf_name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(f".lora_B.{ADAPTER}.", ".lora_B.")


def inject(lm: nn.Module, lora: Any, seed: int, base_dtype: torch.dtype | None, key: str = "actor.lora") -> nn.Module:
    """Add adapters to ``lm`` in place: base frozen (cast to ``base_dtype`` if given), adapters fp32
    and trainable. ``A`` is PEFT's init drawn from ``seed`` (the same on every rank), ``B`` is 0, so
    the adapted model starts equal to the base. ``key``: the config section, for the error."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules), bias="none"
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            lm = inject_adapter_in_model(config, lm, adapter_name=ADAPTER)
        except ValueError as e:  # PEFT's NoMatchingPeftModuleError, named after our key
            raise ValueError(f"{key}.target_modules={list(lora.target_modules)} matched no linear layer of the model ({e})") from e
    for name, p in lm.named_parameters():
        trainable = is_lora(name)  # a value head added afterwards trains as it is
        p.requires_grad_(trainable)
        want = torch.float32 if trainable else (base_dtype or p.dtype)
        if p.dtype != want:
            p.data = p.data.to(want)
    return lm


def missing_inits(module: nn.Module, seed: int) -> dict[str, Callable[[str, torch.Size], Tensor]]:
    """Initialisers of the adapters for the sharded loader (the checkpoint has no adapters):
    PEFT's ``kaiming_uniform_(a=sqrt(5))`` for ``A``, i.e. ``U(-1/sqrt(in), 1/sqrt(in))``, seeded
    per name so every rank draws the same full tensor and keeps its rows; zeros for ``B``."""

    def init(name: str, shape: torch.Size) -> Tensor:
        if ".lora_B." in name:
            return torch.zeros(shape)
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1.0 / math.sqrt(shape[1])
        return (torch.rand(tuple(shape), generator=g) * 2 - 1) * bound

    return {n: init for n, _ in module.named_parameters() if is_lora(n)}


@contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """Run ``module`` as its base model. Sets PEFT's per-layer ``_disable_adapters`` flag directly:
    ``enable_adapters(False)`` would also flip the adapters' ``requires_grad``, which FSDP2 reads
    when it reduces gradients."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


def merged(weight: Tensor, a: Tensor, b: Tensor, scale: float) -> Tensor:
    """``W + s B A`` in fp32, returned in ``weight``'s dtype (``[out, in]``)."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


class AdapterOffReference:
    """The reference policy of a LoRA run: the actor's own engine with its adapters off.

    Same interface as a frozen reference engine (``forward_logprobs``, ``forward_outputs``) and the
    switch's idle-engine hooks, which have nothing to move: it holds no parameters of its own."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def forward_outputs(self, batch: Any, temperature: Any = 1.0) -> Any:
        with adapters_disabled(self.actor.module):
            return self.actor.forward_outputs(batch, temperature)

    def forward_logprobs(self, batch: Any, temperature: Any = 1.0) -> Tensor:
        return self.forward_outputs(batch, temperature).logprobs

    def offload_params(self) -> int:
        return 0

    def reload_params(self) -> int:
        return 0

    def offload_optimizer(self) -> int:
        return 0

    def reload_optimizer(self) -> int:
        return 0
