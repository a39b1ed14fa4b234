"""Cross-field configuration checks a schema cannot express (:func:`validate`).

Every problem found is collected, so one run names all of them: ``invalid config: a; b; c``.
Algorithm-specific checks read what the registered estimator declares it needs
(:data:`hybrid_rl.algorithms.registry.NEEDS`), not lists of names.
"""

from __future__ import annotations

from typing import Any

from hybrid_rl.errors import ConfigError

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
DTYPES = ("float32", "bfloat16", "float16")


def validate(cfg: Any, world_size: int = 1) -> None:
    """Cross-field checks; raises :class:`ConfigError` naming the fields."""
    problems = _common(cfg) + _precision(cfg) + _agent(cfg) + _reward_model(cfg)
    if cfg.trainer.task == "rl":
        problems += _rl_algorithm(cfg) + _rl_sampling(cfg) + _rl_batching(cfg, world_size)
    if problems:
        raise ConfigError("invalid config: " + "; ".join(problems))


def _common(cfg: Any) -> list[str]:
    a, d, t, act, pr = cfg.algorithm, cfg.data, cfg.trainer, cfg.actor, cfg.preference
    checks = [
        (t.task not in ("rl", "sft", "dpo", "rm"), f"trainer.task={t.task!r} must be rl, sft, dpo or rm"),
        (pr.rm_loss not in ("pairwise", "margin", "listwise"), f"preference.rm_loss={pr.rm_loss!r} must be pairwise, margin or listwise"),
        (t.task in ("dpo", "rm") and bool(act.max_tokens_per_micro),
         "actor.max_tokens_per_micro must be 0 for dpo/rm (micro-batches keep pairs and lists together)"),
        (a.loss_agg_mode not in LOSS_AGG_MODES, f"algorithm.loss_agg_mode={a.loss_agg_mode!r} must be one of {', '.join(LOSS_AGG_MODES)}"),
        (cfg.critic.loss_agg_mode not in LOSS_AGG_MODES,
         f"critic.loss_agg_mode={cfg.critic.loss_agg_mode!r} must be one of {', '.join(LOSS_AGG_MODES)}"),
        (act.recompute_old_logprobs not in ("auto", "always"),
         f"actor.recompute_old_logprobs={act.recompute_old_logprobs!r} must be auto or always"),
        (d.truncation not in ("skip", "left", "right", "error"), f"data.truncation={d.truncation!r} must be skip, left, right or error"),
        (d.max_prompt_length < 1, f"data.max_prompt_length={d.max_prompt_length} must be >= 1"),
        (act.micro_batch_size < 1, f"actor.micro_batch_size={act.micro_batch_size} must be >= 1"),
        (act.lr_schedule not in ("constant", "cosine"), f"actor.lr_schedule={act.lr_schedule!r} must be constant or cosine"),
        (cfg.rollout.sync_transport not in ("auto", "collective", "shm"),
         f"rollout.sync_transport={cfg.rollout.sync_transport!r} must be auto, collective or shm"),
        (act.optimizer_impl not in ("fused", "foreach"), f"actor.optimizer_impl={act.optimizer_impl!r} must be fused or foreach"),
        (act.grad_accumulation not in ("sharded", "unsharded"),
         f"actor.grad_accumulation={act.grad_accumulation!r} must be sharded or unsharded"),
        (t.device not in ("auto", "cpu", "cuda"), f"trainer.device={t.device!r} must be auto, cpu or cuda"),
    ]  # fmt: skip
    return [msg for bad, msg in checks if bad]


def _precision(cfg: Any) -> list[str]:
    problems = []
    if cfg.model.dtype is not None:
        problems.append(
            f"model.dtype={cfg.model.dtype} was removed: master weights and optimizer state are always fp32; "
            "set the training compute dtype with actor.param_dtype and the rollout engine's with rollout.dtype"
        )
    if cfg.rollout.dtype not in ("auto", *DTYPES):
        problems.append(f"rollout.dtype={cfg.rollout.dtype!r} must be auto, float32, bfloat16 or float16")
    if cfg.actor.param_dtype is not None and cfg.actor.param_dtype not in ("auto", *DTYPES):
        problems.append(f"actor.param_dtype={cfg.actor.param_dtype!r} must be auto, float32, bfloat16 or float16 (or null)")
    if cfg.actor.reduce_dtype is not None and cfg.actor.reduce_dtype not in DTYPES:
        problems.append(f"actor.reduce_dtype={cfg.actor.reduce_dtype!r} must be float32, bfloat16 or float16")
    return problems


def _reward_model(cfg: Any) -> list[str]:
    from hybrid_rl.rewards.ensemble import ENSEMBLE_REDUCERS

    rm = cfg.reward.reward_model
    checks = [
        (bool(rm.ensemble) and not rm.path, "reward.reward_model.ensemble needs reward.reward_model.path (the first model)"),
        (rm.ensemble_reduce not in ENSEMBLE_REDUCERS,
         f"reward.reward_model.ensemble_reduce={rm.ensemble_reduce!r} must be one of {', '.join(sorted(ENSEMBLE_REDUCERS))}"),
        (rm.ensemble_var_coef < 0, f"reward.reward_model.ensemble_var_coef={rm.ensemble_var_coef} must be >= 0"),
    ]  # fmt: skip
    return [msg for bad, msg in checks if bad]


