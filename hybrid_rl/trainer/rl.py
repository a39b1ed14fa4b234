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
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from hybrid_rl.algorithms.advantages import AdvantageInputs
from hybrid_rl.algorithms.filters import informative_groups, overlong_penalty
from hybrid_rl.algorithms.kl import kl_estimate, kl_in_reward, make_kl_controller
from hybrid_rl.algorithms.losses import agg_weights, make_actor_loss, make_critic_loss, masked_mean
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
    raise_if_any_failed,
)
from hybrid_rl.engine.fsdp import build_policy_engine, build_value_engine, to_dtype
from hybrid_rl.engine.heads import Sampling
from hybrid_rl.errors import NumericalError
from hybrid_rl.faults import fault_active, maybe_fail
from hybrid_rl.hybrid.switch import HybridSwitch, SwitchReport
from hybrid_rl.rewards.pool import RewardPool
from hybrid_rl.rollout.agent import AgentLoop, AgentSettings
from hybrid_rl.rollout.base import SamplingSpec, prompt_seed
from hybrid_rl.rollout.sampler import sample_groups
from hybrid_rl.rollout.tools import get_parser
from hybrid_rl.timing import PhaseTimer, process_stats
from hybrid_rl.trainer import checkpoint as ckpt
from hybrid_rl.trainer.build import (
    build_rollout_engine,
    build_tools,
    load_tokenizer,
    max_model_len,
)
from hybrid_rl.trainer.logger import MetricsLogger
from hybrid_rl.trainer.validation import evaluate, single_turn_sampler

log = logging.getLogger("hybrid_rl")


