"""Schemas of the groups a rollout and its model are built from: model, data, rollout (with the
agent), actor. Every field is typed and its comment is its documentation; fields with a closed
set of values are enums (:mod:`hybrid_rl.config.enums`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybrid_rl.config.enums import (
    DType,
    GradAccumulation,
    LRSchedule,
    OptimizerImpl,
    PrefixAttention,
    RecomputeOld,
    ReduceDType,
    SyncTransport,
    ToolParser,
    Truncation,
)
from hybrid_rl.rollout.settings import AgentSettings


@dataclass
class ModelConfig:
    # A local HF folder, or a model the project builds itself:
    #   builtin:tiny      randomly initialised tiny Qwen2 (hybrid_rl.models.tiny, preset below)
    #   builtin:tiny-sft  the tiny model after the sft_math warm start (built once, then cached)
    path: str = "builtin:tiny-sft"
    # The recipe that builds builtin:tiny-sft (conf/recipe/<name>.yaml).
    sft_recipe: str = "sft_math"
    # Preset for builtin models (hybrid_rl/models/tiny.py): micro | tiny | tiny-long (tiny with 2,048
    # positions, for long answers) | small | base | large | qwen0.5b | qwen1.5b.
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
    # Problems in the generated train split and in the held-out validation split (problems with
    # at least one arithmetic fact that no training problem states; data source synth_math_heldout).
    n_train: int = 20000
    n_val: int = 1024
    # Problems in the in-distribution validation split: new questions over training facts
    # (data source synth_math_seen); 0 = none.
    n_val_seen: int = 256
    # Share of arithmetic facts ("7 + 8 = 15") held out of every training split (0 < share < 1).
    heldout_fraction: float = 0.2
    # Difficulty levels (see hybrid_rl.data.synth_math).
    levels: list[int] = field(default_factory=lambda: [1, 6])
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
    truncation: Truncation = Truncation.skip
    # Prompts per RL step across all ranks (each yields rollout.n samples).
    train_batch_size: int = 32
    # Training rows kept from the start of each training file (0 = all; verl's train_max_samples):
    # a smoke run or a first look at a large dataset without reading all of it.
    train_size: int = 0
    # Validation prompts per evaluation from the start of each validation file (0 = all).
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
    # and their defaults come from rollout.settings.AgentSettings.
    enable: bool = False
    # YAML file listing the tools (class_name + config), like verl's tool config.
    tool_config: str = "conf/tools/python.yaml"
    # Tool-call format parser: hermes (Qwen's <tool_call>{json}</tool_call>).
    parser: ToolParser = ToolParser.hermes


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
    dtype: DType = DType.auto
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
    sync_transport: SyncTransport = SyncTransport.auto
    # Validation sampling: greedy pass@1 always; pass@k with this k at `temperature` (0 = off).
    val_pass_k: int = 0
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class LoraConfig:
    """Low-rank adapters on the policy (PEFT's ``LoraConfig`` fields, Hu et al. 2021,
    arXiv:2106.09685): each targeted linear layer computes ``W x + (alpha / rank) B A x``, with
    ``A [rank, in]`` and ``B [out, rank]`` trained (fp32, with their AdamW state) and ``W`` frozen.
    The reference policy is the same model with the adapters switched off; the rollout engine
    keeps the base weights from start-up and receives only ``A`` and ``B`` at each switch."""

    # 0 = full fine-tune. vLLM serves ranks up to 512 (the engine is sized to the next of
    # 1, 8, 16, 32, 64, 128, 256, 320, 512).
    rank: int = 0
    # The adapters' scale is alpha / rank (PEFT's lora_alpha).
    alpha: float = 32.0
    # Dropout on the adapters' input while training (PEFT's lora_dropout; off for log-probs).
    dropout: float = 0.0
    # Module names (the last part of the name) of the linear layers that get adapters.
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    # Hold the frozen base in the compute dtype (actor.param_dtype) instead of fp32 masters:
    # half the base's memory under bf16; the adapters and their optimizer state stay fp32.
    base_in_compute_dtype: bool = True


@dataclass
class ActorConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    # constant | cosine (decays to min_lr_ratio * lr over trainer.total_steps optimizer steps)
    lr_schedule: LRSchedule = LRSchedule.constant
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
    # Attention kernel of the shared-prefix forward on CPU: matmul (batched GEMMs with a backward
    # of its own, engine/segment_attention.py; ~1.3x faster updates where torch's masked CPU
    # flash-attention backward is slow) | sdpa (torch's scaled_dot_product_attention). CUDA, and
    # score tensors over 32M elements, always use sdpa.
    prefix_attention: PrefixAttention = PrefixAttention.matmul
    # Passes over each rollout batch (PPO epochs).
    epochs: int = 1
    # Old log-probs: "auto" skips the extra forward pass when the update is exactly on-policy
    # (1 epoch, 1 mini-batch, no TIS, no KL in the reward): the ratio is then 1 and
    # old = logprobs.detach() inside the loss gives the same gradient (as TRL with
    # num_iterations=1). "always" recomputes them before the update (verl's behaviour).
    recompute_old_logprobs: RecomputeOld = RecomputeOld.auto
    # Mixed precision (FSDP2 MixedPrecisionPolicy): the compute dtype of the forward/backward
    # (auto | null = fp32 | bfloat16 | float16) and of gradient reduction. Master weights and
    # AdamW state stay fp32. auto: bfloat16 where the hardware has native bf16 math (as rollout.dtype).
    param_dtype: DType | None = DType.auto
    reduce_dtype: ReduceDType = ReduceDType.float32
    # Token chunk for the log-prob head, bounding (T, V) memory for big vocabularies.
    logprob_chunk: int = 1024
    gradient_checkpointing: bool = False
    # Move optimizer state off the accelerator while rolling out (CUDA only; CPU has nowhere to go).
    offload_optimizer: bool = True
    # Gradient accumulation over micro-batches: "sharded" reduce-scatters after every micro-batch
    # (each rank keeps 1/N of the gradient) or "unsharded" once after the last (every rank holds
    # the full fp32 gradient for the whole accumulation: fewer collectives, N x the memory).
    grad_accumulation: GradAccumulation = GradAccumulation.sharded
    # AdamW kernel: fused (no shard-sized temporaries in the step) | foreach (torch's default) |
    # bf16_moments (both moments stored in bf16 with stochastic rounding: 4 bytes of optimizer
    # state per parameter instead of 8; engine/adamw_bf16.py).
    optimizer_impl: OptimizerImpl = OptimizerImpl.fused
    # FSDP2 in training: free each layer's gathered weights after its forward (true) or keep them
    # for its backward (false: one all-gather per layer and micro-batch instead of two, for the
    # full compute-dtype model held on every rank through the backward). On 2 CPU cores (gloo,
    # 101M) it halves the all-gather time but the update's wall time stays within run-to-run
    # noise: there the ranks wait on each other's compute, not on the wire (docs/benchmarks.md).
    reshard_after_forward: bool = True
    # LoRA on the policy (actor.lora.rank > 0): only low-rank adapters train; see actor.lora.
    lora: LoraConfig = field(default_factory=LoraConfig)
