"""Held-out evaluation on the rollout engine: greedy accuracy, and pass@k / mean@k when sampling;
the accuracy's standard error, and the paired gain against an earlier evaluation of the same set."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from hybrid_rl.dist import DistContext, all_reduce_sum
from hybrid_rl.rollout.base import RolloutEngine, SamplingSpec, prompt_seed

# (records, spec) -> (texts per record, extra summed stats)
SampleFn = Callable[[list[Any], SamplingSpec], tuple[list[list[str]], dict[str, float]]]


def single_turn_sampler(engine: RolloutEngine, tokenizer: Any) -> SampleFn:
    def sample(records: list[Any], spec: SamplingSpec) -> tuple[list[list[str]], dict[str, float]]:
        out = engine.generate([r.prompt_ids for r in records], spec)
        texts = [[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in g.completions] for g in out]
        length = sum(len(c.token_ids) for g in out for c in g.completions)
        return texts, {"response_length": float(length)}

    return sample


def score_texts(pool: Any, records: list[Any], texts: list[list[str]]) -> list[list[Any]]:
    items = [(r.data_source, t, r.ground_truth, dict(r.extra_info)) for r, ts in zip(records, texts, strict=True) for t in ts]
    flat = pool.score(items)
    out, i = [], 0
    for ts in texts:
        out.append(flat[i : i + len(ts)])
        i += len(ts)
    return out


def correct(scored: Any, accuracy_fn: str) -> bool:
    return scored.components.get(accuracy_fn, scored.score) > 0.5


def evaluate(
    sample: SampleFn,
    records: list[Any],
    pool: Any,
    ctx: DistContext,
    max_tokens: int,
    pass_k: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
    accuracy_fn: str = "math",
    shard: tuple[int, int] | None = None,
    count: bool = True,
) -> tuple[dict[str, float], torch.Tensor]:
    """``val/accuracy`` (greedy) with its binomial standard error ``val/accuracy_se``
    (sqrt(p (1 - p) / n)), ``val/score``, with ``pass_k`` > 0 ``val/pass@k`` and ``val/mean@k``,
    and any per-sample stats the sampler reports (``val/<stat>``, greedy, averaged per prompt).

    Also returns the greedy hits per record, ``[len(records)]`` float 0/1 in ``records`` order and
    the same on every rank, for :func:`paired_gain` against a later evaluation.

    Each rank evaluates records ``shard_rank::shard_size`` (default: its rank over the world);
    counts are summed over the ranks with ``count`` set (one per tensor-parallel group).
    """
    shard_rank, shard_size = shard or (ctx.rank, ctx.world_size)
    mine = records[shard_rank::shard_size]
    # Per difficulty level where records have one (extra_info.level: the synthetic task's):
    # the same keys on every rank, from the whole held-out list.
    levels = sorted({lv for r in records if (lv := level_of(r)) is not None})
    per_level = [f"{k}_level{lv}" for lv in levels for k in ("n", "hits", "meank")]
    base = ["n", "hits", "score", "passk", "meank", *per_level]
    sums = dict.fromkeys(base, 0.0)
    extra: dict[str, float] = {}
    hits = [0.0] * len(records)  # this rank's records only; summed over ranks below
    if mine:
        texts, extra = sample(mine, SamplingSpec(n=1, temperature=0.0, max_tokens=max_tokens, seed=seed))
        scored = score_texts(pool, mine, texts)
        sums["n"] = len(mine)
        sums["hits"] = sum(correct(s[0], accuracy_fn) for s in scored)
        sums["score"] = sum(s[0].score for s in scored)
        for i, (r, s) in enumerate(zip(mine, scored, strict=True)):
            hits[shard_rank + i * shard_size] = float(correct(s[0], accuracy_fn))
            if (lv := level_of(r)) is not None:
                sums[f"n_level{lv}"] += 1
                sums[f"hits_level{lv}"] += correct(s[0], accuracy_fn)
        if pass_k > 0:
            # One seed per held-out prompt (its global index): siblings of different prompts
            # draw independent noise, and the figure does not depend on the number of ranks.
            seeds = [prompt_seed(seed, 1, shard_rank + i * shard_size) for i in range(len(mine))]
            spec = SamplingSpec(n=pass_k, temperature=temperature, max_tokens=max_tokens, seeds=seeds)
            texts_k, _ = sample(mine, spec)
            scored_k = score_texts(pool, mine, texts_k)
            sums["passk"] = sum(any(correct(s, accuracy_fn) for s in group) for group in scored_k)
            sums["meank"] = sum(sum(correct(s, accuracy_fn) for s in group) / pass_k for group in scored_k)
            for r, group in zip(mine, scored_k, strict=True):
                if (lv := level_of(r)) is not None:
                    sums[f"meank_level{lv}"] += sum(correct(s, accuracy_fn) for s in group) / pass_k
    keys = base + sorted(extra)
    # Every rank must pass the same keys: the sampler reports the same stats on every rank.
    mine_sums = [(sums | extra).get(k, 0.0) for k in keys] + hits
    summed = all_reduce_sum([v if count else 0.0 for v in mine_sums])  # one collective
    totals = dict(zip(keys, summed[: len(keys)], strict=True))
    n = max(totals["n"], 1.0)
    acc = totals["hits"] / n
    out = {"val/accuracy": acc, "val/accuracy_se": math.sqrt(acc * (1 - acc) / n), "val/score": totals["score"] / n}
    out["val/n"] = totals["n"]
    out.update({f"val/{k}": totals[k] / n for k in sorted(extra)})
    if pass_k > 0:
        out[f"val/pass@{pass_k}"] = totals["passk"] / n
        out[f"val/mean@{pass_k}"] = totals["meank"] / n
    for lv in levels:
        n_lv = max(totals[f"n_level{lv}"], 1.0)
        out[f"val/accuracy_level{lv}"] = totals[f"hits_level{lv}"] / n_lv
        if pass_k > 0:
            out[f"val/mean@{pass_k}_level{lv}"] = totals[f"meank_level{lv}"] / n_lv
    return out, torch.tensor(summed[len(keys) :], dtype=torch.float32)


def paired_gain(before: torch.Tensor, after: torch.Tensor) -> tuple[float, float]:
    """Accuracy gain on one held-out set and its paired standard error.

    ``before``, ``after``: ``[n]`` per-problem hits (0/1) of two evaluations of the same problems.
    With d_i = after_i - before_i: gain = mean(d), s.e. = std(d) / sqrt(n) (std with n - 1).
    Pairing removes the problems' own difficulty from the noise: on a set where most problems
    are right (or wrong) both times, the s.e. is far below the unpaired sqrt(se_a^2 + se_b^2).
    """
    if before.shape != after.shape or before.dim() != 1:
        raise ValueError(f"paired_gain needs two [n] vectors of the same problems, got {tuple(before.shape)} and {tuple(after.shape)}")
    d = after.double() - before.double()
    n = d.numel()
    if n == 0:
        return 0.0, 0.0
    se = float(d.std(unbiased=True)) / math.sqrt(n) if n > 1 else 0.0
    return float(d.mean()), se


def level_of(record: Any) -> int | None:
    """A held-out record's difficulty level (``extra_info.level``), if it has an integer one."""
    info = getattr(record, "extra_info", None) or {}
    lv = info.get("level") if isinstance(info, dict) else None
    return int(lv) if isinstance(lv, int | float) and not isinstance(lv, bool) else None