def _agent(cfg: Any) -> list[str]:
    ag, r = cfg.rollout.agent, cfg.rollout
    if not ag.enable:
        return []
    checks = [
        (ag.scheduling not in ("continuous", "lockstep"), f"rollout.agent.scheduling={ag.scheduling!r} must be continuous or lockstep"),
        (ag.tool_response_keep not in ("head", "tail"), f"rollout.agent.tool_response_keep={ag.tool_response_keep!r} must be head or tail"),
        (ag.max_turns < 1 or ag.max_response_tokens < r.max_response_length,
         "rollout.agent.max_turns must be >= 1 and rollout.agent.max_response_tokens >= rollout.max_response_length"),
    ]  # fmt: skip
    return [msg for bad, msg in checks if bad]


def _rl_algorithm(cfg: Any) -> list[str]:
    from hybrid_rl.algorithms.registry import ADV_ESTIMATORS, POLICY_LOSSES

    a, r = cfg.algorithm, cfg.rollout
    needs = ADV_ESTIMATORS.needs.get(a.adv_estimator, frozenset())
    checks = [
        (a.adv_estimator not in ADV_ESTIMATORS,
         f"algorithm.adv_estimator={a.adv_estimator!r} is unknown; known: {', '.join(sorted(ADV_ESTIMATORS))}"),
        (a.policy_loss not in POLICY_LOSSES, f"algorithm.policy_loss={a.policy_loss!r} is unknown; known: {', '.join(sorted(POLICY_LOSSES))}"),
        ("group" in needs and r.n < 2,
         f"rollout.n={r.n} with algorithm.adv_estimator={a.adv_estimator}: a group baseline needs n >= 2"
         " (with one sample per prompt every advantage is 0)"),
        ("critic" in needs and not cfg.critic.enable, f"algorithm.adv_estimator={a.adv_estimator} needs a critic: set critic.enable=true"),
        ("greedy_baseline" in needs and not a.greedy_baseline,
         f"algorithm.adv_estimator={a.adv_estimator} needs algorithm.greedy_baseline=true"),
        (not 0 < a.clip_ratio_low < 1 or a.clip_ratio_high <= 0,
         "algorithm.clip_ratio_low must be in (0, 1) and algorithm.clip_ratio_high > 0"),
        (a.clip_ratio_c is not None and a.clip_ratio_c <= 1, f"algorithm.clip_ratio_c={a.clip_ratio_c} must be > 1 (or null)"),
        (a.adv_estimator == "gfpo" and not 2 <= a.gfpo_keep <= r.n, f"algorithm.gfpo_keep={a.gfpo_keep} must be in [2, rollout.n={r.n}]"),
        (a.gfpo_metric not in ("length", "reward_per_token"), f"algorithm.gfpo_metric={a.gfpo_metric!r} must be length or reward_per_token"),
        (a.overlong_buffer < 0 or a.overlong_buffer >= r.max_response_length,
         f"algorithm.overlong_buffer={a.overlong_buffer} must be in [0, rollout.max_response_length)"),
        (a.tis_mode not in ("none", "token", "sequence"), f"algorithm.tis_mode={a.tis_mode!r} must be none, token or sequence"),
    ]  # fmt: skip
    return [msg for bad, msg in checks if bad]


def _rl_sampling(cfg: Any) -> list[str]:
    r = cfg.rollout
    checks = [
        (r.temperature <= 0,
         f"rollout.temperature={r.temperature} must be > 0 for training rollouts (greedy samples have no "
         "sampling log-probs; greedy validation is always run)"),
        (not 0 < r.top_p <= 1 or r.top_k == 0 or r.top_k < -1,
         f"rollout.top_p={r.top_p} must be in (0, 1] and rollout.top_k={r.top_k} -1 (off) or >= 1"),
        (r.max_response_length < 1, f"rollout.max_response_length={r.max_response_length} must be >= 1"),
    ]  # fmt: skip
    return [msg for bad, msg in checks if bad]


def _rl_batching(cfg: Any, world_size: int) -> list[str]:
    r, d, act = cfg.rollout, cfg.data, cfg.actor
    problems = []
    tp = r.tensor_parallel_size
    if tp < 1 or world_size % tp:
        problems.append(f"rollout.tensor_parallel_size={tp} must divide the {world_size} ranks")
    elif d.train_batch_size % (world_size // tp):
        problems.append(
            f"data.train_batch_size={d.train_batch_size} does not divide over {world_size // tp} "
            f"data-parallel rollout groups ({world_size} ranks / rollout.tensor_parallel_size={tp})"
        )
    elif (d.train_batch_size // (world_size // tp) * r.n) % tp:
        problems.append(f"the samples of a rollout group do not split over rollout.tensor_parallel_size={tp} ranks")
    samples = d.train_batch_size * r.n
    mini = act.mini_batch_size or samples
    if samples % mini:
        problems.append(
            f"actor.mini_batch_size={mini} does not divide the {samples} samples per step "
            f"(data.train_batch_size={d.train_batch_size} x rollout.n={r.n})"
        )
    elif mini % world_size:
        problems.append(f"actor.mini_batch_size={mini} does not divide over {world_size} ranks")
    return problems
