"""Held-out evaluation on the rollout engine: greedy accuracy, and pass@k / mean@k when sampling;
the accuracy's standard error, and the paired gain against an earlier evaluation of the same set."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

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


class Evaluation(NamedTuple):
    metrics: dict[str, float]  # val/...
    hits: torch.Tensor  # [n records] greedy 0/1, in record order, the same on every rank
    samples: list[dict[str, Any]]  # the first greedy samples of this rank's shard (keep_samples)


def breakdowns(record: Any) -> list[str]:
    """The subsets a held-out record is reported in: its ``data_source`` (``val/accuracy/<source>``,
    verl's per-data-source figures) and, where it has an integer ``extra_info.level`` (the
    synthetic task's), its level (``val/accuracy_level<k>``) and its level within its source
    (``val/accuracy/<source>_level<k>``)."""
    source = getattr(record, "data_source", "")
    out = [f"/{source}"] if source else []
    if (lv := level_of(record)) is not None:
        out += [f"_level{lv}"] + ([f"/{source}_level{lv}"] if source else [])
    return out


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
    keep_samples: int = 0,
    top_p: float = 1.0,
    top_k: int = -1,
) -> Evaluation:
    """``val/accuracy`` (greedy) with its binomial standard error ``val/accuracy_se``
    (pass@k is sampled as training samples: at ``temperature``, ``top_p`` and ``top_k``)
    (sqrt(p (1 - p) / n)), ``val/score``, with ``pass_k`` > 0 ``val/pass@k`` and ``val/mean@k``,
    each per data source and level too (:func:`breakdowns`), and any per-sample stats the
    sampler reports (``val/<stat>``, greedy, averaged per prompt).

    Also returns the greedy hits per record, ``[len(records)]`` float 0/1 in ``records`` order and
    the same on every rank, for :func:`paired_gain` against a later evaluation, and the first
    ``keep_samples`` greedy samples of this rank's shard (prompt, response, score, ground truth,
    data source) for the generation logs.

    Each rank evaluates records ``shard_rank::shard_size`` (default: its rank over the world);
    counts are summed over the ranks with ``count`` set (one per tensor-parallel group).
    """
    shard_rank, shard_size = shard or (ctx.rank, ctx.world_size)
    mine = records[shard_rank::shard_size]
    # The same keys on every rank, from the whole held-out list.
    subsets = sorted({b for r in records for b in breakdowns(r)})
    base = ["n", "hits", "score", "passk", "meank", *[f"{k}{b}" for b in subsets for k in ("n", "hits", "meank", "passk")]]
    sums = dict.fromkeys(base, 0.0)
    extra: dict[str, float] = {}
    hits = [0.0] * len(records)  # this rank's records only; summed over ranks below
    kept: list[dict[str, Any]] = []
    if mine:
        texts, extra = sample(mine, SamplingSpec(n=1, temperature=0.0, max_tokens=max_tokens, seed=seed))
        kept = _count_greedy(mine, texts, score_texts(pool, mine, texts), accuracy_fn, (shard_rank, shard_size), sums, hits, keep_samples)
        if pass_k > 0:
            spec = SamplingSpec(n=pass_k, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens)
            sums.update(_pass_at_k(sample, mine, pool, spec, seed, accuracy_fn, shard_rank, shard_size, sums))
    keys = base + sorted(extra)
    # Every rank must pass the same keys: the sampler reports the same stats on every rank.
    mine_sums = [(sums | extra).get(k, 0.0) for k in keys] + hits
    summed = all_reduce_sum([v if count else 0.0 for v in mine_sums])  # one collective
    totals = dict(zip(keys, summed[: len(keys)], strict=True))
    return Evaluation(
        _summary(totals, subsets, sorted(extra), pass_k), torch.tensor(summed[len(keys) :], dtype=torch.float32), kept
    )


def _count_greedy(
    mine: list[Any], texts: list[list[str]], scored: list[list[Any]], accuracy_fn: str, shard: tuple[int, int],
    sums: dict[str, float], hits: list[float], keep_samples: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """Add this shard's greedy answers to ``sums`` (per breakdown) and ``hits`` (at each record's
    global index); returns the first ``keep_samples`` as generation rows."""
    kept = []
    for i, (r, s) in enumerate(zip(mine, scored, strict=True)):
        hit = float(correct(s[0], accuracy_fn))
        hits[shard[0] + i * shard[1]] = hit
        for b in ["", *breakdowns(r)]:
            sums[f"n{b}"] += 1
            sums[f"hits{b}"] += hit
        sums["score"] += s[0].score
        if i < keep_samples:
            kept.append(_sample_row(r, texts[i][0], s[0].score))
    return kept


def _sample_row(record: Any, response: str, score: float) -> dict[str, Any]:
    messages = getattr(record, "messages", None)
    prompt = messages[-1]["content"] if messages else ""
    return {
        "prompt": prompt,
        "response": response,
        "score": score,
        "ground_truth": str(record.ground_truth),
        "data_source": record.data_source,
    }


def _pass_at_k(sample, mine, pool, spec, seed, accuracy_fn, shard_rank, shard_size, sums) -> dict[str, float]:
    # One seed per held-out prompt (its global index): siblings of different prompts
    # draw independent noise, and the figure does not depend on the number of ranks.
    seeds = [prompt_seed(seed, 1, shard_rank + i * shard_size) for i in range(len(mine))]
    k = spec.n
    texts_k, _ = sample(mine, dataclasses.replace(spec, seeds=seeds))
    out = {key: sums[key] for key in sums if key.startswith(("meank", "passk"))}
    for r, group in zip(mine, score_texts(pool, mine, texts_k), strict=True):
        right = sum(correct(s, accuracy_fn) for s in group)
        for b in ["", *breakdowns(r)]:
            out[f"meank{b}"] += right / k
            out[f"passk{b}"] += right > 0
    return out


def _summary(totals: dict[str, float], subsets: list[str], extra: list[str], pass_k: int) -> dict[str, float]:
    n = max(totals["n"], 1.0)
    acc = totals["hits"] / n
    out = {"val/accuracy": acc, "val/accuracy_se": math.sqrt(acc * (1 - acc) / n), "val/score": totals["score"] / n}
    out["val/n"] = totals["n"]
    out.update({f"val/{k}": totals[k] / n for k in extra})
    if pass_k > 0:
        out[f"val/pass@{pass_k}"] = totals["passk"] / n
        out[f"val/mean@{pass_k}"] = totals["meank"] / n
    for b in subsets:
        out[f"val/n{b}"] = totals[f"n{b}"]
        n_b = max(totals[f"n{b}"], 1.0)
        out[f"val/accuracy{b}"] = acc_b = totals[f"hits{b}"] / n_b
        out[f"val/accuracy_se{b}"] = math.sqrt(acc_b * (1 - acc_b) / n_b)
        if pass_k > 0:
            out[f"val/mean@{pass_k}{b}"] = totals[f"meank{b}"] / n_b
            out[f"val/pass@{pass_k}{b}"] = totals[f"passk{b}"] / n_b
    return out


def paired_gain(before: torch.Tensor, after: torch.Tensor) -> tuple[float, float]:
    """Accuracy gain on one held-out set and its paired standard error.

    ``before``, ``after``: ``[n]`` per-problem hits (0/1) of two evaluations of the same problems.
    With d_i = after_i - before_i: gain = mean(d), s.e. = std(d) / sqrt(n) (std with n - 1).
    Pairing removes the problems' own difficulty from the noise: on a set where most problems
    are right (or wrong) both times, the s.e. is far below the unpaired sqrt(se_a^2 + se_b^2).
    """
    if before.shape != after.shape or before.dim() != 1:
        raise ValueError(
            f"paired_gain needs two [n] vectors of the same problems, got {tuple(before.shape)} and {tuple(after.shape)}"
        )
    d = after.double() - before.double()
    n = d.numel()
    if n == 0:
        return 0.0, 0.0
    se = float(d.std(unbiased=True)) / math.sqrt(n) if n > 1 else 0.0
    return float(d.mean()), se


def gains_by_source(records: list[Any], before: torch.Tensor, after: torch.Tensor) -> dict[str, float]:
    """``val/gain/<source>`` and ``val/gain_se/<source>``: :func:`paired_gain` over each data
    source's records alone (``records`` in the order of the hit vectors), where there are several."""
    sources = [getattr(r, "data_source", "") for r in records]
    out: dict[str, float] = {}
    if len(set(sources)) < 2:
        return out
    for source in sorted(set(sources) - {""}):
        idx = torch.tensor([i for i, s in enumerate(sources) if s == source])
        out[f"val/gain/{source}"], out[f"val/gain_se/{source}"] = paired_gain(before[idx], after[idx])
    return out


def level_of(record: Any) -> int | None:
    """A held-out record's difficulty level (``extra_info.level``), if it has an integer one."""
    info = getattr(record, "extra_info", None) or {}
    lv = info.get("level") if isinstance(info, dict) else None
    return int(lv) if isinstance(lv, int | float) and not isinstance(lv, bool) else None
