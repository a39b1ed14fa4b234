"""Typed configuration: dataclass schemas registered in Hydra's ConfigStore.

``conf/config.yaml`` starts from the ``base_config`` schema below, then each group file
(``conf/model/tiny.yaml`` ...) fills its node. Because every node is a structured config, a
typo'd or mistyped key fails at start with a message naming the key (``main`` turns OmegaConf's
multi-line error into one line). :func:`validate` adds the cross-field checks that a schema cannot
express (a group of 1 with std normalisation, a batch that does not divide over ranks, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from hybrid_rl.config_checks import LOSS_AGG_MODES, validate
from hybrid_rl.errors import ConfigError
from hybrid_rl.rollout.agent import AgentSettings


@dataclass
class ModelConfig:
    # A local HF folder, or a model the project builds itself:
    #   builtin:tiny      randomly initialised tiny Qwen2 (hybrid_rl.models.tiny, preset below)
    #   builtin:tiny-sft  the tiny model after the sft_math warm start (built once, then cached)
    path: str = "builtin:tiny-sft"
    # The recipe that builds builtin:tiny-sft (conf/recipe/<name>.yaml).
    sft_recipe: str = "sft_math"
    # Preset for builtin models: micro | tiny | small | base.
    preset: str = "tiny"
    # Removed: master weights and optimizer state are always fp32. Set the training compute dtype
    # with actor.param_dtype and the rollout engine's with rollout.dtype (validate() says so).
    dtype: str | None = None
    # HF attention kernel for training: sdpa (CPU and CUDA), flash_attention_2 (CUDA, if installed), eager.
    attn_implementation: str = "auto"
    trust_remote_code: bool = False
    # Build on the meta device, shard, then read each rank's rows from the safetensors files
    # (no full copy of the model on any rank). false: load the whole model on every rank first.
    sharded_init: bool = True


@dataclass
class SynthMathConfig:
    # Problems in the generated train / validation splits.
    n_train: int = 20000
    n_val: int = 1024
    # Difficulty levels (see hybrid_rl.data.synth_math).
    levels: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    seed: int = 0
    # Share of rows whose tool-use SFT target (extra_info.tool_turns) answers without the tool.
    direct_share: float = 0.0


@dataclass
class DataConfig:
    # parquet or jsonl files; "builtin:synth_math" generates (once) the synthetic task.
    train_files: list[str] = field(default_factory=lambda: ["builtin:synth_math"])
    val_files: list[str] = field(default_factory=lambda: ["builtin:synth_math"])
    # Column holding chat messages (list of {role, content}) or a plain string prompt.
    prompt_key: str = "prompt"
    # Dotted path to the ground truth (verl: reward_model.ground_truth; GSM8K: answer).
    answer_key: str = "reward_model.ground_truth"
    # SFT only: dotted path to the target response (synthetic task: its worked solution).
    response_key: str = "extra_info.solution"
    # Prompts longer than this (tokens) follow `truncation`.
    max_prompt_length: int = 128
    # What to do with a too-long prompt: skip (dropped and counted), left, right (truncate), error.
    truncation: str = "skip"
    # Prompts per RL step across all ranks (each yields rollout.n samples).
    train_batch_size: int = 32
    # Validation prompts used per evaluation (0 = all).
    val_size: int = 256
    shuffle: bool = True
    seed: int = 0
    # Optional system prompt prepended to every chat prompt.
    system_prompt: str | None = None
    synth: SynthMathConfig = field(default_factory=SynthMathConfig)


@dataclass
class AgentConfig(AgentSettings):
    # Multi-turn tool use: the model calls tools (hybrid_rl/rollout/agent.py). The episode fields
    # (max_turns, max_response_tokens, tool_response_max_tokens, tool_response_keep, scheduling)
    # and their defaults come from rollout.agent.AgentSettings.
    enable: bool = False
    # YAML file listing the tools (class_name + config), like verl's tool config.
    tool_config: str = "conf/tools/python.yaml"
    # Tool-call format parser: hermes (Qwen's <tool_call>{json}</tool_call>).
    parser: str = "hermes"


@dataclass
class RolloutConfig:
    # Group size G: samples per prompt, drawn with SamplingParams(n=G) so they share the prompt's KV.
    n: int = 8
    # Sampling temperature for training rollouts (> 0; greedy validation is separate).
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Rollout backend by name (hybrid_rl/rollout/backends.py): vllm | hf (transformers generate).
    backend: str = "vllm"
    # The rollout engine's weights/compute dtype (auto | float32 | bfloat16); weights are cast to
    # it on every sync. Independent of the trainer's fp32 master weights. auto: bfloat16 on CUDA
    # and on CPUs with amx_bf16/avx512_bf16, else float32 (hybrid_rl.env.auto_dtype).
    dtype: str = "auto"
    # Maximum new tokens per response (per turn budget for multi-turn).
    max_response_length: int = 64
    # KV cache per engine, GiB (CPU: allocated at start; CUDA: fraction below wins if > 0).
    kv_cache_gib: float = 0.25
    gpu_memory_utilization: float = 0.5
    block_size: int = 32
    enable_prefix_caching: bool = True
    # null = auto: eager on CPU, CUDA graphs on CUDA.
    enforce_eager: bool | None = None
    max_num_seqs: int = 256
    # vLLM tensor parallel size (CUDA, external_launcher); 1 = each rank has its own engine.
    tensor_parallel_size: int = 1
    # CUDA sleep level while training: 1 offloads weights to host, 2 discards them.
    sleep_level: int = 1
    # Weight sync: gather at most this many MiB of full tensors before handing them over.
    sync_bucket_mb: int = 64
    # Weight-sync gather: auto (shm on CPU when all ranks share a host, else collective) |
    # collective (one flat all-gather per bucket on gloo/NCCL) | shm (/dev/shm between local ranks).
    sync_transport: str = "auto"
    # Validation sampling: greedy pass@1 always; pass@k with this k at `temperature` (0 = off).
    val_pass_k: int = 0
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class ActorConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    # constant | cosine (decays to min_lr_ratio * lr over trainer.total_steps optimizer steps)
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    # Samples (not prompts) per optimizer step, across ranks; 0 = the whole batch (one step).
    mini_batch_size: int = 0
    # Samples per forward/backward on one rank; or pack by token budget if max_tokens_per_micro > 0.
    micro_batch_size: int = 16
    max_tokens_per_micro: int = 0
    # Padding-free micro-batches: rows repacked first-fit into fewer rows, each sequence attending
    # only to itself (block-diagonal mask from restarting position ids). Actor and critic.
    packing: bool = True
    # Shared-prefix training forward: in a micro-batch, each distinct prompt (a GRPO group's) runs
    # through the model once, packed with the responses; attention per segment gives every token
    # the keys of the plain forward (same log-probs and gradients). Off by itself for models without
    # transformers' attention interface, with sliding-window layers, or with gradient checkpointing.
    # Actor, reference and critic.
    shared_prefix: bool = True
    # Passes over each rollout batch (PPO epochs).
    epochs: int = 1
    # Old log-probs: "auto" skips the extra forward pass when the update is exactly on-policy
    # (1 epoch, 1 mini-batch, no TIS, no KL in the reward): the ratio is then 1 and
    # old = logprobs.detach() inside the loss gives the same gradient (as TRL with
    # num_iterations=1). "always" recomputes them before the update (verl's behaviour).
    recompute_old_logprobs: str = "auto"
    # Mixed precision (FSDP2 MixedPrecisionPolicy): the compute dtype of the forward/backward
    # (auto | null = fp32 | bfloat16 | float16) and of gradient reduction. Master weights and
    # AdamW state stay fp32. auto: bfloat16 where the hardware has native bf16 math (as rollout.dtype).
    param_dtype: str | None = "auto"
    reduce_dtype: str = "float32"
    # Token chunk for the log-prob head, bounding (T, V) memory for big vocabularies.
    logprob_chunk: int = 1024
    gradient_checkpointing: bool = False
    # Move optimizer state off the accelerator while rolling out (CUDA only; CPU has nowhere to go).
    offload_optimizer: bool = True
    # Gradient accumulation over micro-batches: "sharded" reduce-scatters after every micro-batch
    # (each rank keeps 1/N of the gradient) or "unsharded" once after the last (every rank holds
    # the full fp32 gradient for the whole accumulation: fewer collectives, N x the memory).
    grad_accumulation: str = "sharded"
    # AdamW kernel: fused (no shard-sized temporaries in the step) | foreach (torch's default).
    optimizer_impl: str = "fused"


@dataclass
class AlgorithmConfig:
    # Advantage estimator (registry): grpo, drgrpo, rloo, reinforce, reinforce_pp, reinforce_pp_baseline, remax, gae
    adv_estimator: str = "grpo"
    # GRPO: divide by the group's std (False = Dr.GRPO).
    norm_adv_by_std: bool = True
    # Policy loss (registry): ppo_clip, gspo, reinforce
    policy_loss: str = "ppo_clip"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    # Dual-clip bound c for negative advantages (Ye et al. 2020); null disables.
    clip_ratio_c: float | None = 3.0
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    # KL to the reference policy as a loss term (GRPO style).
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    # KL to the reference folded into the token reward (RLHF-PPO style).
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_coef: float = 0.001
    # fixed | adaptive (Ziegler et al. 2019)
    kl_ctrl: str = "fixed"
    kl_target: float = 0.1
    kl_horizon: int = 10000
    gamma: float = 1.0
    lam: float = 1.0
    # DAPO dynamic sampling: drop groups whose rewards are all equal and draw more prompts until
    # data.train_batch_size x rollout.n samples are kept, for at most max_gen_rounds batches.
    filter_groups: bool = False
    max_gen_rounds: int = 3
    # DAPO overlong reward shaping: responses within `overlong_buffer` tokens of
    # rollout.max_response_length lose up to `overlong_penalty_factor` linearly (0 = off);
    # mask_truncated drops responses cut at the length limit from the loss.
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0
    mask_truncated: bool = False
    # ReMax: also generate the greedy answer per prompt; its reward is the baseline.
    greedy_baseline: bool = False
    # GFPO: keep the best `gfpo_keep` of each group by `gfpo_metric` (length | reward_per_token).
    gfpo_keep: int = 4
    gfpo_metric: str = "length"
    # Truncated importance sampling between rollout-engine and trainer log-probs: none | token | sequence.
    tis_mode: str = "none"
    tis_cap: float = 2.0


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


@dataclass
class PreferenceConfig:
    # DPO temperature beta.
    beta: float = 0.1
    # Reward-model loss: pairwise (Bradley-Terry) | margin (hinge) | listwise (softmax CE over ranks).
    rm_loss: str = "pairwise"
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
    # Stop the run if every sample of this many consecutive steps failed to score.
    max_failed_steps: int = 3


@dataclass
class TrainerConfig:
    # rl | sft | dpo | rm
    task: str = "rl"
    run_name: str = "default"
    output_dir: str = "outputs/${trainer.run_name}"
    # Ranks on this node; >1 relaunches under torchrun. Under torchrun the launcher's value wins.
    nproc_per_node: int = 1
    # auto | cpu | cuda
    device: str = "auto"
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
    # auto (latest in output_dir) | none | a checkpoint directory
    resume: str = "auto"
    # Export the final policy as an HF folder (output_dir/hf).
    export_hf: bool = True
    # Rollouts may be at most this many weight versions old (0 = strictly on-policy).
    max_staleness: int = 0
    # Abort after this many consecutive updates with a non-finite loss or gradient norm (each is skipped).
    max_bad_steps: int = 3
    # Seconds a collective may wait before the run fails with an error instead of hanging.
    collective_timeout_s: int = 600
    # SFT only: epochs over the training split (the step budget wins if reached first).
    sft_epochs: float = 1.0


@dataclass
class LoggerConfig:
    # Any of: console, tensorboard, jsonl, wandb, mlflow (wandb/mlflow only when installed).
    backends: list[str] = field(default_factory=lambda: ["console", "tensorboard", "jsonl"])
    project: str = "hybrid_rl"
    progress_bar: bool = True


@dataclass
class Config:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    rollout: RolloutConfig = MISSING
    actor: ActorConfig = MISSING
    algorithm: AlgorithmConfig = MISSING
    critic: CriticConfig = MISSING
    preference: PreferenceConfig = MISSING
    reward: RewardConfig = MISSING
    trainer: TrainerConfig = MISSING
    logger: LoggerConfig = MISSING


def register_configs() -> None:
    """Register the root schema and one schema per group (``<group>/schema``)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in {
        "model": ModelConfig,
        "data": DataConfig,
        "rollout": RolloutConfig,
        "actor": ActorConfig,
        "algorithm": AlgorithmConfig,
        "critic": CriticConfig,
        "preference": PreferenceConfig,
        "reward": RewardConfig,
        "trainer": TrainerConfig,
        "logger": LoggerConfig,
    }.items():
        cs.store(group=group, name="schema", node=node)