def merge_round_metrics(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Reward metrics over every DAPO generation round (equal-sized rounds): counts summed,
    the rest averaged."""
    out: dict[str, float] = {}
    for k in rounds[0]:
        vals = [r[k] for r in rounds if k in r]
        out[k] = sum(vals) if k in ("reward/failed", "reward/timeouts") else sum(vals) / len(vals)
    return out


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
    def __init__(self, cfg: Any, ctx: DistContext, model_path: str, reward_model_path: str | None = None) -> None:
        validate(cfg, ctx.world_size)
        self.cfg, self.ctx = cfg, ctx
        self.out_dir = Path(cfg.trainer.output_dir)
        torch.manual_seed(cfg.trainer.seed + ctx.rank)
        random.seed(cfg.trainer.seed + ctx.rank)
        self.model_path = model_path
        self.tokenizer = load_tokenizer(self.model_path, cfg.model.trust_remote_code)
        check_chat_template(self.tokenizer, self.model_path)
        max_len = max_model_len(cfg, self.model_path)
        self.tools, schemas = build_tools(cfg)
        d = cfg.data
        self.train_records, self.train_report = load_prompts(
            resolve_files(d.train_files, "train", d.synth), self.tokenizer, d, tools=schemas
        )
        self.val_records, self.val_report = load_prompts(
            resolve_files(d.val_files, "val", d.synth), self.tokenizer, d, d.val_size, tools=schemas
        )
        self.sampler = PromptSampler(len(self.train_records), d.train_batch_size, d.seed, d.shuffle)
        self.actor = build_policy_engine(self.model_path, cfg.model, cfg.actor, ctx, self._optimizer_steps(), trainable=True)
        a = cfg.algorithm
        self.ref = None
        if a.use_kl_loss or a.use_kl_in_reward:
            self.ref = build_policy_engine(self.model_path, cfg.model, cfg.actor, ctx, 1, trainable=False)
        self.critic = None
        if cfg.critic.enable:
            self.critic = build_value_engine(self.model_path, cfg.model, cfg.critic, cfg.actor, ctx, self._optimizer_steps())
            self.critic_loss_fn = make_critic_loss(cfg.critic)
        self.rollout_engine = build_rollout_engine(self.model_path, cfg, ctx, max_len, cfg.trainer.seed)
        self.switch = HybridSwitch(
            self.actor,
            self.rollout_engine,
            sync_dtype=to_dtype(cfg.rollout.dtype),
            bucket_bytes=cfg.rollout.sync_bucket_mb << 20,
            sleep_level=cfg.rollout.sleep_level,
            device=ctx.device,
        )
        self.reward_pool = RewardPool(cfg.reward)
        # Held-out accuracy is always the verifier's, whatever the training reward is.
        self.val_pool = (
            self.reward_pool
            if any(f.name == "math" for f in cfg.reward.functions)
            else RewardPool(
                OmegaConf.merge(cfg.reward, {"functions": [{"name": "math", "weight": 1.0}], "reward_model": {"path": None}})
            )
        )
        self.reward_model = None
        if reward_model_path:
            from hybrid_rl.trainer.preference import build_reward_engine

            self.reward_model = build_reward_engine(reward_model_path, cfg, ctx, 1, trainable=False)
        self.kl_ctrl = make_kl_controller(a.kl_ctrl, a.kl_coef, a.kl_target, a.kl_horizon)
        self.loss_fn = make_actor_loss(a)
        self.adv_fn = ADV_ESTIMATORS[a.adv_estimator]
        self.step_idx = 0
        self.stop_requested = False
        self.last_save = time.monotonic()
        self.logger = MetricsLogger(
            cfg.logger, self.out_dir, OmegaConf.to_container(cfg, resolve=True), cfg.trainer.total_steps, ctx.is_main
        )
        self._record_scheduler_job()
        self._maybe_resume()

    def _record_scheduler_job(self) -> None:
        """Append the Slurm job id (and restart count) to <output_dir>/slurm_jobs.txt."""
        if self.ctx.is_main and "SLURM_JOB_ID" in os.environ:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with (self.out_dir / "slurm_jobs.txt").open("a") as fh:
                fh.write(
                    f"{os.environ['SLURM_JOB_ID']} restart={os.environ.get('SLURM_RESTART_COUNT', '0')} "
                    f"time={time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
                )

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
            rollout = self.collect_rollout(timer, m)
            with timer.phase("switch_to_train"):
                m.update(self.switch_metrics(self.switch.to_train()))
            if rollout.samples:
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
            else:  # dynamic sampling kept nothing: every group's answers scored the same
                m["dapo/skipped_updates"] = 1.0
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

    # ================================================================ phases
    # With vLLM tensor parallelism (rollout.tensor_parallel_size = tp > 1, CUDA) the tp ranks of a
    # group drive one engine and must feed it identical requests: prompts are split over the
    # world_size / tp data-parallel groups, and each rank then trains on its 1/tp of the samples.
    @property
    def response_budget(self) -> int:
        """The most tokens a response may have: the agent's whole-episode budget (model + tool
        tokens) in agent mode, else rollout.max_response_length. The overlong penalty and the
        constant length of seq-mean-token-sum-norm are keyed to it."""
        ag = self.cfg.rollout.agent
        return ag.max_response_tokens if ag.enable else self.cfg.rollout.max_response_length

    @property
    def sampling(self) -> Sampling:
        r = self.cfg.rollout
        return Sampling(r.temperature, r.top_k, r.top_p)

    @property
    def tp(self) -> int:
        return self.cfg.rollout.tensor_parallel_size

    @property
    def dp_rank(self) -> int:
        return self.ctx.rank // self.tp

    @property
    def dp_size(self) -> int:
        return self.ctx.world_size // self.tp

    def next_prompts(self) -> list[Any]:
        idx = self.sampler.next_batch()
        per = len(idx) // self.dp_size
        return [self.train_records[i] for i in idx[self.dp_rank * per : (self.dp_rank + 1) * per]]

    def sampling_spec(self, group_ids: list[int], round_idx: int = 0) -> SamplingSpec:
        """One seed per prompt, hashed from (run seed, step, generation round, global prompt
        index): rollouts are a function of the weights and those keys (exact resume), and no two
        prompts, ranks or rounds share sampling noise."""
        r = self.cfg.rollout
        seeds = [prompt_seed(self.cfg.trainer.seed, self.step_idx, round_idx, g) for g in group_ids]
        return SamplingSpec(
            n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_response_length, seeds=seeds
        )

    def generate(self, prompts: list[Any], round_idx: int = 0) -> Rollout:
        offset = (round_idx * self.dp_size + self.dp_rank) * len(prompts)
        spec = self.sampling_spec([offset + i for i in range(len(prompts))], round_idx)
        # Stamped with the version the engine really holds (set only by a completed sync).
        version = self.switch.engine_version
        if self.cfg.rollout.agent.enable:
            rollout = self.agent_loop().run(prompts, spec, offset, version)
        else:
            rollout = sample_groups(self.rollout_engine, prompts, offset, spec, version)
        if self.cfg.algorithm.greedy_baseline:
            self.add_greedy_baseline(prompts, rollout)
        if self.tp > 1:
            rollout.samples = rollout.samples[self.ctx.rank % self.tp :: self.tp]
        return rollout

    def agent_loop(self) -> AgentLoop:
        ag = self.cfg.rollout.agent
        settings = AgentSettings(
            max_turns=ag.max_turns,
            max_response_tokens=ag.max_response_tokens,
            tool_response_max_tokens=ag.tool_response_max_tokens,
            tool_response_keep=ag.tool_response_keep,
            scheduling=ag.scheduling,
        )
        return AgentLoop(self.rollout_engine, self.tools, self.tokenizer, settings, get_parser(ag.parser))

    def val_sampler(self):
        """Validation episodes: one generate call, or full multi-turn episodes with the agent loop."""
        if not self.cfg.rollout.agent.enable:
            return single_turn_sampler(self.rollout_engine, self.tokenizer)

        def sample(records: list[Any], spec: SamplingSpec) -> tuple[list[list[str]], dict[str, float]]:
            out = self.agent_loop().run(records, spec, 0, self.switch.engine_version)
            texts = [
                self.tokenizer.decode(
                    [t for t, m in zip(s.response_ids, s.response_mask, strict=True) if m], skip_special_tokens=True
                )
                for s in out.samples
            ]
            per = spec.n
            grouped = [texts[i * per : (i + 1) * per] for i in range(len(records))]
            n = len(out.samples)
            stats = {
                k.split("/", 1)[1]: v * n / per
                for k, v in out.stats.items()
                if k in ("agent/turns_mean", "agent/tool_call_rate", "agent/tool_calls_mean")
            }
            return grouped, stats

        return sample

    def add_greedy_baseline(self, prompts: list[Any], rollout: Rollout) -> None:
        """ReMax: score the greedy answer to each prompt; it is the baseline of that prompt's samples."""
        greedy = sample_groups(
            self.rollout_engine,
            prompts,
            0,
            SamplingSpec(n=1, temperature=0.0, max_tokens=self.cfg.rollout.max_response_length),
            self.switch.engine_version,
        )
        self.score(greedy)
        per_prompt = len(rollout.samples) // len(prompts)
        for i, s in enumerate(rollout.samples):
            s.baseline_score = greedy.samples[i // per_prompt].score
        rollout.stats["rollout/greedy_baseline_mean"] = sum(g.score for g in greedy.samples) / len(greedy.samples)

    def collect_rollout(self, timer: PhaseTimer, m: dict[str, float]) -> Rollout:
        """Generate and score; with ``algorithm.filter_groups`` keep drawing batches until enough
        informative groups are collected (DAPO dynamic sampling), then deal them out to ranks."""
        a = self.cfg.algorithm
        error, rollout = None, None
        try:
            with timer.phase("generate"):
                maybe_fail("generate", self.step_idx + 1, self.ctx.rank)
                rollout = self.generate(self.next_prompts())
            with timer.phase("reward"):
                m.update(self.score(rollout))
        except Exception as e:  # RewardFailure too: every rank must learn of it, or the others hang
            error = e
        raise_if_any_failed(error, f"rollout at step {self.step_idx + 1}")
        if not a.filter_groups:
            return rollout
        target = self.cfg.data.train_batch_size * self.cfg.rollout.n
        kept, drawn, rounds = [], 0, 0
        round_metrics = [{k: v for k, v in m.items() if k.startswith("reward/")}]
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
                round_metrics.append(self.score(extra))
            for k, v in extra.stats.items():
                rollout.stats[k] = rollout.stats.get(k, 0.0) + v
            rollout = Rollout(extra.samples, extra.weights_version, rollout.stats)
        m.update(merge_round_metrics(round_metrics))
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
        # Only what the model wrote is scored: tool output must not answer for it.
        texts = self.tokenizer.batch_decode(
            [[t for t, m in zip(s.response_ids, s.response_mask, strict=True) if m] for s in samples], skip_special_tokens=True
        )
        items = [
            (s.data_source, t, s.ground_truth, {**s.extra_info, "finish_reason": s.finish_reason})
            for s, t in zip(samples, texts, strict=True)
        ]
        results = self.reward_pool.score(items)
        a = self.cfg.algorithm
        # The model's own tokens only: tool output is not the model's verbosity.
        penalty = overlong_penalty(
            torch.tensor([sum(s.response_mask) for s in samples]),
            self.response_budget,
            a.overlong_buffer,
            a.overlong_penalty_factor,
        )
        learned = self.score_with_reward_model(samples)
        for s, r, p, lr in zip(samples, results, penalty.tolist(), learned.tolist(), strict=True):
            s.score, s.reward_extra = r.score + p + lr, {**r.components, **r.extra}
        self.reward_pool.check_failures(results)
        scores = torch.tensor([s.score for s in samples])
        m = {
            "reward/overlong_penalty": float(penalty.mean()),
            "reward/mean": float(scores.mean()),
            "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
            "reward/failed": float(sum(r.failed > 0 for r in results)),
            "reward/timeouts": float(sum(r.timed_out for r in results)),
        }
        for name in results[0].components:
            m[f"reward/{name}"] = sum(r.components[name] for r in results) / len(results)
        if self.reward_model is not None:
            m["reward/reward_model"] = float(learned.mean())
        return m

    def score_with_reward_model(self, samples: list) -> torch.Tensor:
        """The learned reward model's score for each (prompt, response), on the training devices
        (weighted by reward.reward_model.weight); zeros when there is none."""
        if self.reward_model is None:
            return torch.zeros(len(samples))
        batch = collate(samples, self.tokenizer.pad_token_id)
        return self.reward_model.forward_outputs(batch).scores * self.cfg.reward.reward_model.weight

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
                mb.loss_weights = agg_weights(mb.response_mask, a.loss_agg_mode, n_tok, n_seq, self.response_budget)
                metrics = {}
                if self.critic is not None:
                    weights = agg_weights(mb.response_mask, self.cfg.critic.loss_agg_mode, n_tok, n_seq, self.response_budget)
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
        return m

    def throughput(self, rollout: Rollout, batch: TrainBatch, timer: PhaseTimer) -> dict[str, float]:
        # Model-written tokens (tool output excluded); clip_ratio: responses cut at the budget.
        lengths = torch.tensor([sum(s.response_mask) for s in rollout.samples], dtype=torch.float32)
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
            self.val_sampler(),
            self.val_records,
            self.val_pool,
            self.ctx,
            r.max_response_length,
            r.val_pass_k,
            r.temperature,
            self.cfg.trainer.seed,
            "math",
            shard=(self.dp_rank, self.dp_size),
            count=self.ctx.rank % self.tp == 0,
        )
        out["timing/validate"] = time.perf_counter() - start
        return out

    # ================================================================ checkpoints
    def app_states(self) -> dict[str, AppState]:
        states = {"app": AppState(self.actor)}
        if self.critic is not None:
            states["critic"] = AppState(self.critic)
        return states

    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step_idx,
            "sampler": self.sampler.state_dict(),
            "weights_version": self.switch.weights_version,
            "kl_coef": self.kl_ctrl.value,
            "reward_failed_steps": self.reward_pool.failed_steps,
            "rng_torch": torch.get_rng_state(),
            "rng_python": random.getstate(),
            "actor_engine": self.actor.extra_state(),
            "critic_engine": self.critic.extra_state() if self.critic is not None else None,
        }

    def save(self) -> Path:
        if not self.actor.params_finite():
            raise NumericalError(f"step {self.step_idx}: the policy has non-finite parameters; refusing to write a checkpoint")
        maybe_fail("save", self.step_idx, self.ctx.rank)
        path = ckpt.save_checkpoint(
            self.out_dir / "checkpoints",
            self.step_idx,
            self.app_states(),
            self.trainer_state(),
            self.cfg.trainer.keep_last,
            self.ctx.rank,
            self.ctx.world_size,
        )
        self.last_save = time.monotonic()
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
        state = ckpt.load_checkpoint(path, self.app_states(), self.ctx.rank)
        self.step_idx = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.value = float(state["kl_coef"])
        self.reward_pool.failed_steps = int(state["reward_failed_steps"])
        torch.set_rng_state(state["rng_torch"])
        random.setstate(state["rng_python"])
        self.actor.load_extra_state(state["actor_engine"])
        if self.critic is not None and state.get("critic_engine") is not None:
            self.critic.load_extra_state(state["critic_engine"])
        # The engine was built from the initial weights: push the resumed ones.
        self.switch.weights_version = int(state["weights_version"])
        self.switch.to_rollout()
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

    def _optimizer_steps(self) -> int:
        c = self.cfg
        samples = c.data.train_batch_size * c.rollout.n
        return c.trainer.total_steps * c.actor.epochs * max(1, samples // (c.actor.mini_batch_size or samples))

    def close(self) -> None:
        self.reward_pool.close()
        if self.val_pool is not self.reward_pool:
            self.val_pool.close()
        barrier()
        self.rollout_engine.shutdown()
