"""The RL trainer: one step is rollout -> reward -> log-probs -> advantages -> update -> switch.

The trainer is algorithm-blind: the advantage estimator and the policy loss come from the
registries by name, and the loss is handed to the engine. Each phase runs under a timer; the
mode switch reports its own phases. Data-parallel: every rank generates for its share of the
prompts with its own engine and trains on its own samples; advantages are computed on the
gathered global batch so batch-level statistics (REINFORCE++ whitening) are global.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from hybrid_rl.algorithms.advantages import AdvantageInputs
from hybrid_rl.algorithms.kl import kl_estimate, kl_in_reward, make_kl_controller
from hybrid_rl.algorithms.losses import agg_weights, make_actor_loss, make_critic_loss, masked_mean
from hybrid_rl.algorithms.registry import ADV_ESTIMATORS
from hybrid_rl.batch import Rollout, TrainBatch, collate
from hybrid_rl.config import validate
from hybrid_rl.dist import (
    DistContext,
    all_reduce_max,
    all_reduce_max_list,
    all_reduce_sum,
    barrier,
    gather_rows,
    mean_over_ranks,
)
from hybrid_rl.engine.flops import DecoderFlops
from hybrid_rl.engine.heads import Sampling
from hybrid_rl.errors import NumericalError
from hybrid_rl.faults import fault_active, maybe_fail
from hybrid_rl.hybrid.switch import SwitchReport
from hybrid_rl.timing import PhaseTimer, process_stats
from hybrid_rl.trainer import checkpoint as ckpt
from hybrid_rl.trainer.build import RLParts
from hybrid_rl.trainer.collect import RolloutCollector
from hybrid_rl.trainer.logger import MetricsLogger
from hybrid_rl.trainer.validation import evaluate, paired_gain

log = logging.getLogger("hybrid_rl")


def model_flops(engine: Any) -> DecoderFlops | None:
    """The FLOP counter for the engine's HF causal LM (None where it has none, e.g. a fake)."""
    config = getattr(getattr(getattr(engine, "module", None), "lm", None), "config", None)
    return DecoderFlops.from_hf_config(config) if config is not None else None


