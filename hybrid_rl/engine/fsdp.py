"""The training engine: an FSDP2 model that takes the loss as an argument.

``fully_shard`` is applied per decoder layer, then to the root, over the default process group
(gloo on CPU, NCCL on CUDA), any world size. The engine owns micro-batching, gradient
accumulation, clipping, the optimizer step and the LR schedule; the algorithm is a ``loss_fn``
it is handed (``train_batch(batch, loss_fn)``), so the engine is algorithm-blind.

Loss scaling contract: ``loss_fn`` returns the micro-batch's share of the *global* mini-batch
loss (its aggregation weights are normalised over all ranks and micro-batches). FSDP averages
gradients over ranks, so the engine multiplies by the world size before ``backward``; the sum
over micro-batches and ranks then equals the gradient of the global loss.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from hybrid_rl.batch import LossFn, ModelOutputs, TrainBatch
from hybrid_rl.dist import DistContext, all_reduce_max, all_reduce_sum
from hybrid_rl.engine.heads import Sampling
from hybrid_rl.engine.optim import OptimConfig, build_optimizer, lr_lambda
from hybrid_rl.engine.sharded_init import has_meta_params, materialize

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# Master weights and optimizer state of every trained engine.
MASTER_DTYPE = torch.float32


def to_dtype(name: str | None, device: torch.device | str | None = None) -> torch.dtype | None:
    """A config dtype name -> torch dtype; None stays None (fp32, no cast). ``auto`` is bf16
    where the hardware has native bf16 math (:func:`hybrid_rl.env.auto_dtype`), for ``device``
    (default: CPU)."""
    if name is None:
        return None
    if name == "auto":
        from hybrid_rl.env import auto_dtype

        name = auto_dtype(torch.device(device).type if device is not None else "cpu")
        if name == "float32":
            return None  # fp32 masters: nothing to cast
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    return DTYPES[name]


def micro_batches(batch: TrainBatch, micro_size: int, max_tokens: int = 0) -> list[TrainBatch]:
    """Split rows into micro-batches: fixed size, or balanced by a token budget.

    With a token budget every rank must run the same number of forwards (each is a collective),
    so the count is the max over ranks of what the budget needs, and rows are dealt longest-first
    onto the lightest micro-batch (greedy balanced partition, as verl's dynamic batching).
    """
    if max_tokens <= 0:
        return [mb.trimmed() for mb in batch.split(micro_size)]
    lengths = batch.attention_mask.sum(1).tolist()
    need = max(1, math.ceil(sum(lengths) / max_tokens))
    k = int(min(all_reduce_max(need), batch.size))
    order = sorted(range(batch.size), key=lambda i: -lengths[i])
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in order:
        j = min(range(k), key=lambda b: loads[b])
        bins[j].append(i)
        loads[j] += lengths[i]
    return [batch.select(sorted(b)).trimmed() for b in bins]


class FSDPEngine:
    """An FSDP2-sharded module with its optimizer; see the module docstring for the contract."""

    def __init__(
        self,
        module: nn.Module,
        ctx: DistContext,
        optim: OptimConfig | None,
        micro_batch_size: int = 16,
        max_tokens_per_micro: int = 0,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = torch.float32,
        name_prefix: str = "lm.",
        load_shards: Callable[[nn.Module], dict[str, int]] | None = None,
        grad_accumulation: str = "sharded",
        reshard_after_forward: bool = True,
    ) -> None:
        if grad_accumulation not in ("sharded", "unsharded"):
            raise ValueError(f"actor.grad_accumulation must be 'sharded' or 'unsharded', got {grad_accumulation!r}")
        self.ctx = ctx
        self.grad_accumulation, self.reshard_after_forward = grad_accumulation, reshard_after_forward
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_micro = max_tokens_per_micro
        self.name_prefix = name_prefix
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        meta = has_meta_params(module)
        if not meta:
            module.to(ctx.device)  # the old path: every rank holds the full model until it is sharded
        for layer in module.decoder_layers():
            fully_shard(layer, mp_policy=mp)
        fully_shard(module, mp_policy=mp)
        self.load_stats: dict[str, int] = {}
        if meta:
            # Sharded init (engine/sharded_init.py): allocate this rank's shards, read their rows.
            if load_shards is None:
                raise ValueError("a module with meta parameters needs load_shards to fill them")
            materialize(module, ctx.device)
            self.load_stats = load_shards(module)
        self.module = module
        self.optim_cfg = optim
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        if optim is not None:
            self.optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], optim)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(optim))
        else:
            module.requires_grad_(False)
        self._transport: str | None = None  # weight-sync transport, decided once (auto_transport)
        self._sync_state: dict = {}  # the shared-memory ring, kept between pushes
        self.step_count = 0
        self.skipped_steps = 0
        self.consecutive_bad_steps = 0

    # ---------------------------------------------------------------- forward
    def _forward(self, mb: TrainBatch, temperature: Sampling | float) -> ModelOutputs:
        mb = mb.to(self.ctx.device)
        return self.module(mb.input_ids, mb.attention_mask, mb.position_ids, mb.prompt_len, temperature)

    @torch.no_grad()
    def forward_outputs(self, batch: TrainBatch, temperature: Sampling | float = 1.0) -> ModelOutputs:
        """Outputs for every row, ``[B, R]`` at the batch's full width, in micro-batches."""
        self.module.eval()
        r_full = batch.input_ids.shape[1] - batch.prompt_len
        fields: dict[str, list[Tensor]] = {}
        for mb in batch.split(self.micro_batch_size):
            trimmed = mb.trimmed()
            out = self._forward(trimmed, temperature)
            real = trimmed.attention_mask[:, trimmed.prompt_len :].float()  # 0 on padding: values there are meaningless
            for name, value in out._asdict().items():
                if value is None:
                    continue
                v = value.float().cpu()
                if v.dim() == 2:  # where, not v * real: a padding log-prob may be -inf, and -inf * 0 is NaN
                    v = torch.nn.functional.pad(torch.where(real > 0, v, 0.0), (0, r_full - v.shape[1]))
                fields.setdefault(name, []).append(v)
        return ModelOutputs(**{k: torch.cat(v) for k, v in fields.items()})

    def forward_logprobs(self, batch: TrainBatch, temperature: Sampling | float = 1.0) -> Tensor:
        """``[B, R]`` log-probs of the response tokens (old/reference log-probs), no grad."""
        return self.forward_outputs(batch, temperature).logprobs

    # ---------------------------------------------------------------- train
    def train_batch(
        self, batch: TrainBatch, loss_fn: LossFn, temperature: Sampling | float = 1.0, metric_weight: str = "tokens"
    ) -> dict[str, float]:
        """One optimizer step over ``batch`` (this rank's rows of one mini-batch).

        The loss function's metrics are per micro-batch means; they are combined over micro-batches
        and ranks weighted by each micro-batch's response tokens (``metric_weight="tokens"``) or
        rows (``"rows"``: per-pair metrics of DPO / reward models), so a metric is the mean over
        the whole mini-batch whatever the split. ``actor/loss`` is the global loss (the sum of
        the micro-batches' shares on all ranks).
        """
        assert self.optimizer is not None, "engine was built without an optimizer"
        self.module.train()
        mbs = micro_batches(batch, self.micro_batch_size, self.max_tokens_per_micro)
        keep = not self.reshard_after_forward  # kept for the backward, which reshards each layer
        if keep:
            self.module.set_reshard_after_forward(False)
        sums: dict[str, float] = {}
        total_loss, total_weight = 0.0, 0.0
        for i, mb in enumerate(mbs):
            # sharded: reduce-scatter after every micro-batch, so only this rank's gradient shard
            # accumulates (1/N of the gradient bytes; one collective per micro-batch).
            # unsharded: skip the reduce-scatter until the last micro-batch; every rank keeps the
            # full, unsharded gradient for the whole accumulation (fewer collectives, N x memory).
            self.module.set_requires_gradient_sync(self.grad_accumulation == "sharded" or i == len(mbs) - 1)
            with record_function("hybrid_rl/forward"):  # phase labels for torch.profiler traces
                out = self._forward(mb, temperature)
                loss, metrics = loss_fn(out, mb.to(self.ctx.device))
            with record_function("hybrid_rl/backward"):
                (loss * self.ctx.world_size).backward()
            total_loss += float(loss.detach())
            w = float(mb.response_mask.sum()) if metric_weight == "tokens" else float(mb.size)
            total_weight += w
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + w * float(v.detach() if isinstance(v, torch.Tensor) else v)
        if keep:  # no-grad passes (old log-probs, validation) have no backward to free what they gather
            self.module.set_reshard_after_forward(True)
        keys = sorted(sums)
        *values, total_weight, total_loss = all_reduce_sum([sums[k] for k in keys] + [total_weight, total_loss])
        metrics = {k: v / max(total_weight, 1e-12) for k, v in zip(keys, values, strict=True)}
        metrics["actor/loss"] = total_loss
        with record_function("hybrid_rl/optimizer"):
            metrics.update(self._optimizer_step(math.isfinite(total_loss)))
        metrics["actor/micro_batches"] = float(len(mbs))
        return metrics

    def _optimizer_step(self, loss_finite: bool = True) -> dict[str, float]:
        """Clip, then step unless the loss or the gradient norm is not finite (then skip and count)."""
        assert self.optimizer is not None and self.optim_cfg is not None
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.optim_cfg.grad_clip if self.optim_cfg.grad_clip > 0 else float("inf"))
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        out = {"actor/grad_norm": grad_norm, "actor/lr": self.optimizer.param_groups[0]["lr"]}
        if loss_finite and math.isfinite(grad_norm):
            self.optimizer.step()
            self.consecutive_bad_steps = 0
        else:
            self.skipped_steps += 1
            self.consecutive_bad_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step_count += 1
        out["actor/skipped_steps"] = float(self.skipped_steps)
        return out

    # ---------------------------------------------------------------- weights out
    def hf_name(self, name: str) -> str:
        for junk in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
            name = name.replace(junk, "")
        name = name.replace(".base_layer.", ".")  # a LoRA-adapted layer's frozen weight: the HF name
        return name[len(self.name_prefix) :] if name.startswith(self.name_prefix) else name

    def iter_full_params(
        self, bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None, transport: str = "auto", trainable_only: bool = False
    ) -> Iterator[tuple[str, Tensor]]:
        """Stream ``(hf_name, full_tensor)`` pairs out of the shards, a flat bucket at a time.

        Collective: every rank must consume the iterator fully, in the same order. Each shard is
        cast to ``dtype`` first (half the bytes on the wire for bf16); a bucket of about
        ``bucket_bytes`` goes in one all-gather (``collective``: gloo/NCCL, one bucket in flight
        ahead of the consumer) or through shared memory between the ranks of one host (``shm``);
        ``auto`` picks shm on CPU when every rank is on this host. ``trainable_only``: just the
        parameters that train (LoRA adapters). See :mod:`hybrid_rl.engine.gather`.
        """
        from hybrid_rl.engine.gather import iter_full_params

        if transport == "auto":
            transport = self.auto_transport()
        named = [(self.hf_name(n), p) for n, p in self.module.named_parameters() if p.requires_grad or not trainable_only]
        yield from iter_full_params(named, bucket_bytes, dtype, transport, self._sync_state)

    def auto_transport(self) -> str:
        """shm when training on CPU with every rank on this host, else the process group's collective."""
        if self._transport is None:
            self._transport = "collective"
            if self.ctx.device.type == "cpu" and self.ctx.world_size > 1 and os.path.isdir("/dev/shm"):
                from hybrid_rl.dist import all_gather_objects

                if len(set(all_gather_objects(socket.gethostname()))) == 1:
                    self._transport = "shm"
        return self._transport

    def param_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the full (unsharded) parameters, at ``dtype`` if given."""
        return sum(p.numel() * (dtype.itemsize if dtype is not None else p.element_size()) for p in self.module.parameters())

    # ---------------------------------------------------------------- memory modes
    def offload_optimizer(self) -> int:
        """Move optimizer state to host memory; returns bytes moved (0 on CPU: nowhere to go)."""
        return self._move_optimizer(torch.device("cpu"))

    def reload_optimizer(self) -> int:
        return self._move_optimizer(self.ctx.device)

    def offload_params(self) -> int:
        """Move this rank's parameter shards to host memory (a reference or critic while the
        engine generates); returns bytes moved (0 on CPU)."""
        return self._move_params(torch.device("cpu"))

    def reload_params(self) -> int:
        return self._move_params(self.ctx.device)

    def _move_params(self, device: torch.device) -> int:
        if self.ctx.device.type == "cpu":
            return 0
        moved = 0
        for p in self.module.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.device != device:
                moved += local.numel() * local.element_size()
        if moved:
            self.module.to(device)  # FSDP2 re-registers its sharded parameters after _apply
            if device.type == "cuda":
                torch.cuda.synchronize()
        return moved

    def _move_optimizer(self, device: torch.device) -> int:
        if self.optimizer is None or self.ctx.device.type == "cpu":
            return 0
        moved = 0
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor) and value.device != device:
                    state[key] = value.to(device, non_blocking=True)
                    moved += value.numel() * value.element_size()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return moved

    # ---------------------------------------------------------------- checkpoint / export
    def extra_state(self) -> dict:
        """Engine counters and the LR schedule (DCP holds the model and optimizer)."""
        return {
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
            "consecutive_bad_steps": self.consecutive_bad_steps,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def load_extra_state(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self.skipped_steps = int(state["skipped_steps"])
        self.consecutive_bad_steps = int(state["consecutive_bad_steps"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])

    def params_finite(self) -> bool:
        """Whether every parameter is finite on every rank (collective)."""
        from hybrid_rl.dist import all_reduce_max

        bad = 0.0
        for p in self.module.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if not torch.isfinite(local).all():
                bad = 1.0
                break
        return all_reduce_max(bad) == 0.0

    def _sd_options(self):
        """A trained engine with a frozen part (LoRA's base) checkpoints what trains: the frozen
        weights come from the model folder again on resume (so loading is not strict about them;
        :meth:`load_state_dicts` checks that nothing trainable is missing)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        frozen = self.optimizer is not None and any(not p.requires_grad for p in self.module.parameters())
        return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)

    def state_dicts(self) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self.module, self.optimizer if self.optimizer is not None else [], options=self._sd_options())

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        optimizers = self.optimizer if self.optimizer is not None else []
        keys = set_state_dict(self.module, optimizers, model_state_dict=model_sd, optim_state_dict=optim_sd, options=self._sd_options())
        trainable = {self.hf_name(n) for n, p in self.module.named_parameters() if p.requires_grad}
        lost = sorted(n for n in getattr(keys, "missing_keys", []) if self.hf_name(n) in trainable)
        if lost:
            raise KeyError(f"the checkpoint lacks trained parameters: {', '.join(lost[:5])}")

    def export_hf(self, out_dir: str, tokenizer=None) -> None:
        """Write the full model as an HF folder (rank 0 writes; collective)."""
        import os

        from safetensors.torch import save_file

        full = {name: t.cpu().contiguous() for name, t in self.iter_full_params(dtype=None)}
        if self.ctx.is_main:
            os.makedirs(out_dir, exist_ok=True)
            lm = self.module.hf_model()
            lm.config.save_pretrained(out_dir)
            if getattr(lm, "generation_config", None) is not None:
                lm.generation_config.save_pretrained(out_dir)
            if lm.config.tie_word_embeddings:
                full.pop("lm_head.weight", None)
            save_file(full, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir)
        if dist.is_initialized():
            dist.barrier()
