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
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from hybrid_rl.algorithms.advantages import AdvantageInputs
from hybrid_rl.algorithms.kl import kl_estimate, kl_in_reward, make_kl_controller
from hybrid_rl.algorithms.losses import agg_weights, make_actor_loss, make_critic_loss, masked_mean
from hybrid_rl.algorithms.registry import ADV_ESTIMATORS, bind_params
from hybrid_rl.batch import Rollout, TrainBatch, collate
from hybrid_rl.config import AlgorithmConfig, Config
from hybrid_rl.dist import DistContext, all_reduce_sum, barrier, gather_rows
from hybrid_rl.engine.heads import Sampling
from hybrid_rl.errors import NoUpdateError, NumericalError
from hybrid_rl.faults import fault_active, maybe_fail
from hybrid_rl.resume import model_identity
from hybrid_rl.timing import STEP_PREFIX, PhaseTimer, phase_key, process_stats
from hybrid_rl.trainer import checkpoint as ckpt
from hybrid_rl.trainer.build import RLParts
from hybrid_rl.trainer.collect import RolloutCollector
from hybrid_rl.trainer.generations import GenerationLog, rollout_rows
from hybrid_rl.trainer.logger import MetricsLogger
from hybrid_rl.trainer.no_update import NoUpdateWatch, no_update_reason
from hybrid_rl.trainer.profiling import profiled
from hybrid_rl.trainer.run_control import RunControl
from hybrid_rl.trainer.step_metrics import NotesOnce, Throughput, explained_variance, reduce_metrics, switch_metrics
from hybrid_rl.trainer.validation import evaluate, gains_by_source, paired_gain

log = logging.getLogger("hybrid_rl")


def kl_side(batch: TrainBatch) -> torch.Tensor:
    """The policy's side of a KL term: its log-probs without top-k/top-p (the reference's have none)."""
    return batch.old_kl_logprobs if batch.old_kl_logprobs is not None else batch.old_logprobs


