"""Builders of the FSDP2 engines from an HF folder and the config sections they read: the policy
(actor or frozen reference), the critic (policy body + zero-initialised value head) and the reward
model (sequence classification). Master weights are always fp32 (:data:`MASTER_DTYPE`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybrid_rl.dist import DistContext
from hybrid_rl.engine.fsdp import MASTER_DTYPE, FSDPEngine, OptimConfig, to_dtype
from hybrid_rl.errors import ModelPathError


def load_hf_causal_lm(
    path: str, dtype: torch.dtype, attn_implementation: str, device: torch.device, trust_remote_code: bool = False
) -> nn.Module:
    """``AutoModelForCausalLM`` from a local folder; SDPA on CPU, flash-attn on CUDA when installed."""
    from transformers import AutoModelForCausalLM

    if attn_implementation == "auto":
        attn_implementation = "sdpa"
        if device.type == "cuda":
            try:
                import flash_attn  # noqa: F401

                attn_implementation = "flash_attention_2"
            except ImportError:
                pass
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )
    except Exception as e:
        raise ModelPathError(f"model.path={path!r}: cannot load the model ({type(e).__name__}: {e})") from e
    model.config.use_cache = False
    return model


def build_policy_engine(
    path: str, model_cfg, actor_cfg, ctx: DistContext, total_steps: int, trainable: bool = True
) -> FSDPEngine:
    """The actor (``trainable``) or a frozen reference policy, from an HF folder."""
    from hybrid_rl.engine.heads import PolicyModule

    # fp32 master weights always (bf16 masters with bf16 Adam state lose most small updates);
    # actor.param_dtype sets the compute dtype through FSDP2's mixed-precision policy.
    lm = load_hf_causal_lm(path, MASTER_DTYPE, model_cfg.attn_implementation, ctx.device, model_cfg.trust_remote_code)
    if trainable and actor_cfg.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return FSDPEngine(
        PolicyModule(lm, actor_cfg.logprob_chunk, actor_cfg.packing),
        ctx,
        OptimConfig.from_actor(actor_cfg, total_steps) if trainable else None,
        micro_batch_size=actor_cfg.micro_batch_size,
        max_tokens_per_micro=actor_cfg.max_tokens_per_micro,
        param_dtype=to_dtype(actor_cfg.param_dtype),
        reduce_dtype=to_dtype(actor_cfg.reduce_dtype),
    )


def build_value_engine(path: str, model_cfg, critic_cfg, actor_cfg, ctx: DistContext, total_steps: int) -> FSDPEngine:
    """A critic initialised from the policy checkpoint's body with a zero-initialised value head."""
    from hybrid_rl.engine.heads import ValueModule

    lm = load_hf_causal_lm(path, MASTER_DTYPE, model_cfg.attn_implementation, ctx.device, model_cfg.trust_remote_code)
    module = ValueModule(lm.model, lm.config.hidden_size, actor_cfg.packing).to(MASTER_DTYPE)
    optim = OptimConfig(
        lr=critic_cfg.lr,
        weight_decay=actor_cfg.weight_decay,
        betas=tuple(actor_cfg.betas),
        warmup_steps=0,
        schedule="constant",
        min_lr_ratio=1.0,
        total_steps=total_steps,
        grad_clip=actor_cfg.grad_clip,
    )
    return FSDPEngine(
        module,
        ctx,
        optim,
        micro_batch_size=actor_cfg.micro_batch_size,
        max_tokens_per_micro=actor_cfg.max_tokens_per_micro,
        param_dtype=to_dtype(actor_cfg.param_dtype),
        reduce_dtype=to_dtype(actor_cfg.reduce_dtype),
        name_prefix="body.",
    )


def build_reward_engine(path: str, cfg: Any, ctx: DistContext, total_steps: int, trainable: bool) -> FSDPEngine:
    """An HF sequence-classification model with one label, FSDP2-sharded; a fresh score head when
    ``path`` is a causal LM (the SFT model)."""
    from transformers import AutoModelForSequenceClassification

    from hybrid_rl.engine.heads import RewardModule

    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=MASTER_DTYPE, attn_implementation="sdpa", trust_remote_code=cfg.model.trust_remote_code
    )
    model.config.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    a = cfg.actor
    return FSDPEngine(
        RewardModule(model),
        ctx,
        OptimConfig.from_actor(a, total_steps) if trainable else None,
        micro_batch_size=a.micro_batch_size,
        param_dtype=to_dtype(a.param_dtype),
        reduce_dtype=to_dtype(a.reduce_dtype),
        name_prefix="rm.",
    )
