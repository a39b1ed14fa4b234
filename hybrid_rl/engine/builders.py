"""Builders of the FSDP2 engines from an HF folder and the config sections they read: the policy
(actor or frozen reference), the critic (policy body + zero-initialised value head) and the reward
model (sequence classification). Master weights are always fp32 (:data:`MASTER_DTYPE`)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from hybrid_rl.dist import DistContext
from hybrid_rl.engine.fsdp import MASTER_DTYPE, FSDPEngine, OptimConfig, to_dtype
from hybrid_rl.engine.sharded_init import checkpoint_files, load_sharded, params_on_meta
from hybrid_rl.errors import ModelPathError

log = logging.getLogger("hybrid_rl")


def _attn(attn_implementation: str, device: torch.device) -> str:
    """SDPA on CPU, flash-attn on CUDA when installed (``auto``); else as configured."""
    if attn_implementation != "auto":
        return attn_implementation
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def load_hf_causal_lm(
    path: str,
    dtype: torch.dtype,
    attn_implementation: str,
    device: torch.device,
    trust_remote_code: bool = False,
    on_meta: bool = False,
) -> nn.Module:
    """``AutoModelForCausalLM`` from a local folder; with ``on_meta`` only its structure (parameters
    on the meta device, filled later shard by shard: :mod:`hybrid_rl.engine.sharded_init`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    attn = _attn(attn_implementation, device)
    try:
        if on_meta:
            checkpoint_files(path)  # a clear error now, not after sharding
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            with params_on_meta():
                model = AutoModelForCausalLM.from_config(
                    config, dtype=dtype, attn_implementation=attn, trust_remote_code=trust_remote_code
                )
        else:
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attn, trust_remote_code=trust_remote_code
            )
    except Exception as e:
        raise ModelPathError(f"model.path={path!r}: cannot load the model ({type(e).__name__}: {e})") from e
    model.config.use_cache = False
    return model


def _shard_loader(path: str, key_of, missing: dict | None = None):
    """``FSDPEngine(load_shards=...)``: read this rank's rows of every parameter from ``path``."""
    return lambda module: load_sharded(module, path, key_of, missing)


def _seeded_normal(std: float, seed: int = 0):
    """A fresh head's init, the same on every rank (each keeps its own rows)."""

    def init(name: str, shape: torch.Size) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(tuple(shape), generator=g, dtype=MASTER_DTYPE) * std

    return init


def use_shared_prefix(lm, actor_cfg, ctx: DistContext) -> bool:
    """``actor.shared_prefix``, unless the model cannot run it (then say why, once, and pack)."""
    from hybrid_rl.engine.shared_prefix import shared_prefix_unsupported

    if not actor_cfg.shared_prefix:
        return False
    why = shared_prefix_unsupported(lm)
    if actor_cfg.gradient_checkpointing:  # recomputed in backward, after the forward switched attention back
        why = "actor.gradient_checkpointing recomputes layers with the plain attention"
    if why and ctx.is_main:
        log.warning("actor.shared_prefix is off for this model: %s; using the packed forward", why)
    return why is None


def build_policy_engine(
    path: str, model_cfg, actor_cfg, ctx: DistContext, total_steps: int, trainable: bool = True, lora_seed: int | None = None
) -> FSDPEngine:
    """The actor (``trainable``) or a frozen reference policy, from an HF folder. With
    ``lora_seed`` (and ``actor.lora.rank > 0``) the actor trains LoRA adapters on a frozen base
    (:mod:`hybrid_rl.engine.lora`)."""
    from hybrid_rl.engine.heads import PolicyModule

    # fp32 master weights always (bf16 masters with bf16 Adam state lose most small updates);
    # actor.param_dtype sets the compute dtype through FSDP2's mixed-precision policy.
    sharded = model_cfg.sharded_init
    lm = load_hf_causal_lm(path, MASTER_DTYPE, model_cfg.attn_implementation, ctx.device, model_cfg.trust_remote_code, sharded)
    if trainable and actor_cfg.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    missing = None
    if lora_seed is not None and actor_cfg.lora.rank > 0:
        from hybrid_rl.engine import lora

        compute = to_dtype(actor_cfg.param_dtype, ctx.device)
        lm = lora.inject(lm, actor_cfg.lora, lora_seed, compute if actor_cfg.lora.base_in_compute_dtype else None)
        missing = lora.missing_inits(lm, lora_seed)
        missing = {"lm." + k: v for k, v in missing.items()}
    return FSDPEngine(
        PolicyModule(
            lm, actor_cfg.logprob_chunk, actor_cfg.packing, use_shared_prefix(lm, actor_cfg, ctx), actor_cfg.prefix_attention
        ),
        ctx,
        OptimConfig.from_actor(actor_cfg, total_steps) if trainable else None,
        micro_batch_size=actor_cfg.micro_batch_size,
        max_tokens_per_micro=actor_cfg.max_tokens_per_micro,
        param_dtype=to_dtype(actor_cfg.param_dtype, ctx.device),
        reduce_dtype=to_dtype(actor_cfg.reduce_dtype),
        load_shards=_shard_loader(path, lambda n: n.removeprefix("lm.").replace(".base_layer.", "."), missing) if sharded else None,
        grad_accumulation=actor_cfg.grad_accumulation,
        reshard_after_forward=actor_cfg.reshard_after_forward,
    )


