"""The RL trainer: one step is rollout -> reward -> log-probs -> advantages -> update -> switch.

The trainer is algorithm-blind: the advantage estimator and the policy loss come from the
registries by name, and the loss is handed to the engine. Each phase runs under a timer; the
mode switch reports its own phases. Data-parallel: every rank generates for its share of the
prompts with its own engine and trains on its own samples; advantages are computed on the
gathered global batch so batch-level statistics (REINFORCE++ whitening) are global.
"""

from __future__ import annotations

import logging
import random
import signal
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from hybrid_rl.algorithms.advantages import AdvantageInputs
from hybrid_rl.algorithms.filters import informative_groups
from hybrid_rl.algorithms.kl import kl_estimate, kl_in_reward, make_kl_controller
from hybrid_rl.algorithms.losses import agg_weights, make_actor_loss, masked_mean
from hybrid_rl.algorithms.registry import ADV_ESTIMATORS
from hybrid_rl.batch import Rollout, TrainBatch, collate
from hybrid_rl.config import validate
from hybrid_rl.data.dataset import PromptSampler, check_chat_template, load_prompts, resolve_files
from hybrid_rl.dist import (
    DistContext,
    all_gather_objects,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    gather_rows,
    mean_over_ranks,
)
from hybrid_rl.engine.fsdp import build_policy_engine, to_dtype
from hybrid_rl.hybrid.switch import HybridSwitch, SwitchReport
from hybrid_rl.rewards.pool import RewardPool
from hybrid_rl.rollout.base import SamplingSpec
from hybrid_rl.rollout.sampler import sample_groups
from hybrid_rl.timing import PhaseTimer
from hybrid_rl.trainer import checkpoint as ckpt
from hybrid_rl.trainer.build import build_rollout_engine, check_lengths, load_tokenizer, resolve_model_path
from hybrid_rl.trainer.logger import MetricsLogger
from hybrid_rl.trainer.validation import evaluate

log = logging.getLogger("hybrid_rl")


