"""Schemas of the groups that say how a run learns and runs: algorithm, critic, preference,
reward, trainer, logger. Every field is typed and its comment is its documentation; fields with a
closed set of values are enums (:mod:`hybrid_rl.config.enums`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybrid_rl.algorithms.params import (
    FilterGroupsSettings,
    GFPOSettings,
    KLLossSettings,
    KLRewardSettings,
    OverlongSettings,
    TISSettings,
)
from hybrid_rl.config.enums import Device, LoggerBackend, NoUpdateAction, RMLoss, Task
from hybrid_rl.config.groups import LoraConfig


@dataclass
class AlgorithmConfig:
    """How the policy learns from a rollout: the estimator and loss by name, their declared
    parameters (top-level keys), and one section per concern (KL loss, KL reward, DAPO's group
    filter and overlong shaping, GFPO, TIS). The sections' types live in
    :mod:`hybrid_rl.algorithms.params`, beside the functions that read them; a key that moved
    into a section is named by the error its old spelling gets (:data:`MOVED_KEYS`)."""

    # Advantage estimator (registry): grpo, drgrpo, rloo, reinforce, reinforce_pp,
    # reinforce_pp_baseline, remax (generates the greedy baseline it needs), gae, gfpo
    adv_estimator: str = "grpo"
    # Policy loss (registry): ppo_clip, gspo, reinforce
    policy_loss: str = "ppo_clip"
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_agg_mode: str = "token-mean"
    # Entropy bonus coefficient c_H (the loss subtracts c_H x the token entropy).
    entropy_coeff: float = 0.0
    # Estimator parameter (grpo, gfpo): divide by the group's std (False = Dr.GRPO).
    norm_adv_by_std: bool = True
    # Estimator parameter (reinforce_pp, gae): the discount.
    gamma: float = 1.0
    # Estimator parameter (gae): GAE's lambda.
    lam: float = 1.0
    # Policy-loss parameter (ppo_clip, gspo): the ratio's lower clip, 1 - clip_ratio_low.
    clip_ratio_low: float = 0.2
    # Policy-loss parameter (ppo_clip, gspo): the upper clip, 1 + clip_ratio_high (DAPO clip-higher: > low).
    clip_ratio_high: float = 0.2
    # Policy-loss parameter (ppo_clip): dual-clip bound c for negative advantages (Ye et al. 2020); null = off.
    clip_ratio_c: float | None = 3.0
    kl_loss: KLLossSettings = field(default_factory=KLLossSettings)
    kl_reward: KLRewardSettings = field(default_factory=KLRewardSettings)
    filter_groups: FilterGroupsSettings = field(default_factory=FilterGroupsSettings)
    overlong: OverlongSettings = field(default_factory=OverlongSettings)
    gfpo: GFPOSettings = field(default_factory=GFPOSettings)
    tis: TISSettings = field(default_factory=TISSettings)


# Keys of `algorithm` that moved into a section (old -> new), and one that went away: the error a
# recipe or command line with the old spelling gets names the new key (config.preflight.one_line_error).
MOVED_KEYS = {
    "algorithm.use_kl_loss": "algorithm.kl_loss.enable",
    "algorithm.kl_loss_coef": "algorithm.kl_loss.coef",
    "algorithm.kl_loss_type": "algorithm.kl_loss.type",
    "algorithm.use_kl_in_reward": "algorithm.kl_reward.enable",
    "algorithm.kl_penalty": "algorithm.kl_reward.penalty",
    "algorithm.kl_coef": "algorithm.kl_reward.coef",
    "algorithm.kl_ctrl": "algorithm.kl_reward.ctrl",
    "algorithm.kl_target": "algorithm.kl_reward.target",
    "algorithm.kl_horizon": "algorithm.kl_reward.horizon",
    "algorithm.filter_groups": "algorithm.filter_groups.enable",
    "algorithm.max_gen_rounds": "algorithm.filter_groups.max_gen_rounds",
    "algorithm.filter_metric": "algorithm.filter_groups.metric",
    "algorithm.overlong_buffer": "algorithm.overlong.buffer",
    "algorithm.overlong_penalty_factor": "algorithm.overlong.penalty_factor",
    "algorithm.mask_truncated": "algorithm.overlong.mask_truncated",
    "algorithm.gfpo_keep": "algorithm.gfpo.keep",
    "algorithm.gfpo_metric": "algorithm.gfpo.metric",
    "algorithm.tis_mode": "algorithm.tis.mode",
    "algorithm.tis_cap": "algorithm.tis.cap",
}
REMOVED_KEYS = {
    "algorithm.greedy_baseline": "adv_estimator=remax generates the greedy baseline it declares it needs",
}


@dataclass
class CriticConfig:
    # PPO's value model: a separate FSDP2 model (the policy's body + a zero-initialised scalar head).
    enable: bool = False
    lr: float = 1.0e-5
    # Clip of the value update around the old values (null = plain squared error).
    cliprange_value: float | None = 0.5
    value_loss_coef: float = 1.0
    # Aggregation of the value loss over tokens (same modes as algorithm.loss_agg_mode; verl's
    # critic uses token-mean whatever the actor's mode).
    loss_agg_mode: str = "token-mean"
    # Steps at the start that train only the critic (the actor waits for useful values).
    warmup_steps: int = 0
    # LoRA on the critic's body (critic.lora.rank > 0): the body is frozen and only its adapters
    # and the value head train (fp32, with their AdamW state); checkpoints hold just those. The
    # critic never reaches the rollout engine, so any rank works. Same fields as actor.lora.
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class PreferenceConfig:
    # DPO temperature beta.
    beta: float = 0.1
    # Reward-model loss: pairwise (Bradley-Terry) | margin (hinge) | listwise (softmax CE over ranks).
    rm_loss: RMLoss = RMLoss.pairwise
    rm_margin: float = 1.0
    # Responses per ranked list (listwise); pairs use 2.
    list_size: int = 4
    # Building the default preference set from the SFT model: prompts used, answers sampled per prompt.
    n_prompts: int = 3000
    samples_per_prompt: int = 8
    # Distinct (correct, incorrect) pairs taken per prompt from those answers.
    pairs_per_prompt: int = 4
    # Held-out share of the built preference set.
    val_fraction: float = 0.1
    # Sampling seed of the built set; null = trainer.seed. Fixing it lets reward models trained
    # with different trainer.seed (an ensemble's members) share one preference set.
    seed: int | None = None


@dataclass
class RewardModelConfig:
    # A learned reward model scoring (prompt, response) on the training devices: a local HF
    # *ForSequenceClassification folder, or builtin:tiny-rm (built once by the rm_math recipe); null = off.
    path: str | None = None
    weight: float = 1.0
    # More reward models (local folders or builtin:tiny-rm) scored with `path`; the learned reward
    # is their ensemble (hybrid_rl/rewards/ensemble.py; Coste et al. 2024): mean | min (worst
    # case) | uwo (mean - ensemble_var_coef * variance over the models), each model's scores
    # standardised over the step's batch first when ensemble_normalize (offsets differ by seed).
    ensemble: list[str] = field(default_factory=list)
    ensemble_reduce: str = "mean"
    ensemble_var_coef: float = 1.0
    ensemble_normalize: bool = True


@dataclass
class RewardFnConfig:
    # Built-in: math (math-verify), format (\boxed{} present), or "custom" with path/function.
    name: str = "math"
    weight: float = 1.0
    path: str | None = None
    function: str | None = None


@dataclass
class RewardConfig:
    functions: list[RewardFnConfig] = field(default_factory=lambda: [RewardFnConfig()])
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    # Worker processes that score responses, and the per-response timeout (s).
    num_workers: int = 1
    timeout_s: float = 10.0
    # Score given when a reward function raises, times out or returns a non-number.
    failure_score: float = 0.0
    # Stop the run if every response of this many consecutive steps (all of a step's generation
    # rounds) failed to score.
    max_failed_steps: int = 3


@dataclass
class TrainerConfig:
    # rl | sft | dpo | rm | eval (evaluate a model folder or checkpoint: +recipe=eval_math)
    task: Task = Task.rl
    run_name: str = "default"
    output_dir: str = "outputs/${trainer.run_name}"
    # Ranks on this node; >1 relaunches under torchrun. Under torchrun the launcher's value wins.
    nproc_per_node: int = 1
    # auto | cpu | cuda
    device: Device = Device.auto
    seed: int = 0
    total_steps: int = 20
    # Validate every N steps (0 = never) and before the first step.
    val_every: int = 5
    val_before_train: bool = True
    # Checkpoint every N steps (0 = off), and/or when this many minutes of wall time passed since
    # the last one (0 = off); always at the end. A crash or kill -9 loses at most that much work.
    save_every: int = 0
    save_every_minutes: float = 10.0
    keep_last: int = 2
    # After a Ctrl-C / SIGTERM the launcher waits this long for the ranks to finish their step
    # and checkpoint, then kills them (the last complete checkpoint stays); a second signal
    # kills them at once.
    shutdown_grace_s: float = 300.0
    # Libraries the launcher preloads into the ranks (LD_PRELOAD): auto (tcmalloc + Intel OpenMP
    # on CPU, as vLLM's CPU backend asks; nothing on CUDA) | none | tcmalloc | iomp | paths (a:b).
    preload: str = "auto"
    # auto (the newest checkpoint in output_dir, if any) | never (start over) | must (fail when there
    # is none) | a checkpoint directory. A checkpoint of another model, or with changed optimizer or
    # data settings, is refused before anything starts; other changed settings are printed.
    resume: str = "auto"
    # Export the final policy as an HF folder (output_dir/hf).
    export_hf: bool = True
    # Rollouts may be at most this many weight versions old (0 = strictly on-policy).
    max_staleness: int = 0
    # Abort after this many consecutive updates with a non-finite loss or gradient norm (each is skipped).
    max_bad_steps: int = 3
    # A step without an optimizer step (dynamic sampling kept no group whose answers differ, or every
    # update was non-finite) is announced on the console and main.log each time; after this many in
    # a row (0 = never) the run warns with what to change, or with no_update_action=stop ends with
    # exit 2 after a checkpoint, instead of "finishing" without learning.
    no_update_patience: int = 5
    # What no_update_patience steps in a row without an update do: warn (and go on) or stop.
    no_update_action: NoUpdateAction = NoUpdateAction.warn
    # Seconds a collective may wait before the run fails with an error instead of hanging.
    collective_timeout_s: int = 600
    # SFT only: epochs over the training split (the step budget wins if reached first).
    sft_epochs: float = 1.0
    # RL steps (1-based) to run under torch.profiler: each writes a Chrome trace per rank to
    # output_dir/profile/step_XXXXXX_rank<R>.json.gz and logs rank 0's profile/<bucket>_s (GEMMs,
    # collectives, attention, the log-prob head, casts, the optimizer, Python). [] = off.
    profile_steps: list[int] = field(default_factory=list)


@dataclass
class LoggerConfig:
    # Any of: console, tensorboard, jsonl, wandb, mlflow (wandb/mlflow only when installed).
    backends: list[LoggerBackend] = field(
        default_factory=lambda: [LoggerBackend.console, LoggerBackend.tensorboard, LoggerBackend.jsonl]
    )
    project: str = "hybrid_rl"
    progress_bar: bool = True
    # Samples written to generations/{val,train}_step_XXXX.jsonl and TensorBoard text: the first N
    # of every validation and of every `generations_every`-th training step (0 = off).
    generations: int = 4
    generations_every: int = 10