def _masked_extremes(name: str, x: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``name/max`` and ``name/min`` of ``x`` over the tokens where ``mask`` is 1 (0 when there are none)."""
    real = x[mask > 0]
    return {f"{name}/max": float(real.max()) if real.numel() else 0.0, f"{name}/min": float(real.min()) if real.numel() else 0.0}


class RLTrainer:
    """The RL loop over assembled parts (:func:`hybrid_rl.trainer.build.build_rl_parts`)."""

    def __init__(self, cfg: Config, ctx: DistContext, parts: RLParts) -> None:
        self.cfg, self.ctx, self.parts = cfg, ctx, parts
        self.out_dir = Path(cfg.trainer.output_dir)
        # Composition: the trainer reads its parts by name.
        self.tokenizer, self.actor, self.ref, self.critic = parts.tokenizer, parts.actor, parts.ref, parts.critic
        self.switch, self.reward_pool, self.val_pool = parts.switch, parts.reward_pool, parts.val_pool
        self.val_records = parts.val_records
        self.collector = RolloutCollector(cfg, ctx, parts)
        a: AlgorithmConfig = OmegaConf.to_object(cfg.algorithm)  # the typed section the algorithm's parts read
        self.critic_loss_fn = make_critic_loss(cfg.critic) if parts.critic is not None else None
        self.kl_ctrl = make_kl_controller(a.kl_reward)
        self.loss_fn = make_actor_loss(a)
        self.adv_fn = ADV_ESTIMATORS[a.adv_estimator]
        self.adv_params = bind_params(ADV_ESTIMATORS, a.adv_estimator, a)
        self.throughput = Throughput(parts.actor, cfg.actor.epochs, cfg.data.max_prompt_length)
        resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        made_from = {"model": model_identity(cfg.model), "model_dir": str(Path(parts.model_path).resolve()), "config": resolved}
        self.control = RunControl(cfg.trainer, ctx, self.out_dir, parts.actor, parts.critic, made_from)
        self.switch_notes = NotesOnce(ctx.is_main)
        self.no_update = NoUpdateWatch(cfg.trainer.no_update_patience, cfg.trainer.no_update_action, ctx.is_main)
        self.step_idx = 0
        self.val_start_hits: torch.Tensor | None = None  # the run's first validation, per problem
        self.logger = MetricsLogger(cfg.logger, self.out_dir, resolved, cfg.trainer.total_steps, ctx.is_main)
        lg = cfg.logger
        self.generations = GenerationLog(self.out_dir, lg.generations, lg.generations_every, self.logger, ctx.is_main)
        ckpt.record_scheduler_job(self.out_dir, ctx.is_main)
        self._maybe_resume()

    # ================================================================ the loop
    def fit(self) -> dict[str, float]:
        cfg = self.cfg.trainer
        last: dict[str, float] = {}
        self.control.install_signal_handler()
        if cfg.val_before_train and self.step_idx == 0:
            self.logger.log(0, self.validate())
        first = True
        while self.step_idx < cfg.total_steps and not self.control.stop_agreed():
            with profiled(self.step_idx + 1, cfg.profile_steps, self.out_dir, self.ctx.rank, self.ctx.device) as prof:
                metrics = self.step()
            metrics.update(prof)
            if first:  # what the data loading kept and skipped, once per start
                metrics.update(self.parts.data_metrics)
                first = False
            if cfg.val_every and (self.step_idx % cfg.val_every == 0 or self.step_idx == cfg.total_steps):
                metrics.update(self.validate())
            self.logger.log(self.step_idx, metrics)
            last = metrics
            if self.no_update.must_stop:
                self.save()
                raise NoUpdateError(self.no_update.message())
            if self.control.due(self.step_idx) and self.step_idx < cfg.total_steps:
                self.save()
        self.save()
        if cfg.export_hf and not self.control.stop_requested:
            self.export_hf()
        self.logger.close()
        return last

    def step(self) -> dict[str, float]:
        """One RL step; reads as the phases it runs."""
        timer = PhaseTimer(STEP_PREFIX, self.ctx.device)
        with timer.phase("step"):
            rollout, m = self.collector.collect(self.step_idx, timer)
            with timer.phase("switch_to_train"):
                m.update(switch_metrics(self.switch_notes(self.switch.to_train())))
            skipped_before = self.actor.skipped_steps
            m.update(self.train_on_batch(rollout, timer))
            m.update(self.no_update.observe(self.step_idx + 1, no_update_reason(m, skipped_before, self.actor.skipped_steps)))
            self.check_numerics()
            maybe_fail("switch", self.step_idx + 1, self.ctx.rank)
            with timer.phase("switch_to_rollout"):
                skip = fault_active("skip_sync", self.step_idx + 1)
                m.update(switch_metrics(self.switch_notes(self.switch.to_rollout(skip_sync=skip))))
        self.step_idx += 1
        m.update(rollout.stats)
        m.update(timer.metrics())
        m["weights_version"] = float(self.switch.weights_version)
        m.update(process_stats())
        return reduce_metrics(m)

    def train_on_batch(self, rollout: Rollout, timer: PhaseTimer | None = None) -> dict[str, float]:
        """Log-probs, advantages and the policy (and critic) update on one scored rollout, with
        the engines in training mode; bumps the trainer's weights version."""
        timer = timer or PhaseTimer(STEP_PREFIX, self.ctx.device)
        if not rollout.samples:  # dynamic sampling kept nothing: every group's answers scored the same
            return {"dapo/skipped_updates": 1.0}  # said out loud by the NoUpdateWatch
        m: dict[str, float] = {}
        batch = self.make_batch(rollout)
        with timer.phase("logprobs"):
            m.update(self.compute_logprobs(batch))
        with timer.phase("advantage"):
            m.update(self.compute_advantages(batch))
        if self.generations.train_due(self.step_idx + 1):
            self.generations.write("train", self.step_idx + 1, rollout_rows(rollout, self.tokenizer, self.generations.n, batch))
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
        """Collate; with ``algorithm.overlong.mask_truncated`` remember which rows were cut at the length
        limit. They are masked out of the *loss* only, after the advantages: their true scores
        still enter their group's mean and std (masking first turned a truncated -1 into a 0)."""
        batch = collate(rollout.samples, self.tokenizer.pad_token_id, rollout.weights_version)
        if self.cfg.algorithm.overlong.mask_truncated:  # DAPO overlong filtering: cut-off answers teach nothing
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
            and a.tis.mode == "none"
            and not a.kl_reward.enable
        )

    def compute_logprobs(self, batch: TrainBatch) -> dict[str, float]:
        """Old log-probs from the actor (unless exactly on-policy), reference log-probs and
        critic values, under the distribution the engine sampled from (temperature, top-k, top-p).
        The reference keeps the full softmax at the temperature (truncating it to its own nucleus
        would give -inf on tokens the policy may still sample), and every KL term compares it with
        the policy's untruncated log-probs, so identical weights give a KL of 0."""
        if self.critic is not None:
            batch.values = self.critic.forward_outputs(batch).values
        if self.ref is not None:
            batch.ref_logprobs = self.ref.forward_logprobs(batch, self.cfg.rollout.temperature)
        if self.exactly_on_policy:
            return {}  # the loss uses logprobs.detach() and reports the rollout mismatch itself
        out = self.actor.forward_outputs(batch, self.sampling)
        batch.old_logprobs, batch.old_kl_logprobs = out.logprobs, out.kl_logprobs
        m = {"actor/entropy_old": float(masked_mean(out.entropy, batch.response_mask))}
        if self.ref is not None:
            kl = kl_estimate(kl_side(batch), batch.ref_logprobs, "k3")
            m["actor/ref_kl_k3"] = float(masked_mean(kl, batch.response_mask))
        diff = (batch.old_logprobs - batch.rollout_logprobs).abs() * batch.response_mask
        m["rollout/logprob_diff_mean"] = float(diff.sum() / batch.response_mask.sum().clamp(min=1))
        m["rollout/logprob_diff_max"] = float(diff.max()) if diff.numel() else 0.0
        return m

    def compute_advantages(self, batch: TrainBatch) -> dict[str, float]:
        """Token rewards (KL folded in if configured), then the registered estimator on the global batch."""
        a = self.cfg.algorithm
        kl = None
        if a.kl_reward.enable:
            kl = kl_estimate(kl_side(batch), batch.ref_logprobs, a.kl_reward.penalty)
        batch.token_rewards = kl_in_reward(batch.scores, batch.response_mask, kl, self.kl_ctrl.value)
        fields = {"token_rewards": batch.token_rewards, "response_mask": batch.response_mask, "group_ids": batch.group_ids}
        if batch.values is not None:
            fields["values"] = batch.values
        if "greedy_baseline" in ADV_ESTIMATORS.needs[a.adv_estimator]:
            fields["baseline_scores"] = batch.baseline_scores
        glob, mine = gather_rows(fields)
        inputs = AdvantageInputs(
            glob["token_rewards"], glob["response_mask"], glob["group_ids"], glob.get("values"), glob.get("baseline_scores")
        )
        adv, returns = self.adv_fn(inputs, self.adv_params)
        width = batch.response_mask.shape[1]
        batch.advantages = adv[mine, :width].contiguous()
        batch.returns = returns[mine, :width].contiguous()
        if batch.truncated is not None:
            batch.response_mask[batch.truncated] = 0.0  # out of the loss, not out of the statistics
        m = {
            "critic/advantages/mean": float(masked_mean(batch.advantages, batch.response_mask)),
            "advantage/abs_mean": float(masked_mean(batch.advantages.abs(), batch.response_mask)),
            **_masked_extremes("critic/advantages", batch.advantages, batch.response_mask),
        }
        if batch.values is not None:
            m["critic/vf_explained_var"] = explained_variance(batch.returns, batch.values, batch.response_mask)
        if kl is not None:
            # The global token-weighted KL: every rank updates its controller from the same
            # number, so all ranks fold the same coefficient into their rows.
            kl_sum, n_tok = all_reduce_sum([float((kl * batch.response_mask).sum()), float(batch.response_mask.sum())])
            current = kl_sum / max(n_tok, 1.0)
            m["actor/reward_kl_penalty"], m["actor/reward_kl_penalty_coeff"] = current, self.kl_ctrl.value
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

    # ================================================================ validation
    def validate(self) -> dict[str, float]:
        """Held-out metrics; from the second validation on also ``val/gain`` and ``val/gain_se``,
        the greedy accuracy gain since the run's first validation (step 0 with
        ``trainer.val_before_train``) and its paired standard error (same problems both times)."""
        r = self.cfg.rollout
        start = time.perf_counter()
        out, hits, samples = evaluate(
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
            keep_samples=self.generations.n,
            top_p=r.top_p,
            top_k=r.top_k,
        )
        self.generations.write("val", self.step_idx, samples)
        if self.val_start_hits is None or self.val_start_hits.shape != hits.shape:
            self.val_start_hits = hits
        else:
            out["val/gain"], out["val/gain_se"] = paired_gain(self.val_start_hits, hits)
            out.update(gains_by_source(self.val_records, self.val_start_hits, hits))
        out[phase_key("validate")] = time.perf_counter() - start
        return out

    def export_hf(self) -> None:
        """``output_dir/hf`` from the newest checkpoint, streamed by rank 0 (:mod:`hybrid_rl.export`)."""
        from hybrid_rl.export import export_checkpoint

        if self.ctx.is_main:
            # The run's own folder: a resumed run replaces the export an earlier end of it wrote.
            info = export_checkpoint(ckpt.latest_checkpoint(self.out_dir / "checkpoints"), self.out_dir / "hf", overwrite=True)
            log.info("exported %s (%d tensors, %.1f MiB)", self.out_dir / "hf", info["tensors"], info["bytes"] / 2**20)
        barrier()

    # ================================================================ checkpoints
    def save(self) -> None:
        run_state = ckpt.rl_run_state(self.step_idx, self.parts, self.kl_ctrl.value, self.val_start_hits)
        run_state["no_update_streak"] = self.no_update.streak  # a requeued run still stops at its patience
        self.control.save(self.step_idx, run_state)

    def _maybe_resume(self) -> None:
        path = self.control.resume_point()
        if path is None:
            return
        state = self.control.load(path)
        self.step_idx = int(state["step"])
        self.kl_ctrl.value = float(state["kl_coef"])
        ckpt.restore_rl_run_state(state, self.parts)
        self.val_start_hits = state.get("val_start_hits")  # absent in checkpoints of older versions
        self.no_update.streak = int(state.get("no_update_streak", 0))
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

    def close(self) -> None:
        self.reward_pool.close()
        if self.val_pool is not self.reward_pool:
            self.val_pool.close()
        barrier()
        self.parts.rollout_engine.shutdown()