class AppState:
    """DCP ``Stateful`` for the actor's model and optimizer (sharded save, resharding load)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> dict:
        model_sd, optim_sd = self.engine.state_dicts()
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dicts(state["model"], state["optim"])


class RLTrainer:
    def __init__(self, cfg: Any, ctx: DistContext) -> None:
        validate(cfg, ctx.world_size)
        self.cfg, self.ctx = cfg, ctx
        self.out_dir = Path(cfg.trainer.output_dir)
        torch.manual_seed(cfg.trainer.seed + ctx.rank)
        random.seed(cfg.trainer.seed + ctx.rank)
        self.model_path = resolve_model_path(cfg, ctx)
        self.tokenizer = load_tokenizer(self.model_path, cfg.model.trust_remote_code)
        check_chat_template(self.tokenizer, self.model_path)
        max_len = check_lengths(cfg, self.model_path)
        d = cfg.data
        self.train_records, self.train_report = load_prompts(resolve_files(d.train_files, "train", d.synth), self.tokenizer, d)
        self.val_records, self.val_report = load_prompts(
            resolve_files(d.val_files, "val", d.synth), self.tokenizer, d, d.val_size
        )
        self.sampler = PromptSampler(len(self.train_records), d.train_batch_size, d.seed, d.shuffle)
        self.actor = build_policy_engine(self.model_path, cfg.model, cfg.actor, ctx, self._optimizer_steps(), trainable=True)
        a = cfg.algorithm
        self.ref = None
        if a.use_kl_loss or a.use_kl_in_reward:
            self.ref = build_policy_engine(self.model_path, cfg.model, cfg.actor, ctx, 1, trainable=False)
        self.rollout_engine = build_rollout_engine(self.model_path, cfg, ctx, max_len, cfg.trainer.seed)
        self.switch = HybridSwitch(
            self.actor,
            self.rollout_engine,
            sync_dtype=to_dtype(cfg.model.dtype),
            bucket_bytes=cfg.rollout.sync_bucket_mb << 20,
            sleep_level=cfg.rollout.sleep_level,
            device=ctx.device,
        )
        self.reward_pool = RewardPool(cfg.reward)
        self.kl_ctrl = make_kl_controller(a.kl_ctrl, a.kl_coef, a.kl_target, a.kl_horizon)
        self.loss_fn = make_actor_loss(a)
        self.adv_fn = ADV_ESTIMATORS[a.adv_estimator]
        self.step_idx = 0
        self.stop_requested = False
        self.logger = MetricsLogger(
            cfg.logger, self.out_dir, OmegaConf.to_container(cfg, resolve=True), cfg.trainer.total_steps, ctx.is_main
        )
        self._maybe_resume()

    # ================================================================ the loop
    def fit(self) -> dict[str, float]:
        cfg = self.cfg.trainer
        last: dict[str, float] = {}
        if cfg.val_before_train and self.step_idx == 0:
            self.logger.log(0, self.validate())
        self._install_signal_handler()
        while self.step_idx < cfg.total_steps and not self._stop_agreed():
            metrics = self.step()
            if cfg.val_every and (self.step_idx % cfg.val_every == 0 or self.step_idx == cfg.total_steps):
                metrics.update(self.validate())
            self.logger.log(self.step_idx, metrics)
            last = metrics
            if cfg.save_every and self.step_idx % cfg.save_every == 0:
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
            rollout = self.collect_rollout(timer, m)
            with timer.phase("switch_to_train"):
                m.update(self.switch_metrics(self.switch.to_train()))
            if rollout.samples:
                batch = collate(rollout.samples, self.tokenizer.pad_token_id, rollout.weights_version)
                with timer.phase("logprobs"):
                    m.update(self.compute_logprobs(batch))
                with timer.phase("advantage"):
                    m.update(self.compute_advantages(batch))
                with timer.phase("update"):
                    m.update(self.update_policy(batch))
                m.update(self.throughput(rollout, batch, timer))
            else:  # dynamic sampling kept nothing: every group's answers scored the same
                m["dapo/skipped_updates"] = 1.0
            with timer.phase("switch_to_rollout"):
                m.update(self.switch_metrics(self.switch.to_rollout()))
        self.step_idx += 1
        m.update(rollout.stats)
        m.update(timer.metrics())
        m["weights_version"] = float(self.switch.weights_version)
        return self.reduce_metrics(m)

    # ================================================================ phases
    def next_prompts(self) -> list[Any]:
        idx = self.sampler.next_batch()
        per = len(idx) // self.ctx.world_size
        return [self.train_records[i] for i in idx[self.ctx.rank * per : (self.ctx.rank + 1) * per]]

    def sampling_spec(self, n: int | None = None) -> SamplingSpec:
        r = self.cfg.rollout
        # Per-request seeds make rollouts a function of (weights, step, rank): resumable exactly.
        seed = self.cfg.trainer.seed * 1_000_003 + self.step_idx * 1009 + self.ctx.rank
        return SamplingSpec(
            n=n or r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_response_length, seed=seed
        )

    def generate(self, prompts: list[Any], round_idx: int = 0) -> Rollout:
        offset = (round_idx * self.ctx.world_size + self.ctx.rank) * len(prompts)
        spec = self.sampling_spec()
        spec.seed = spec.seed + 7919 * round_idx
        return sample_groups(self.rollout_engine, prompts, offset, spec, self.switch.weights_version)

    def collect_rollout(self, timer: PhaseTimer, m: dict[str, float]) -> Rollout:
        """Generate and score; with ``algorithm.filter_groups`` keep drawing batches until enough
        informative groups are collected (DAPO dynamic sampling), then deal them out to ranks."""
        a = self.cfg.algorithm
        with timer.phase("generate"):
            rollout = self.generate(self.next_prompts())
        with timer.phase("reward"):
            m.update(self.score(rollout))
        if not a.filter_groups:
            return rollout
        target = self.cfg.data.train_batch_size * self.cfg.rollout.n
        kept, drawn, rounds = [], 0, 0
        while True:
            everyone = [s for part in all_gather_objects(rollout.samples) for s in part]
            drawn += len({s.group for s in everyone})
            mask = informative_groups(torch.tensor([s.score for s in everyone]), torch.tensor([s.group for s in everyone]))
            kept += [s for s, k in zip(everyone, mask.tolist(), strict=True) if k]
            rounds += 1
            if len(kept) >= target or rounds >= a.max_gen_rounds:
                break
            with timer.phase("generate"):
                extra = self.generate(self.next_prompts(), round_idx=rounds)
            with timer.phase("reward"):
                self.score(extra)
            for k, v in extra.stats.items():
                rollout.stats[k] = rollout.stats.get(k, 0.0) + v
            rollout = Rollout(extra.samples, extra.weights_version, rollout.stats)
        per_rank = min(len(kept), target) // self.ctx.world_size
        mine = kept[: per_rank * self.ctx.world_size][self.ctx.rank :: self.ctx.world_size]
        m.update(
            {
                "dapo/gen_rounds": float(rounds),
                "dapo/prompts_drawn": float(drawn),
                "dapo/kept_samples": float(len(kept)),
                "dapo/used_samples": float(per_rank * self.ctx.world_size),
            }
        )
        return Rollout(mine, rollout.weights_version, rollout.stats)

    def score(self, rollout: Rollout) -> dict[str, float]:
        samples = rollout.samples
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        items = [
            (s.data_source, t, s.ground_truth, {**s.extra_info, "finish_reason": s.finish_reason})
            for s, t in zip(samples, texts, strict=True)
        ]
        results = self.reward_pool.score(items)
        for s, r in zip(samples, results, strict=True):
            s.score, s.reward_extra = r.score, {**r.components, **r.extra}
        self.reward_pool.check_failures(results)
        scores = torch.tensor([r.score for r in results])
        m = {
            "reward/mean": float(scores.mean()),
            "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
            "reward/failed": float(sum(r.failed > 0 for r in results)),
            "reward/timeouts": float(sum(r.timed_out for r in results)),
        }
        for name in results[0].components:
            m[f"reward/{name}"] = sum(r.components[name] for r in results) / len(results)
        return m

    def compute_logprobs(self, batch: TrainBatch) -> dict[str, float]:
        """Old log-probs from the actor (and reference log-probs) at the sampling temperature."""
        temp = self.cfg.rollout.temperature
        out = self.actor.forward_outputs(batch, temp)
        batch.old_logprobs = out.logprobs
        m = {"actor/entropy_old": float(masked_mean(out.entropy, batch.response_mask))}
        if self.ref is not None:
            batch.ref_logprobs = self.ref.forward_logprobs(batch, temp)
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
        glob, mine = gather_rows(fields)
        adv, returns = self.adv_fn(
            AdvantageInputs(glob["token_rewards"], glob["response_mask"], glob["group_ids"], glob.get("values")), a
        )
        width = batch.response_mask.shape[1]
        batch.advantages = adv[mine, :width].contiguous()
        batch.returns = returns[mine, :width].contiguous()
        m = {
            "advantage/mean": float(masked_mean(batch.advantages, batch.response_mask)),
            "advantage/abs_mean": float(masked_mean(batch.advantages.abs(), batch.response_mask)),
        }
        if kl is not None:
            current = float(masked_mean(kl, batch.response_mask))
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
                mb.loss_weights = agg_weights(
                    mb.response_mask, a.loss_agg_mode, n_tok, n_seq, self.cfg.rollout.max_response_length
                )
                for k, v in self.actor.train_batch(mb, self.loss_fn, self.cfg.rollout.temperature).items():
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
        return m

    def throughput(self, rollout: Rollout, batch: TrainBatch, timer: PhaseTimer) -> dict[str, float]:
        lengths = torch.tensor([len(s.response_ids) for s in rollout.samples], dtype=torch.float32)
        gen_tokens, train_tokens = all_reduce_sum([float(lengths.sum()), float(batch.attention_mask.sum())])
        return {
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/clip_ratio": sum(s.finish_reason == "length" for s in rollout.samples) / len(rollout.samples),
            "rollout/tokens_per_s": gen_tokens / max(timer.seconds.get("generate", 1e-9), 1e-9),
            "train/tokens_per_s": train_tokens * self.cfg.actor.epochs / max(timer.seconds.get("update", 1e-9), 1e-9),
        }

    def reduce_metrics(self, m: dict[str, float]) -> dict[str, float]:
        """Mean over ranks, except token counts (summed) and throughput (already global)."""
        summed = {k for k in m if k.endswith("_tokens") or k in ("reward/failed", "reward/timeouts")}
        globals_ = {k for k in m if k.endswith("tokens_per_s") or k.startswith("dapo/")}
        sums = dict(zip(sorted(summed), all_reduce_sum([m[k] for k in sorted(summed)]), strict=True))
        means = mean_over_ranks({k: v for k, v in m.items() if k not in summed and k not in globals_})
        return {**means, **sums, **{k: m[k] for k in globals_}}

    # ================================================================ validation
    def validate(self) -> dict[str, float]:
        r = self.cfg.rollout
        start = time.perf_counter()
        out = evaluate(
            self.rollout_engine,
            self.val_records,
            self.reward_pool,
            self.tokenizer,
            self.ctx,
            r.max_response_length,
            r.val_pass_k,
            r.temperature,
            self.cfg.trainer.seed,
            self.cfg.reward.functions[0].name,
        )
        out["timing/validate"] = time.perf_counter() - start
        return out

    # ================================================================ checkpoints
    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step_idx,
            "sampler": self.sampler.state_dict(),
            "weights_version": self.switch.weights_version,
            "kl_coef": self.kl_ctrl.value,
            "reward_failed_steps": self.reward_pool.failed_steps,
            "rng_torch": torch.get_rng_state(),
            "rng_python": random.getstate(),
        }

    def save(self) -> Path:
        path = ckpt.save_checkpoint(
            self.out_dir / "checkpoints",
            self.step_idx,
            {"app": AppState(self.actor)},
            self.trainer_state(),
            self.cfg.trainer.keep_last,
            self.ctx.rank,
            self.ctx.world_size,
        )
        if self.ctx.is_main:
            log.info("saved checkpoint %s", path)
        return path

    def _maybe_resume(self) -> None:
        mode = self.cfg.trainer.resume
        if mode == "none":
            return
        path = ckpt.latest_checkpoint(self.out_dir / "checkpoints") if mode == "auto" else Path(mode)
        if path is None:
            return
        state = ckpt.load_checkpoint(path, {"app": AppState(self.actor)}, self.ctx.rank)
        self.step_idx = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.value = float(state["kl_coef"])
        self.reward_pool.failed_steps = int(state["reward_failed_steps"])
        torch.set_rng_state(state["rng_torch"])
        random.setstate(state["rng_python"])
        # The engine was built from the initial weights: push the resumed ones.
        self.switch.weights_version = int(state["weights_version"]) - 1
        self.switch.to_rollout()
        barrier()
        if self.ctx.is_main:
            log.info("resumed from %s at step %d", path, self.step_idx)

    def _stop_agreed(self) -> bool:
        """A signal may reach one rank only; all ranks stop together."""
        self.stop_requested = all_reduce_max(float(self.stop_requested)) > 0
        return self.stop_requested

    def _install_signal_handler(self) -> None:
        """SIGUSR1/SIGTERM (Slurm's warning before a time limit or preemption): checkpoint after this step."""

        def handler(signum: int, frame: Any) -> None:
            self.stop_requested = True
            log.warning("signal %d: saving a checkpoint after the current step, then exiting", signum)

        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, handler)

    def _optimizer_steps(self) -> int:
        c = self.cfg
        samples = c.data.train_batch_size * c.rollout.n
        return c.trainer.total_steps * c.actor.epochs * max(1, samples // (c.actor.mini_batch_size or samples))

    def close(self) -> None:
        self.reward_pool.close()
        barrier()
        self.rollout_engine.shutdown()