def build_value_engine(
    path: str, model_cfg, critic_cfg, actor_cfg, ctx: DistContext, total_steps: int, lora_seed: int = 0
) -> FSDPEngine:
    """A critic initialised from the policy checkpoint's body with a zero-initialised value head.
    With ``critic.lora.rank > 0`` the body is frozen and trains LoRA adapters (seeded by
    ``lora_seed``); the value head trains in full either way."""
    from hybrid_rl.engine.heads import ValueModule

    sharded = model_cfg.sharded_init
    lm = load_hf_causal_lm(path, MASTER_DTYPE, model_cfg.attn_implementation, ctx.device, model_cfg.trust_remote_code, sharded)
    zeros = {"value_head.weight": lambda n, shape: torch.zeros(shape), "value_head.bias": lambda n, shape: torch.zeros(shape)}
    if critic_cfg.lora.rank > 0:
        from hybrid_rl.engine import lora

        compute = to_dtype(actor_cfg.param_dtype, ctx.device)
        lm = lora.inject(lm, critic_cfg.lora, lora_seed, compute if critic_cfg.lora.base_in_compute_dtype else None, "critic.lora")
        zeros |= {"body." + k.removeprefix("model."): v for k, v in lora.missing_inits(lm, lora_seed).items()}
    shared = use_shared_prefix(lm, actor_cfg, ctx)
    module = ValueModule(lm.model, lm.config.hidden_size, actor_cfg.packing, shared, actor_cfg.prefix_attention)
    if critic_cfg.lora.rank == 0:
        module = module.to(MASTER_DTYPE)  # with LoRA the frozen body keeps its dtype; the head is fp32
    optim = OptimConfig(
        lr=critic_cfg.lr,
        weight_decay=actor_cfg.weight_decay,
        betas=tuple(actor_cfg.betas),
        warmup_steps=0,
        schedule="constant",
        min_lr_ratio=1.0,
        total_steps=total_steps,
        grad_clip=actor_cfg.grad_clip,
        impl=actor_cfg.optimizer_impl,
    )
    return FSDPEngine(
        module,
        ctx,
        optim,
        micro_batch_size=actor_cfg.micro_batch_size,
        max_tokens_per_micro=actor_cfg.max_tokens_per_micro,
        param_dtype=to_dtype(actor_cfg.param_dtype, ctx.device),
        reduce_dtype=to_dtype(actor_cfg.reduce_dtype),
        name_prefix="body.",
        load_shards=_shard_loader(path, lambda n: "model." + n.removeprefix("body.").replace(".base_layer.", "."), zeros) if sharded else None,
        grad_accumulation=actor_cfg.grad_accumulation,
        reshard_after_forward=actor_cfg.reshard_after_forward,
    )


def build_reward_engine(path: str, model_cfg, actor_cfg, ctx: DistContext, total_steps: int, trainable: bool, seed: int) -> FSDPEngine:
    """An HF sequence-classification model with one label, FSDP2-sharded; a fresh score head when
    ``path`` is a causal LM (the SFT model), initialised from ``seed``."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from hybrid_rl.engine.heads import RewardModule

    sharded, trc = model_cfg.sharded_init, model_cfg.trust_remote_code
    try:
        if sharded:
            checkpoint_files(path)
            config = AutoConfig.from_pretrained(path, num_labels=1, trust_remote_code=trc)
            with params_on_meta():
                model = AutoModelForSequenceClassification.from_config(
                    config, dtype=MASTER_DTYPE, attn_implementation="sdpa", trust_remote_code=trc
                )
        else:
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, dtype=MASTER_DTYPE, attn_implementation="sdpa", trust_remote_code=trc
            )
    except Exception as e:
        raise ModelPathError(f"reward model {path!r}: cannot load it ({type(e).__name__}: {e})") from e
    # A causal LM's checkpoint has no score head: a fresh one (HF's init, seeded by trainer.seed so
    # the members of a reward-model ensemble start apart, the same on every rank).
    fresh = {"rm.score.weight": _seeded_normal(getattr(model.config, "initializer_range", 0.02), seed)}
    model.config.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    a = actor_cfg
    return FSDPEngine(
        RewardModule(model),
        ctx,
        OptimConfig.from_actor(a, total_steps) if trainable else None,
        micro_batch_size=a.micro_batch_size,
        param_dtype=to_dtype(a.param_dtype, ctx.device),
        reduce_dtype=to_dtype(a.reduce_dtype),
        name_prefix="rm.",
        load_shards=_shard_loader(path, lambda n: n.removeprefix("rm."), fresh) if sharded else None,
        grad_accumulation=a.grad_accumulation,
        reshard_after_forward=a.reshard_after_forward,
    )