class RLTrainer:
    """The RL loop over assembled parts (:func:`hybrid_rl.trainer.build.build_rl_parts`)."""

    def __init__(self, cfg: Any, ctx: DistContext, parts: RLParts) -> None:
        validate(cfg, ctx.world_size)
        self.cfg, self.ctx, self.parts = cfg, ctx, parts
        self.out_dir = Path(cfg.trainer.output_dir)
        # Composition: the trainer reads its parts by name.
        self.tokenizer, self.actor, self.ref, self.critic = parts.tokenizer, parts.actor, parts.ref, parts.critic
        self.switch, self.reward_pool, self.val_pool = parts.switch, parts.reward_pool, parts.val_pool
        self.val_records = parts.val_records
        self.collector = RolloutCollector(
            cfg, ctx, parts.rollout_engine, parts.switch, parts.tokenizer, parts.tools, parts.train_records, parts.sampler,
            parts.reward_pool, parts.reward_models,
        )  # fmt: skip
        a = cfg.algorithm
        self.critic_loss_fn = make_critic_loss(cfg.critic) if parts.critic is not None else None
        self.kl_ctrl = make_kl_controller(a.kl_ctrl, a.kl_coef, a.kl_target, a.kl_horizon)
        self.loss_fn = make_actor_loss(a)
        self.adv_fn = ADV_ESTIMATORS[a.adv_estimator]
        self.flops = model_flops(parts.actor)
        self.step_idx = 0
        self.stop_requested = False
        self.last_save = time.monotonic()
        self.saved_step: int | None = None  # the step the newest checkpoint holds
        self.val_start_hits: torch.Tensor | None = None  # the run's first validation, per problem
        self.logger = MetricsLogger(
            cfg.logger, self.out_dir, OmegaConf.to_container(cfg, resolve=True), cfg.trainer.total_steps, ctx.is_main
        )
        ckpt.record_scheduler_job(self.out_dir, ctx.is_main)
        self._maybe_resume()

    # ================================================================ the loop
    def fit(self) -> dict[str, float]:
        cfg = self.cfg.trainer
        last: dict[str, float] = {}
        self._install_signal_handler()
        if cfg.val_before_train and self.step_idx == 0:
            self.logger.log(0, self.validate())
        while self.step_idx < cfg.total_steps and not self._stop_agreed():
            metrics = self.step()
            if cfg.val_every and (self.step_idx % cfg.val_every == 0 or self.step_idx == cfg.total_steps):
                metrics.update(self.validate())
            self.logger.log(self.step_idx, metrics)
            last = metrics
            if self._checkpoint_due() and self.step_idx < cfg.total_steps:
                self.save()
        self.save()
        if cfg.export_hf and not self.stop_requested:
            self.actor.export_hf(str(self.out_dir / "hf"), self.tokenizer)
        self.logger.close()
        return last

    def step(self) -> dict[str, float]:
        """One RL step; reads as the phases it runs."""
        timer = PhaseTimer("timing", self.ctx.device)
        m: dict[str, float] = {}
        with timer.phase("step"):
            rollout = self.collector.collect(self.step_idx, timer, m)
            with timer.phase("switch_to_train"):
                m.update(self.switch_metrics(self.switch.to_train()))
            m.update(self.train_on_batch(rollout, timer))
            self.check_numerics()
            maybe_fail("switch", self.step_idx + 1, self.ctx.rank)
            with timer.phase("switch_to_rollout"):
                skip = fault_active("skip_sync", self.step_idx + 1)
                m.update(self.switch_metrics(self.switch.to_rollout(skip_sync=skip)))
        self.step_idx += 1
        m.update(rollout.stats)
        m.update(timer.metrics())
        m["weights_version"] = float(self.switch.weights_version)
        m.update(process_stats())
        return self.reduce_metrics(m)

    def train_on_batch(self, rollout: Rollout, timer: PhaseTimer | None = None) -> dict[str, float]:
        """Log-probs, advantages and the policy (and critic) update on one scored rollout, with
        the engines in training mode; bumps the trainer's weights version."""
        timer = timer or PhaseTimer("timing", self.ctx.device)
        if not rollout.samples:  # dynamic sampling kept nothing: every group's answers scored the same
            return {"dapo/skipped_updates": 1.0}
        m: dict[str, float] = {}
        batch = self.make_batch(rollout)
        with timer.phase("logprobs"):
            m.update(self.compute_logprobs(batch))
        with timer.phase("advantage"):
            m.update(self.compute_advantages(batch))
        with timer.phase("update"):
            maybe_fail("update", self.step_idx + 1, self.ctx.rank)
            m.update(self.update_policy(batch))
            self.switch.policy_updated()
        m.update(self.throughput(rollout, batch, timer))
        return m

    # ================================================================ phases
    @property
    def sampling(self) -> Sampling:
        r = self.cfg.rollout
        return Sampling(r.temperature, r.top_k, r.top_p)

    def make_batch(self, rollout: Rollout) -> TrainBatch:
        """Collate; with ``algorithm.mask_truncated`` remember which rows were cut at the length
        limit. They are masked out of the *loss* only, after the advantages: their true scores
        still enter their group's mean and std (masking first turned a truncated -1 into a 0)."""
        batch = collate(rollout.samples, self.tokenizer.pad_token_id, rollout.weights_version)
        if self.cfg.algorithm.mask_truncated:  # DAPO overlong filtering: cut-off answers teach nothing
            batch.truncated = torch.tensor([s.finish_reason == "length" for s in rollout.samples])
        return batch

    @property
    def exactly_on_policy(self) -> bool:
        """One optimizer step on fresh samples: old log-probs equal the update's own (detached)."""
        act, a = self.cfg.actor, self.cfg.algorithm
        return (
            act.recompute_old_logprobs == "auto"
            and act.epochs == 1
            and act.mini_batch_size == 0
            and a.tis_mode == "none"
            and not a.use_kl_in_reward
        )

    def compute_logprobs(self, batch: TrainBatch) -> dict[str, float]:
        """Old log-probs from the actor (unless exactly on-policy), reference log-probs and
        critic values, under the distribution the engine sampled from (temperature, top-k, top-p).
        The reference keeps the full softmax at the temperature: truncating it to its own
        nucleus would give -inf on tokens the policy may still sample."""
        if self.critic is not None:
            batch.values = self.critic.forward_outputs(batch).values
        if self.ref is not None:
            batch.ref_logprobs = self.ref.forward_logprobs(batch, self.cfg.rollout.temperature)
        if self.exactly_on_policy:
            return {}  # the loss uses logprobs.detach() and reports the rollout mismatch itself
        out = self.actor.forward_outputs(batch, self.sampling)
        batch.old_logprobs = out.logprobs
        m = {"actor/entropy_old": float(masked_mean(out.entropy, batch.response_mask))}
        if self.ref is not None:
            kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, "k3")
            m["actor/ref_kl_k3"] = float(masked_mean(kl, batch.response_mask))
        diff = (batch.old_logprobs - batch.rollout_logprobs).abs() * batch.response_mask
        m["rollout/logprob_diff_mean"] = float(diff.sum() / batch.response_mask.sum().clamp(min=1))
        m["rollout/logprob_diff_max"] = float(diff.max()) if diff.numel() else 0.0
        return m

    def compute_advantages(self, batch: TrainBatch) -> dict[str, float]:
        """Token rewards (KL folded in if configured), then the registered estimator on the global batch."""
        a = self.cfg.algorithm
        kl = None
        if a.use_kl_in_reward:
            kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, a.kl_penalty)
        batch.token_rewards = kl_in_reward(batch.scores, batch.response_mask, kl, self.kl_ctrl.value)
        fields = {"token_rewards": batch.token_rewards, "response_mask": batch.response_mask, "group_ids": batch.group_ids}
        if batch.values is not None:
            fields["values"] = batch.values
        if a.greedy_baseline:
            fields["baseline_scores"] = batch.baseline_scores
        glob, mine = gather_rows(fields)
        inputs = AdvantageInputs(
            glob["token_rewards"], glob["response_mask"], glob["group_ids"], glob.get("values"), glob.get("baseline_scores")
        )
        adv, returns = self.adv_fn(inputs, a)
        width = batch.response_mask.shape[1]
        batch.advantages = adv[mine, :width].contiguous()
        batch.returns = returns[mine, :width].contiguous()
        if batch.truncated is not None:
            batch.response_mask[batch.truncated] = 0.0  # out of the loss, not out of the statistics
        m = {
            "advantage/mean": float(masked_mean(batch.advantages, batch.response_mask)),
            "advantage/abs_mean": float(masked_mean(batch.advantages.abs(), batch.response_mask)),
        }
        if kl is not None:
            # The global token-weighted KL: every rank updates its controller from the same
            # number, so all ranks fold the same coefficient into their rows.
            kl_sum, n_tok = all_reduce_sum([float((kl * batch.response_mask).sum()), float(batch.response_mask.sum())])
            current = kl_sum / max(n_tok, 1.0)
            m["reward/kl"], m["reward/kl_coef"] = current, self.kl_ctrl.value
            self.kl_ctrl.update(current, batch.size * self.ctx.world_size)
        return m

    def update_policy(self, batch: TrainBatch) -> dict[str, float]:
        """Mini-batch epochs over this rank's samples; one optimizer step per mini-batch."""
        self.switch.check_version(batch.weights_version, self.cfg.trainer.max_staleness)
        act, a = self.cfg.actor, self.cfg.algorithm
        total = batch.size * self.ctx.world_size
        mini = (act.mini_batch_size or total) // self.ctx.world_size
        gen = torch.Generator().manual_seed(self.cfg.trainer.seed + self.step_idx)
        sums: dict[str, float] = {}
        n = 0
        for _ in range(act.epochs):
            order = torch.randperm(batch.size, generator=gen) if act.epochs > 1 or mini < batch.size else torch.arange(batch.size)
            for mb in batch.select(order).split(mini):
                n_tok, n_seq = all_reduce_sum([float(mb.response_mask.sum()), float((mb.response_mask.sum(-1) > 0).sum())])
                mb.loss_weights = agg_weights(mb.response_mask, a.loss_agg_mode, n_tok, n_seq, self.collector.response_budget)
                metrics = {}
                if self.critic is not None:
                    weights = agg_weights(
                        mb.response_mask, self.cfg.critic.loss_agg_mode, n_tok, n_seq, self.collector.response_budget
                    )
                    critic_mb = dataclasses.replace(mb, loss_weights=weights)
                    metrics.update(self.critic.train_batch(critic_mb, self.critic_loss_fn))
                    metrics = {k.replace("actor/", "critic/"): v for k, v in metrics.items()}
                if self.critic is None or self.step_idx >= self.cfg.critic.warmup_steps:
                    metrics.update(self.actor.train_batch(mb, self.loss_fn, self.sampling))
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                n += 1
        out = {k: v / n for k, v in sums.items()}
        out["actor/optimizer_steps"] = float(n)
        return out

    # ================================================================ metrics
    @staticmethod
    def switch_metrics(report: SwitchReport) -> dict[str, float]:
        m = {f"switch/{report.direction}/{k}_s": v for k, v in report.seconds.items()}
        m[f"switch/{report.direction}_s"] = report.total_seconds
        last = list(report.memory.values())[-1] if report.memory else {}
        for k, v in last.items():
            m[f"memory/after_{report.direction}/{k}"] = v
        m[f"switch/{report.direction}/freed"] = float(report.freed)
        for k, v in report.moved_bytes.items():
            m[f"switch/{report.direction}/moved_mib/{k}"] = v / 2**20
        return m

    def throughput(self, rollout: Rollout, batch: TrainBatch, timer: PhaseTimer) -> dict[str, float]:
        # Model-written tokens (tool output excluded); clip_ratio: responses cut at the budget.
        lengths = torch.tensor([sum(s.response_mask) for s in rollout.samples], dtype=torch.float32)
        epochs = self.cfg.actor.epochs
        local = [float(lengths.sum()), float(batch.attention_mask.sum()) * epochs, *self.flop_counts(rollout)]
        gen_tokens, train_tokens, update_flops, gen_flops = all_reduce_sum(local)  # one collective for all four

        def per_s(amount: float, phase: str) -> float:
            return amount / max(timer.seconds.get(phase, 1e-9), 1e-9)

        m = {
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/clip_ratio": sum(s.finish_reason == "length" for s in rollout.samples) / len(rollout.samples),
            "rollout/tokens_per_s": per_s(gen_tokens, "generate"),
            "train/tokens_per_s": per_s(train_tokens, "update"),
        }
        if self.flops is not None:
            m["perf/update_tflops_per_s"] = per_s(update_flops, "update") / 1e12
            m["perf/generate_tflops_per_s"] = per_s(gen_flops, "generate") / 1e12
        return m

    def flop_counts(self, rollout: Rollout) -> list[float]:
        """This rank's model FLOPs of the policy update (forward + backward, all epochs; with the
        shared-prefix forward each group's prompt counts once, as it is computed once) and of
        generation (:mod:`hybrid_rl.engine.flops`); over the phases' times they are the achieved
        FLOP/s, whose ratio to the hardware's peak is MFU (benchmarks/precision.py measures both)."""
        if self.flops is None:
            return [0.0, 0.0]
        s = rollout.samples
        prompt = [len(x.prompt_ids) for x in s]
        response = [len(x.response_ids) for x in s]
        groups = [x.group for x in s]
        shared = getattr(self.actor.module, "shared_prefix", False)
        train = self.flops.train_shared_prefix(prompt, response, groups) if shared else self.flops.train([x.text_len for x in s])
        return [train * self.cfg.actor.epochs, self.flops.generate(prompt, response, groups)]

    def reduce_metrics(self, m: dict[str, float]) -> dict[str, float]:
        """Mean over ranks, except token counts (summed), throughput (already global) and memory
        peaks (the largest rank's: the one that meets the limit first)."""
        summed = {k for k in m if k.endswith("_tokens") or k in ("reward/failed", "reward/timeouts")}
        globals_ = {k for k in m if k.endswith(("tokens_per_s", "tflops_per_s")) or k.startswith("dapo/")}
        peaks = sorted(k for k in m if "peak_" in k and k not in summed and k not in globals_)
        sums = dict(zip(sorted(summed), all_reduce_sum([m[k] for k in sorted(summed)]), strict=True))
        maxes = dict(zip(peaks, all_reduce_max_list([m[k] for k in peaks]), strict=True))
        means = mean_over_ranks({k: v for k, v in m.items() if k not in summed and k not in globals_ and k not in maxes})
        return {**means, **sums, **maxes, **{k: m[k] for k in globals_}}

    # ================================================================ validation
    def validate(self) -> dict[str, float]:
        """Held-out metrics; from the second validation on also ``val/gain`` and ``val/gain_se``,
        the greedy accuracy gain since the run's first validation (step 0 with
        ``trainer.val_before_train``) and its paired standard error (same problems both times)."""
        r = self.cfg.rollout
        start = time.perf_counter()
        out, hits = evaluate(
            self.collector.val_sampler(),
            self.val_records,
            self.val_pool,
            self.ctx,
            r.max_response_length,
            r.val_pass_k,
            r.temperature,
            self.cfg.trainer.seed,
            "math",
            shard=(self.collector.dp_rank, self.collector.dp_size),
            count=self.ctx.rank % self.collector.tp == 0,
        )
        if self.val_start_hits is None or self.val_start_hits.shape != hits.shape:
            self.val_start_hits = hits
        else:
            out["val/gain"], out["val/gain_se"] = paired_gain(self.val_start_hits, hits)
        out["timing/validate"] = time.perf_counter() - start
        return out

    # ================================================================ checkpoints
    def app_states(self) -> dict[str, ckpt.AppState]:
        states = {"app": ckpt.AppState(self.actor)}
        if self.critic is not None:
            states["critic"] = ckpt.AppState(self.critic)
        return states

    def save(self) -> None:
        """Checkpoint the current step, unless it is already on disk (a stop right after a
        scheduled save, or a resume at ``total_steps``): saving it twice would only open a window
        in which the one good copy is being replaced."""
        if self.saved_step == self.step_idx:
            return
        if not self.actor.params_finite():
            raise NumericalError(f"step {self.step_idx}: the policy has non-finite parameters; refusing to write a checkpoint")
        maybe_fail("save", self.step_idx, self.ctx.rank)
        path = ckpt.save_checkpoint(
            self.out_dir / "checkpoints",
            self.step_idx,
            self.app_states(),
            ckpt.rl_run_state(self.step_idx, self.parts, self.kl_ctrl.value, self.val_start_hits),
            self.cfg.trainer.keep_last,
            self.ctx.rank,
            self.ctx.world_size,
        )
        self.last_save = time.monotonic()
        self.saved_step = self.step_idx
        if self.ctx.is_main:
            log.info("saved checkpoint %s", path)

    def _maybe_resume(self) -> None:
        mode = self.cfg.trainer.resume
        if mode == "none":
            return
        path = ckpt.latest_checkpoint(self.out_dir / "checkpoints") if mode == "auto" else Path(mode)
        if path is None:
            return
        state = ckpt.load_checkpoint(path, self.app_states(), self.ctx.rank)
        self.step_idx = self.saved_step = int(state["step"])
        self.kl_ctrl.value = float(state["kl_coef"])
        ckpt.restore_rl_run_state(state, self.parts)
        self.val_start_hits = state.get("val_start_hits")  # absent in checkpoints of older versions
        self.switch.to_rollout()  # the engine was built from the initial weights: push the resumed ones
        dropped = self.logger.truncate_after(self.step_idx)
        barrier()
        if self.ctx.is_main:
            log.info("resumed from %s at step %d (%d metrics rows of later steps dropped)", path, self.step_idx, dropped)

    def check_numerics(self) -> None:
        """Abort after ``trainer.max_bad_steps`` consecutive non-finite updates (each was skipped)."""
        bad = self.actor.consecutive_bad_steps
        if bad >= self.cfg.trainer.max_bad_steps:
            raise NumericalError(
                f"{bad} consecutive updates had a non-finite loss or gradient norm (trainer.max_bad_steps="
                f"{self.cfg.trainer.max_bad_steps}); each was skipped, the weights are unchanged since step "
                f"{self.step_idx + 1 - bad}. Lower actor.lr, check the reward scale, or use a smaller clip."
            )

    def _checkpoint_due(self) -> bool:
        """Every ``trainer.save_every`` steps, or once ``trainer.save_every_minutes`` of wall time
        passed since the last checkpoint (rank 0's clock decides for all: one collective)."""
        cfg = self.cfg.trainer
        by_steps = bool(cfg.save_every) and self.step_idx % cfg.save_every == 0
        by_time = cfg.save_every_minutes > 0 and time.monotonic() - self.last_save >= 60 * cfg.save_every_minutes
        return all_reduce_max(float(by_steps or (by_time and self.ctx.is_main))) > 0

    def _stop_agreed(self) -> bool:
        """A signal may reach one rank only; all ranks stop together."""
        self.stop_requested = all_reduce_max(float(self.stop_requested)) > 0
        return self.stop_requested

    def _install_signal_handler(self) -> None:
        """SIGINT (Ctrl-C), SIGTERM (kill, scancel) and SIGUSR1 (Slurm's warning before a time
        limit): checkpoint after the current step, then exit 0. Idempotent: a signal that
        reaches a rank twice (from the launcher and from Slurm) still means "stop after this
        step"; stopping at once is the launcher's job (a second signal to it)."""

        def handler(signum: int, frame: Any) -> None:
            if not self.stop_requested:
                log.warning("signal %d: saving a checkpoint after the current step, then exiting", signum)
            self.stop_requested = True

        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

    def close(self) -> None:
        self.reward_pool.close()
        if self.val_pool is not self.reward_pool:
            self.val_pool.close()
        barrier()
        self.parts.rollout_engine.shutdown()