def resolve_precision(cfg: Config, device_type: str) -> str:
    """Replace ``auto`` in ``actor.param_dtype`` and ``rollout.dtype`` with what this hardware
    computes natively (:func:`hybrid_rl.env.auto_dtype`), in place, so the run's logged config says
    what ran; returns a one-line summary. Explicit values are kept."""
    from hybrid_rl.env import auto_dtype, cpu_bf16_support

    native = auto_dtype(device_type)
    if cfg.actor.param_dtype == "auto":
        cfg.actor.param_dtype = None if native == "float32" else native
    if cfg.rollout.dtype == "auto":
        cfg.rollout.dtype = native
    why = "CUDA" if device_type == "cuda" else f"CPU {cpu_bf16_support() or 'with no bf16 matrix unit'}"
    return f"precision: train compute {cfg.actor.param_dtype or 'float32'}, rollout {cfg.rollout.dtype} ({why}); masters fp32"


# The cross-field checks live in config_checks.py; they and the error they raise are part of
# this module's interface (``from hybrid_rl.config import ConfigError, validate``).
__all__ = [
    "LOSS_AGG_MODES", "ActorConfig", "AgentConfig", "AlgorithmConfig", "Config", "ConfigError", "CriticConfig", "DataConfig",
    "LoggerConfig", "ModelConfig", "PreferenceConfig", "RewardConfig", "RewardFnConfig", "RewardModelConfig", "RolloutConfig",
    "SynthMathConfig", "TrainerConfig", "register_configs", "resolve_precision", "validate",
]  # fmt: skip
