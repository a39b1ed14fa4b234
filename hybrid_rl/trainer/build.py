"""Building the pieces a run needs from the typed config: tokenizer, engines, tools, lengths.

Nothing here runs a training job: the builtin models (``builtin:tiny-sft`` ...) are made by the
task layer above (:mod:`hybrid_rl.tasks`), which hands trainers a model path."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from hybrid_rl.config.compose import compose_recipe, conf_dir, repo_path  # noqa: F401 (re-exported)
from hybrid_rl.config.preflight import check_model_dir  # noqa: F401 (re-exported)
from hybrid_rl.dist import DistContext
from hybrid_rl.errors import ConfigError, ModelPathError

if TYPE_CHECKING:  # the real types, without importing the engines when this module loads
    from transformers import PreTrainedTokenizerBase

    from hybrid_rl.config import Config
    from hybrid_rl.data.dataset import PromptRecord, PromptSampler
    from hybrid_rl.engine.fsdp import FSDPEngine
    from hybrid_rl.engine.lora import AdapterOffReference
    from hybrid_rl.hybrid.switch import HybridSwitch
    from hybrid_rl.rewards.pool import RewardPool
    from hybrid_rl.rollout.base import RolloutEngine
    from hybrid_rl.rollout.tools import Tool

log = logging.getLogger("hybrid_rl")


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelPathError(f"model.path={path!r}: cannot load the tokenizer ({type(e).__name__}: {e})") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def recipe_cache_key(recipe_cfg: Config) -> str:
    """Hash of what determines a built model (model, data, actor, agent, preference, steps, seed)."""
    groups = ("model", "data", "actor") + (("preference",) if recipe_cfg.trainer.task in ("dpo", "rm") else ())
    parts = {k: OmegaConf.to_container(recipe_cfg[k], resolve=True) for k in groups}
    if parts["actor"].get("lora", {}).get("rank", 0) == 0:
        parts["actor"].pop("lora", None)  # full fine-tune: the key of models built before LoRA existed
    for how in ("reshard_after_forward", "prefix_attention"):  # when FSDP2 frees gathered weights, which segment
        parts["actor"].pop(how, None)  # attention kernel computes the same scores: the same model either way
    if not parts["data"].get("train_size"):
        parts["data"].pop("train_size", None)  # every row: the key of models built before the limit existed
    parts["agent"] = OmegaConf.to_container(recipe_cfg.rollout.agent, resolve=True)
    parts["trainer"] = {k: recipe_cfg.trainer[k] for k in ("task", "total_steps", "seed", "sft_epochs")}
    if "builtin:synth_math" in [*recipe_cfg.data.train_files, *recipe_cfg.data.val_files]:
        from hybrid_rl.data.synth_math import GENERATOR_VERSION

        parts["synth_generator"] = GENERATOR_VERSION  # a model trained on other splits is not this one
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:10]


def build_rollout_engine(model_path: str, cfg: Config, ctx: DistContext, max_model_len: int, seed: int):
    """This rank's rollout engine, ``rollout.backend`` (vLLM by default; see rollout/backends.py)."""
    from hybrid_rl.rollout.backends import build_backend

    r = cfg.rollout
    lora = {"lora_rank": cfg.actor.lora.rank} if cfg.actor.lora.rank > 0 else {}  # backends without LoRA never see it
    return build_backend(
        r.backend, model_path, r, r.dtype, seed + ctx.rank, ctx.device, max_model_len, cfg.model.trust_remote_code, **lora
    )


def build_reference(cfg: Config, ctx: DistContext, model_path: str, actor: FSDPEngine):
    """The frozen reference policy for KL terms: a second engine from ``model_path``, or, with
    LoRA, the actor itself with its adapters off (the base is the starting model)."""
    from hybrid_rl.engine.builders import build_policy_engine
    from hybrid_rl.engine.lora import AdapterOffReference

    if cfg.actor.lora.rank > 0:
        return AdapterOffReference(actor)
    return build_policy_engine(model_path, cfg.model, cfg.actor, ctx, 1, trainable=False)


def check_lengths(cfg: Config, model_path: str, extra: int = 0) -> int:
    """max_model_len for the engine; error if prompt + response exceed the model's positions."""
    conf = json.loads((Path(model_path) / "config.json").read_text())
    limit = int(conf.get("max_position_embeddings", 1 << 30))
    need = cfg.data.max_prompt_length + cfg.rollout.max_response_length + extra
    if need > limit:
        raise ConfigError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + rollout.max_response_length "
            f"({cfg.rollout.max_response_length}){f' + {extra}' if extra else ''} = {need} exceeds the model's "
            f"max_position_embeddings={limit} ({model_path})"
        )
    return need


def build_tools(cfg: Config) -> tuple[list, list[dict] | None]:
    """The agent's tools and their JSON schemas (for the chat template), or ([], None) when off."""
    if not cfg.rollout.agent.enable:
        return [], None
    from hybrid_rl.rollout.tools import load_tools

    tools = load_tools(repo_path(cfg.rollout.agent.tool_config))
    return tools, [t.schema for t in tools]


def max_model_len(cfg: Config, model_path: str) -> int:
    """Prompt + response budget (a multi-turn response may be longer than one turn)."""
    ag = cfg.rollout.agent
    extra = ag.max_response_tokens - cfg.rollout.max_response_length if ag.enable else 0
    return check_lengths(cfg, model_path, extra)


