"""The rollout collector: prompts -> generate -> score -> dynamic-sampling refill -> deal to ranks.

One entry point per step, :meth:`RolloutCollector.collect`. It owns everything between the
prompt data and a scored :class:`~hybrid_rl.batch.Rollout`: the prompt sampler's position, the
per-prompt sampling seeds, single-turn groups or multi-turn agent episodes, ReMax's greedy
baseline, the reward pool and an optional learned reward model, and DAPO's extra generation
rounds. The trainer (:mod:`hybrid_rl.trainer.rl`) only sees the result.

With vLLM tensor parallelism (``rollout.tensor_parallel_size = tp > 1``, CUDA) the tp ranks of a
group drive one engine and must feed it identical requests: prompts are split over the
``world_size / tp`` data-parallel groups, and each rank then trains on its 1/tp of the samples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hybrid_rl.algorithms.filters import informative_groups, overlong_penalty, refill_prompts, whole_groups
from hybrid_rl.algorithms.registry import ADV_ESTIMATORS
from hybrid_rl.batch import Rollout, collate
from hybrid_rl.data.dataset import PromptSampler
from hybrid_rl.dist import DistContext, all_gather_objects, all_reduce_sum, raise_if_any_failed
from hybrid_rl.faults import maybe_fail
from hybrid_rl.hybrid.switch import HybridSwitch
from hybrid_rl.rewards.ensemble import batch_moments, ensemble_reward, standardize
from hybrid_rl.rewards.pool import RewardFailure, RewardPool, ScoredResponse
from hybrid_rl.rollout.agent import AgentLoop
from hybrid_rl.rollout.base import RolloutEngine, SamplingSpec, prompt_seed
from hybrid_rl.rollout.sampler import sample_groups
from hybrid_rl.rollout.tools import get_parser
from hybrid_rl.timing import PhaseTimer
from hybrid_rl.trainer.step_metrics import length_metrics
from hybrid_rl.trainer.validation import single_turn_sampler

log = logging.getLogger("hybrid_rl")

if TYPE_CHECKING:  # annotations only
    from hybrid_rl.config import Config
    from hybrid_rl.trainer.build import RLParts

# What the reward stage reports: verl's critic/score/* and this project's reward/* (failures,
# informative groups, each function's and reward model's share).
REWARD_METRICS = ("reward/", "critic/score/")


def merge_round_metrics(rounds: list[dict[str, float]], sizes: list[int]) -> dict[str, float]:
    """Reward metrics over every DAPO generation round (``sizes[i]`` samples in round ``i``):
    counts summed, maxima and minima over the rounds, the rest averaged over the samples."""
    out: dict[str, float] = {}
    for k in rounds[0]:
        pairs = [(r[k], n) for r, n in zip(rounds, sizes, strict=True) if k in r]
        vals = [v for v, _ in pairs]
        if k in ("reward/failed", "reward/timeouts"):
            out[k] = sum(vals)
        elif k.endswith("/max") or k.endswith("/min"):
            out[k] = max(vals) if k.endswith("/max") else min(vals)
        else:
            out[k] = sum(v * n for v, n in pairs) / max(sum(n for _, n in pairs), 1)
    return out


def extra_metrics(results: list[ScoredResponse], taken: dict[str, float], say: Callable[[Any, str], None]) -> dict[str, float]:
    """``reward/<key>`` for each numeric extra the reward functions returned in their dict: the
    mean over the step's responses (every round, every rank) that reported it. Ranks may hold
    different keys (a key only some answers carry) and each must hand ``reduce_metrics`` the
    same ones, so the sums and counts are gathered here and every rank logs the same global
    mean. An extra named like one of the step's own reward metrics (``taken``, e.g. ``failed``)
    is logged as ``reward/extra/<key>``; ``say(key, message)`` tells the user once."""
    local: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.extra.items():
            acc = local.setdefault(k, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + v, acc[1] + 1
    total: dict[str, list[float]] = {}
    for part in all_gather_objects(local):
        for k, (s, n) in part.items():
            acc = total.setdefault(k, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + s, acc[1] + n
    out = {}
    for k, (s, n) in sorted(total.items()):
        name = f"reward/{k}"
        if name in taken:
            name = f"reward/extra/{k}"
            say(("metric", k), f"a reward function returns the extra {k!r}, which is also a metric of its own: logged as {name}")
        out[name] = s / n
    return out


class RolloutCollector:
    """Turns the next prompts into this rank's scored samples for one step."""

    def __init__(self, cfg: Config, ctx: DistContext, parts: RLParts) -> None:
        """Reads the rollout engine, the switch, the tokenizer and tools, the training prompts and
        their sampler, the reward pool and any reward models from ``parts``."""
        self.cfg, self.ctx = cfg, ctx
        self.engine: RolloutEngine = parts.rollout_engine
        self.switch: HybridSwitch = parts.switch
        self.tokenizer, self.tools = parts.tokenizer, parts.tools
        self.train_records: list[Any] = parts.train_records
        self.sampler: PromptSampler = parts.sampler
        self.reward_pool: RewardPool = parts.reward_pool
        self.reward_models = list(parts.reward_models or [])
        self.step_idx = 0
        self.scored: list[ScoredResponse] = []  # every training response the step scored, all rounds

    @property
    def response_budget(self) -> int:
        """The most tokens a response may have: the agent's whole-episode budget (model + tool
        tokens) in agent mode, else rollout.max_response_length. The overlong penalty and the
        constant length of seq-mean-token-sum-norm are keyed to it."""
        ag = self.cfg.rollout.agent
        return ag.max_response_tokens if ag.enable else self.cfg.rollout.max_response_length

    @property
    def tp(self) -> int:
        return self.cfg.rollout.tensor_parallel_size

    @property
    def dp_rank(self) -> int:
        return self.ctx.rank // self.tp

    @property
    def dp_size(self) -> int:
        return self.ctx.world_size // self.tp

    def next_prompts(self, count: int | None = None) -> list[Any]:
        """This rank's share of the next ``count`` prompts (data.train_batch_size by default)."""
        idx = self.sampler.next_batch(count)
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

    def generate(self, prompts: list[Any], round_idx: int = 0, first_group: int = 0) -> Rollout:
        """Sample and stamp one round's groups; ``first_group`` is the step's global index of the
        round's first prompt (the prompts drawn in earlier rounds), so group ids stay unique."""
        offset = first_group + self.dp_rank * len(prompts)
        spec = self.sampling_spec([offset + i for i in range(len(prompts))], round_idx)
        # Stamped with the version the engine really holds (set only by a completed sync).
        version = self.switch.engine_version
        if self.cfg.rollout.agent.enable:
            rollout = self.agent_loop().run(prompts, spec, offset, version)
        else:
            rollout = sample_groups(self.engine, prompts, offset, spec, version)
        if "greedy_baseline" in ADV_ESTIMATORS.needs[self.cfg.algorithm.adv_estimator]:
            self.add_greedy_baseline(prompts, rollout)
        if self.tp > 1:
            rollout.samples = rollout.samples[self.ctx.rank % self.tp :: self.tp]
        return rollout

    def agent_loop(self) -> AgentLoop:
        ag = self.cfg.rollout.agent  # an AgentConfig: AgentSettings plus enable / tool_config / parser
        return AgentLoop(self.engine, self.tools, self.tokenizer, ag, get_parser(ag.parser))

    def val_sampler(self):
        """Validation episodes: one generate call, or full multi-turn episodes with the agent loop."""
        if not self.cfg.rollout.agent.enable:
            return single_turn_sampler(self.engine, self.tokenizer)

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
            self.engine,
            prompts,
            0,
            SamplingSpec(n=1, temperature=0.0, max_tokens=self.cfg.rollout.max_response_length),
            self.switch.engine_version,
        )
        self.score(greedy, training=False)
        per_prompt = len(rollout.samples) // len(prompts)
        for i, s in enumerate(rollout.samples):
            s.baseline_score = greedy.samples[i // per_prompt].score
        rollout.stats["rollout/greedy_baseline_mean"] = sum(g.score for g in greedy.samples) / len(greedy.samples)

    def collect(self, step_idx: int, timer: PhaseTimer) -> tuple[Rollout, dict[str, float]]:
        """This rank's scored samples and the reward metrics. Generate and score; with
        ``algorithm.filter_groups.enable`` keep drawing batches until enough informative groups
        are collected (DAPO dynamic sampling), then deal them out to ranks. ``step_idx`` is the
        number of finished steps (it keys the sampling seeds)."""
        self.step_idx, self.scored = step_idx, []
        a = self.cfg.algorithm
        error, rollout = None, None
        m: dict[str, float] = {}
        try:
            with timer.phase("generate"):
                maybe_fail("generate", self.step_idx + 1, self.ctx.rank)
                rollout = self.generate(self.next_prompts())
            with timer.phase("reward"):
                m.update(self.score(rollout))
        except Exception as e:  # every rank must learn of it, or the others hang
            error = e
        raise_if_any_failed(error, f"rollout at step {self.step_idx + 1}")
        if a.filter_groups.enable:
            rollout, m = self.fill_batch(rollout, m, timer)
        m.update(self.end_step(m))
        return rollout, m

    def end_step(self, m: dict[str, float]) -> dict[str, float]:
        """After the step's last generation round, on every rank: the reward failure stop, which
        counts steps (every round of the step together, not each DAPO round as a step of its
        own), and the step's reward extras (:func:`extra_metrics`)."""
        error = None
        try:
            self.reward_pool.check_failures(self.scored)
        except RewardFailure as e:  # every rank must learn of it, or the others hang
            error = e
        raise_if_any_failed(error, f"rollout at step {self.step_idx + 1}")
        return extra_metrics(self.scored, m, self.reward_pool.failures.once)

    def fill_batch(self, rollout: Rollout, m: dict[str, float], timer: PhaseTimer) -> tuple[Rollout, dict[str, float]]:
        """DAPO dynamic sampling: keep the groups whose answers differ, draw more prompts
        (``algorithm.filter_groups.refill``) until data.train_batch_size groups are kept or
        max_gen_rounds ran, and deal whole groups out to the ranks."""
        f, n = self.cfg.algorithm.filter_groups, self.cfg.rollout.n
        batch = self.cfg.data.train_batch_size
        kept, generated, drawn, rounds = [], [], 0, 0
        round_metrics = [{k: v for k, v in m.items() if k.startswith(REWARD_METRICS)}]
        sizes = [len(rollout.samples)]
        while True:
            everyone = [s for part in all_gather_objects(rollout.samples) for s in part]
            drawn += len({s.group for s in everyone})
            generated += everyone
            # DAPO filters on accuracy (verl's filter_groups.metric=acc): a group right in every
            # answer but differing only in the overlong penalty has nothing to teach but length.
            values = [s.acc if f.metric == "acc" else s.score for s in everyone]
            mask = informative_groups(torch.tensor(values), torch.tensor([s.group for s in everyone]))
            kept += [s for s, k in zip(everyone, mask.tolist(), strict=True) if k]
            rounds += 1
            if len(kept) >= batch * n or rounds >= f.max_gen_rounds:
                break
            count = batch
            if f.refill == "missing":
                informative = len({s.group for s in kept})
                count = refill_prompts(batch - informative, drawn, informative, batch, self.dp_size, f.refill_margin)
            with timer.phase("generate"):
                extra = self.generate(self.next_prompts(count), round_idx=rounds, first_group=drawn)
            with timer.phase("reward"):
                round_metrics.append(self.score(extra))
            sizes.append(len(extra.samples))
            for k, v in extra.stats.items():
                rollout.stats[k] = rollout.stats.get(k, 0.0) + v
            rollout = Rollout(extra.samples, extra.weights_version, rollout.stats)
        m.update(merge_round_metrics(round_metrics, sizes))
        used = whole_groups([s.group for s in kept], batch * n, self.ctx.world_size)
        mine = kept[:used][self.ctx.rank :: self.ctx.world_size]
        m.update(
            {
                "dapo/gen_rounds": float(rounds),
                "dapo/prompts_drawn": float(drawn),
                "dapo/kept_samples": float(len(kept)),
                "dapo/used_samples": float(used),
            }
        )
        if not used:  # no update this step: the lengths of what was generated still tell the story
            m.update(length_metrics(generated, self.cfg.data.max_prompt_length))
        elif used < batch * n and self.ctx.is_main:
            log.warning(
                "step %d: trained on %d of %d samples: %d generation rounds (algorithm.filter_groups.max_gen_rounds) "
                "found %d groups whose answers differ", self.step_idx + 1, used, batch * n, rounds, len(kept) // n
            )  # fmt: skip
        return Rollout(mine, rollout.weights_version, rollout.stats), m

    def score(self, rollout: Rollout, training: bool = True) -> dict[str, float]:
        """Score one generation round's samples and return its reward metrics. A ``training``
        round's responses also count for the step (:meth:`end_step`); ReMax's greedy answers,
        the baseline only, do not."""
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
            a.overlong.buffer,
            a.overlong.penalty_factor,
        )
        learned, members, z = self.score_with_reward_models(samples)
        for s, r, p, lr in zip(samples, results, penalty.tolist(), learned.tolist(), strict=True):
            s.score, s.acc = r.score + p + lr, r.score
        if training:
            self.scored += results
        scores = torch.tensor([s.score for s in samples])
        groups = torch.tensor([s.group for s in samples])
        mixed = groups[informative_groups(scores, groups)]
        m = {
            # Groups whose G rewards are not all equal: the only ones a group baseline learns from.
            "reward/informative_groups": mixed.unique().numel() / max(groups.unique().numel(), 1),
            "reward/overlong_penalty": float(penalty.mean()),
            "critic/score/mean": float(scores.mean()),
            "critic/score/max": float(scores.max()),
            "critic/score/min": float(scores.min()),
            "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
            "reward/failed": float(sum(r.failed > 0 for r in results)),
            "reward/timeouts": float(sum(r.timed_out for r in results)),
        }
        for name in results[0].components:
            m[f"reward/{name}"] = sum(r.components[name] for r in results) / len(results)
        if self.reward_models:
            m["reward/reward_model"] = float(learned.mean())
        if len(self.reward_models) > 1:  # each model's raw score, and how much they disagree
            m.update({f"reward/reward_model_{i}": float(s.mean()) for i, s in enumerate(members)})
            m["reward/reward_model_disagreement"] = float(z.std(0, unbiased=False).mean())
        return m

    def score_with_reward_models(self, samples: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The learned reward ``[B]`` for each (prompt, response): scored on the training devices
        by every reward model (``members``, ``[M, B]``), combined by the ensemble's reduction,
        times reward.reward_model.weight; zeros when there is none. With M > 1 also the members'
        scores standardised with this step's mean and std over every rank (``[M, B]``)."""
        if not self.reward_models:
            return torch.zeros(len(samples)), torch.zeros(0, len(samples)), None
        batch = collate(samples, self.tokenizer.pad_token_id)
        members = torch.stack([rm.forward_outputs(batch).scores.float() for rm in self.reward_models])
        rm = self.cfg.reward.reward_model
        if len(self.reward_models) == 1:
            return members[0] * rm.weight, members, None
        flat = all_reduce_sum(torch.cat(batch_moments(members)).tolist())  # one collective: every rank's scores
        moments = tuple(torch.tensor(flat, dtype=members.dtype).view(3, -1))
        reward = ensemble_reward(members, rm.ensemble_reduce, rm.ensemble_var_coef, rm.ensemble_normalize, moments)
        return reward * rm.weight, members, standardize(members, moments)
