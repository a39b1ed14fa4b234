"""Cross-field configuration checks a schema cannot express (:func:`problems`, :func:`validate`).

Every problem found is collected, so one run names all of them: ``invalid config: a; b; c``.
Closed value sets are enums in the schema (checked when the config is composed); open sets are
checked here against their registry, read without importing torch
(:mod:`hybrid_rl.config.registered`). Algorithm-specific checks read what the registered estimator
declares it needs, not lists of names. Each task runs the checks that concern it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybrid_rl.config.registered import registered
from hybrid_rl.data.synth_math import LEVELS as SYNTH_LEVELS
from hybrid_rl.errors import ConfigError
from hybrid_rl.models.tiny import PRESETS

if TYPE_CHECKING:  # annotations only: Config is defined in the package __init__, which imports this module
    from hybrid_rl.config import Config
    from hybrid_rl.config.groups import LoraConfig

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def validate(cfg: Config, world_size: int = 1) -> None:
    """Cross-field checks; raises :class:`ConfigError` naming the fields."""
    found = problems(cfg, world_size)
    if found:
        raise ConfigError("invalid config: " + "; ".join(found))


def problems(cfg: Config, world_size: int = 1) -> list[str]:
    """Every cross-field problem of ``cfg`` for its ``trainer.task`` on ``world_size`` ranks."""
    found = _common(cfg) + _precision(cfg) + _agent(cfg) + _reward(cfg) + _reward_model(cfg) + _lora(cfg)
    task = cfg.trainer.task
    if task == "rl":
        found += _rl_algorithm(cfg) + _rl_sampling(cfg) + _rl_batching(cfg, world_size)
    elif task == "eval":
        found += _eval(cfg)
    elif task == "sft":
        found += _divides(cfg.data.train_batch_size, world_size, "data.train_batch_size") + _offline(cfg)
    else:  # dpo, rm
        found += _preference(cfg, world_size) + _offline(cfg)
    return found


def _offline(cfg: Config) -> list[str]:
    """SFT, DPO and RM training write no checkpoints, so there is nothing to resume."""
    r = cfg.trainer.resume
    if r in ("auto", "never", "none"):
        return []
    return [f"trainer.resume={r!r} with trainer.task={cfg.trainer.task}: only RL runs write checkpoints and resume "
            "(use auto or never)"]  # fmt: skip


def _lora(cfg: Config) -> list[str]:
    """LoRA trains the RL policy (its adapters reach the engine through vLLM's LoRA slots) and
    the critic (which never reaches the engine)."""
    lo, found = cfg.actor.lora, _lora_fields(cfg.critic.lora, "critic.lora")
    if lo.rank == 0:
        return found
    checks = [
        (lo.rank > 512, f"actor.lora.rank={lo.rank} is above vLLM's largest LoRA rank 512"),
        (cfg.trainer.task != "rl", f"actor.lora.rank={lo.rank}: LoRA trains the RL policy only (trainer.task={cfg.trainer.task})"),
        (cfg.rollout.backend != "vllm", f"actor.lora.rank={lo.rank} needs rollout.backend=vllm (the {cfg.rollout.backend!r} backend has no adapters)"),
    ]  # fmt: skip
    return _lora_fields(lo, "actor.lora") + [msg for bad, msg in checks if bad] + found


def _lora_fields(lo: LoraConfig, key: str) -> list[str]:
    if lo.rank == 0:
        return []
    checks = [
        (lo.rank < 0, f"{key}.rank={lo.rank} must be >= 0 (0 = full fine-tune)"),
        (lo.alpha <= 0, f"{key}.alpha={lo.alpha} must be > 0"),
        (not 0 <= lo.dropout < 1, f"{key}.dropout={lo.dropout} must be in [0, 1)"),
        (not lo.target_modules, f"{key}.target_modules is empty: name the linear layers to adapt (e.g. q_proj, v_proj)"),
    ]  # fmt: skip
    return [msg for bad, msg in checks if bad]


def _divides(n: int, world_size: int, key: str) -> list[str]:
    if n < 1:
        return [f"{key}={n} must be >= 1"]
    return [f"{key}={n} does not divide over {world_size} ranks"] if n % world_size else []


def _common(cfg: Config) -> list[str]:
    a, d, act, m = cfg.algorithm, cfg.data, cfg.actor, cfg.model
    checks = [
        (a.loss_agg_mode not in LOSS_AGG_MODES, f"algorithm.loss_agg_mode={a.loss_agg_mode!r} must be one of {', '.join(LOSS_AGG_MODES)}"),
        (cfg.critic.loss_agg_mode not in LOSS_AGG_MODES,
         f"critic.loss_agg_mode={cfg.critic.loss_agg_mode!r} must be one of {', '.join(LOSS_AGG_MODES)}"),
        (d.max_prompt_length < 1, f"data.max_prompt_length={d.max_prompt_length} must be >= 1"),
        (d.train_size < 0, f"data.train_size={d.train_size} must be >= 0 (0 = every row)"),
        (0 < d.train_size < d.train_batch_size, f"data.train_size={d.train_size} keeps fewer rows than one batch (data.train_batch_size={d.train_batch_size})"),
        (d.val_size < 0, f"data.val_size={d.val_size} must be >= 0 (0 = every row)"),
        (not 0 < d.synth.heldout_fraction < 1, f"data.synth.heldout_fraction={d.synth.heldout_fraction} must be in (0, 1)"),
        (not d.synth.levels or not set(d.synth.levels) <= set(SYNTH_LEVELS),
         f"data.synth.levels={list(d.synth.levels)}: each level must be one of {', '.join(map(str, SYNTH_LEVELS))}"),
        (act.micro_batch_size < 1, f"actor.micro_batch_size={act.micro_batch_size} must be >= 1"),
        (act.lr <= 0, f"actor.lr={act.lr} must be > 0"),
        (cfg.trainer.total_steps < 1, f"trainer.total_steps={cfg.trainer.total_steps} must be >= 1"),
        (any(not 1 <= s <= cfg.trainer.total_steps for s in cfg.trainer.profile_steps),
         f"trainer.profile_steps={list(cfg.trainer.profile_steps)} must be steps 1..trainer.total_steps={cfg.trainer.total_steps}"),
        (m.path.startswith("builtin:") and m.preset not in PRESETS, f"model.preset={m.preset!r} must be one of {', '.join(PRESETS)}"),
        (cfg.rollout.backend not in registered().names("backend"),
         f"rollout.backend={cfg.rollout.backend!r} is unknown; known: {', '.join(registered().names('backend'))}"),
    ]  # fmt: skip
    return [msg for bad, msg in checks if bad]


def _precision(cfg: Config) -> list[str]:
    if cfg.model.dtype is not None:
        return [
            f"model.dtype={cfg.model.dtype} was removed: master weights and optimizer state are always fp32; "
            "set the training compute dtype with actor.param_dtype and the rollout engine's with rollout.dtype"
        ]
    return []


def _reward(cfg: Config) -> list[str]:
    r = cfg.reward
    checks = [
        (r.num_workers < 1, f"reward.num_workers={r.num_workers} must be >= 1"),
        (not r.timeout_s > 0, f"reward.timeout_s={r.timeout_s} must be > 0 (0 would mean no timeout: a hung reward hangs the run)"),
        (r.max_failed_steps < 1, f"reward.max_failed_steps={r.max_failed_steps} must be >= 1"),
    ]  # fmt: skip
    return [msg for bad, msg in checks if bad]


def _reward_model(cfg: Config) -> list[str]:
    rm = cfg.reward.reward_model
    reducers = registered().names("ensemble_reduce")
    checks = [
        (bool(rm.ensemble) and not rm.path, "reward.reward_model.ensemble needs reward.reward_model.path (the first model)"),
        (rm.ensemble_reduce not in reducers, f"reward.reward_model.ensemble_reduce={rm.ensemble_reduce!r} must be one of {', '.join(reducers)}"),
        (rm.ensemble_var_coef < 0, f"reward.reward_model.ensemble_var_coef={rm.ensemble_var_coef} must be >= 0"),
    ]  # fmt: skip
    return [msg for bad, msg in checks if bad]


def _agent(cfg: Config) -> list[str]:
    ag, r = cfg.rollout.agent, cfg.rollout
    if not ag.enable or (ag.max_turns >= 1 and ag.max_response_tokens >= r.max_response_length):
        return []
    return ["rollout.agent.max_turns must be >= 1 and rollout.agent.max_response_tokens >= rollout.max_response_length"]


def _eval(cfg: Config) -> list[str]:
    r = cfg.rollout
    checks = [
        (r.val_pass_k > 0 and r.temperature <= 0, f"rollout.val_pass_k={r.val_pass_k} samples at rollout.temperature, which must be > 0"),
        (r.max_response_length < 1, f"rollout.max_response_length={r.max_response_length} must be >= 1"),
        (r.agent.enable, "trainer.task=eval runs single-turn generation: set rollout.agent.enable=false"),
    ]  # fmt: skip
    return [msg for bad, msg in checks if bad]


def _preference(cfg: Config, world_size: int) -> list[str]:
    pr, act = cfg.preference, cfg.actor
    checks = [
        (bool(act.max_tokens_per_micro), "actor.max_tokens_per_micro must be 0 for dpo/rm (micro-batches keep pairs and lists together)"),
        (pr.beta <= 0, f"preference.beta={pr.beta} must be > 0"),
        (pr.rm_loss == "listwise" and pr.list_size < 2, f"preference.list_size={pr.list_size} must be >= 2 for rm_loss=listwise"),
        (not 0 < pr.val_fraction < 1, f"preference.val_fraction={pr.val_fraction} must be in (0, 1)"),
        (pr.samples_per_prompt < 2, f"preference.samples_per_prompt={pr.samples_per_prompt} must be >= 2 (a pair needs two answers)"),
    ]  # fmt: skip
    return [msg for bad, msg in checks if bad] + _divides(cfg.data.train_batch_size, world_size, "data.train_batch_size")


def _rl_algorithm(cfg: Config) -> list[str]:
    a, r, act = cfg.algorithm, cfg.rollout, cfg.actor
    reg = registered()
    needs = reg.needs("adv_estimator", a.adv_estimator)
    several_updates = act.epochs > 1 or (act.mini_batch_size or 0) not in (0, cfg.data.train_batch_size * r.n)
    checks = [
        (a.adv_estimator not in reg.names("adv_estimator"),
         f"algorithm.adv_estimator={a.adv_estimator!r} is unknown; known: {', '.join(reg.names('adv_estimator'))}"),
        (a.policy_loss not in reg.names("policy_loss"),
         f"algorithm.policy_loss={a.policy_loss!r} is unknown; known: {', '.join(reg.names('policy_loss'))}"),
        ("group" in needs and r.n < 2,
         f"rollout.n={r.n} with algorithm.adv_estimator={a.adv_estimator}: a group baseline needs n >= 2"
         " (with one sample per prompt every advantage is 0)"),
        ("critic" in needs and not cfg.critic.enable, f"algorithm.adv_estimator={a.adv_estimator} needs a critic: set critic.enable=true"),
        ("critic" not in needs and cfg.critic.enable,
         f"critic.enable=true with algorithm.adv_estimator={a.adv_estimator}, which reads no values: a second model would be "
         "trained and its values thrown away (and critic.warmup_steps would hold the actor back); set critic.enable=false "
         "or algorithm.adv_estimator=gae"),
        (not 0 < a.clip_ratio_low < 1 or a.clip_ratio_high <= 0,
         "algorithm.clip_ratio_low must be in (0, 1) and algorithm.clip_ratio_high > 0"),
        (a.clip_ratio_c is not None and a.clip_ratio_c <= 1, f"algorithm.clip_ratio_c={a.clip_ratio_c} must be > 1 (or null)"),
        ("gfpo" in reg.param_fields("adv_estimator", a.adv_estimator) and not 2 <= a.gfpo.keep <= r.n,
         f"algorithm.gfpo.keep={a.gfpo.keep} must be in [2, rollout.n={r.n}]"),
        (a.overlong.buffer < 0 or a.overlong.buffer >= r.max_response_length,
         f"algorithm.overlong.buffer={a.overlong.buffer} must be in [0, rollout.max_response_length)"),
        (a.filter_groups.enable and a.filter_groups.metric == "acc" and not cfg.reward.functions,
         "algorithm.filter_groups.metric=acc needs reward.functions (the rule-based score it filters on); use metric=score"),
        (a.filter_groups.refill_margin < 1.0,
         f"algorithm.filter_groups.refill_margin={a.filter_groups.refill_margin} must be >= 1 (below 1 a refill expects to fall short)"),
        # Without an importance ratio every update after the first is off-policy and uncorrected.
        (a.policy_loss == "reinforce" and several_updates,
         f"algorithm.policy_loss=reinforce has no importance ratio: it needs actor.epochs=1 (got {act.epochs}) and one "
         f"mini-batch per step (actor.mini_batch_size=0, got {act.mini_batch_size}); use ppo_clip for several updates"),
    ]  # fmt: skip
    return [msg for bad, msg in checks if bad]


def _rl_sampling(cfg: Config) -> list[str]:
    r = cfg.rollout
    checks = [
        (r.temperature <= 0,
         f"rollout.temperature={r.temperature} must be > 0 for training rollouts (greedy samples have no "
         "sampling log-probs; greedy validation is always run)"),
        (not 0 < r.top_p <= 1 or r.top_k == 0 or r.top_k < -1,
         f"rollout.top_p={r.top_p} must be in (0, 1] and rollout.top_k={r.top_k} -1 (off) or >= 1"),
        (r.max_response_length < 1, f"rollout.max_response_length={r.max_response_length} must be >= 1"),
        (r.sleep_level not in (1, 2),
         f"rollout.sleep_level={r.sleep_level} must be 1 (free the KV cache, keep the weights) or 2 (free both)"),
        # Level 2 discards the base weights too; a LoRA push sends only the adapters back.
        (r.sleep_level == 2 and cfg.actor.lora.rank > 0,
         f"rollout.sleep_level=2 with actor.lora.rank={cfg.actor.lora.rank}: level 2 discards the engine's base weights and a "
         "LoRA sync sends only the adapters, so rollouts would run on a wiped base; use sleep_level=1"),
    ]  # fmt: skip
    return [msg for bad, msg in checks if bad]


def _rl_batching(cfg: Config, world_size: int) -> list[str]:
    r, d, act = cfg.rollout, cfg.data, cfg.actor
    found = []
    tp = r.tensor_parallel_size
    if tp < 1 or world_size % tp:
        found.append(f"rollout.tensor_parallel_size={tp} must divide the {world_size} ranks")
    elif d.train_batch_size % (world_size // tp):
        found.append(
            f"data.train_batch_size={d.train_batch_size} does not divide over {world_size // tp} "
            f"data-parallel rollout groups ({world_size} ranks / rollout.tensor_parallel_size={tp})"
        )
    elif (d.train_batch_size // (world_size // tp) * r.n) % tp:
        found.append(f"the samples of a rollout group do not split over rollout.tensor_parallel_size={tp} ranks")
    samples = d.train_batch_size * r.n
    mini = act.mini_batch_size or samples
    if samples % mini:
        found.append(
            f"actor.mini_batch_size={mini} does not divide the {samples} samples per step "
            f"(data.train_batch_size={d.train_batch_size} x rollout.n={r.n})"
        )
    elif mini % world_size:
        found.append(f"actor.mini_batch_size={mini} does not divide over {world_size} ranks")
    return found