@dataclass
class RLParts:
    """Everything an RL run is made of, assembled from the config by :func:`build_rl_parts`."""

    tokenizer: PreTrainedTokenizerBase
    tools: list[Tool]
    train_records: list[PromptRecord]
    val_records: list[PromptRecord]
    sampler: PromptSampler
    actor: FSDPEngine  # the trainable policy
    ref: FSDPEngine | AdapterOffReference | None  # frozen reference policy, when a KL term needs it
    critic: FSDPEngine | None  # value model (critic.enable)
    rollout_engine: RolloutEngine
    switch: HybridSwitch
    reward_pool: RewardPool
    val_pool: RewardPool  # scores held-out answers: the training pool, or the verifier without functions
    reward_models: list[FSDPEngine]  # learned reward models (reward.reward_model.path, then .ensemble); [] = none
    data_metrics: dict[str, float] = field(default_factory=dict)  # rows read / kept / skipped per split
    model_path: str = ""  # the local model folder the run started from (checkpoints record it for export)


def validation_pool(reward: Any, train_pool: RewardPool | None = None, announce: bool = True) -> RewardPool:
    """The pool that scores held-out answers, for training's validation and for eval alike.

    One rule: held-out answers are scored by the run's own reward functions (``train_pool`` when
    given), so ``val/score`` and ``generations/val_*`` carry the training reward, and a greedy
    answer counts as right when the ``math`` function gives it more than 0.5 or, without one, when
    its total score does (:func:`hybrid_rl.trainer.validation.correct`). Only a run without reward
    functions (a learned reward model alone, e.g. RLHF-PPO) has nothing to check answers with: it is
    scored by the ``math`` verifier, and says so."""
    from hybrid_rl.rewards.pool import RewardPool

    if reward.functions:
        return train_pool if train_pool is not None else RewardPool(reward)
    if announce:
        log.warning(
            "validation: reward.functions is empty (the reward is a learned model), so held-out answers are "
            "scored by the math verifier; val/accuracy is that verifier's"
        )
    verifier = {"functions": [{"name": "math", "weight": 1.0}], "reward_model": {"path": None}}
    return RewardPool(OmegaConf.merge(reward, verifier))


def optimizer_steps(cfg: Config) -> int:
    """Optimizer steps of the whole run (the LR schedule's length)."""
    samples = cfg.data.train_batch_size * cfg.rollout.n
    return cfg.trainer.total_steps * cfg.actor.epochs * max(1, samples // (cfg.actor.mini_batch_size or samples))


def build_rl_parts(cfg: Config, ctx: DistContext, model_path: str, reward_model_paths: list[str] | None = None) -> RLParts:
    """Tokenizer, prompts, the FSDP2 engines (actor, reference, critic, reward model), the
    rollout engine, the switch between them and the reward pools, for ``model_path``."""
    import random

    import torch

    from hybrid_rl.config import resolve_precision
    from hybrid_rl.data.dataset import PromptSampler, check_chat_template, load_prompts, resolve_files
    from hybrid_rl.engine.builders import build_policy_engine, build_reward_engine, build_value_engine
    from hybrid_rl.engine.fsdp import to_dtype
    from hybrid_rl.engine.lora import adapter_config
    from hybrid_rl.hybrid.switch import HybridSwitch
    from hybrid_rl.rewards.pool import RewardPool

    resolve_precision(cfg, ctx.device.type)  # main.run resolved and logged it already; direct callers too
    torch.manual_seed(cfg.trainer.seed + ctx.rank)
    random.seed(cfg.trainer.seed + ctx.rank)
    tok = load_tokenizer(model_path, cfg.model.trust_remote_code)
    check_chat_template(tok, model_path)
    tools, schemas = build_tools(cfg)
    d, a, steps = cfg.data, cfg.algorithm, optimizer_steps(cfg)
    train, train_report = load_prompts(resolve_files(d.train_files, "train", d.synth), tok, d, d.train_size, tools=schemas)
    val, val_report = load_prompts(resolve_files(d.val_files, "val", d.synth), tok, d, d.val_size, tools=schemas)
    if ctx.is_main:
        log.info(train_report.summary("data.train_files", d.max_prompt_length))
        log.info(val_report.summary("data.val_files", d.max_prompt_length))
    lora = cfg.actor.lora if cfg.actor.lora.rank > 0 else None
    actor = build_policy_engine(model_path, cfg.model, cfg.actor, ctx, steps, trainable=True, lora_seed=cfg.trainer.seed)
    ref = build_reference(cfg, ctx, model_path, actor) if a.kl_loss.enable or a.kl_reward.enable else None
    critic = build_value_engine(model_path, cfg.model, cfg.critic, cfg.actor, ctx, steps, cfg.trainer.seed + 1) if cfg.critic.enable else None
    engine = build_rollout_engine(model_path, cfg, ctx, max_model_len(cfg, model_path), cfg.trainer.seed)
    r = cfg.rollout
    switch = HybridSwitch(
        actor, engine, sync_dtype=to_dtype(r.dtype), bucket_bytes=r.sync_bucket_mb << 20, sleep_level=r.sleep_level,
        device=ctx.device, offload_optimizer=cfg.actor.offload_optimizer, idle={"ref": ref, "critic": critic},
        transport=r.sync_transport, adapter=adapter_config(lora, model_path) if lora is not None else None,
    )  # fmt: skip
    pool = RewardPool(cfg.reward)
    val_pool = validation_pool(cfg.reward, pool, ctx.is_main)
    rms = [build_reward_engine(p, cfg.model, cfg.actor, ctx, 1, trainable=False, seed=cfg.trainer.seed) for p in reward_model_paths or []]
    sampler = PromptSampler(len(train), d.train_batch_size, d.seed, d.shuffle)
    data = {**train_report.metrics("train"), **val_report.metrics("val")}
    return RLParts(tok, tools, train, val, sampler, actor, ref, critic, engine, switch, pool, val_pool, rms, data, model_path)
