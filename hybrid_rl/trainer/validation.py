"""Held-out evaluation on the rollout engine: greedy accuracy, and pass@k / mean@k when sampling."""

from __future__ import annotations

from typing import Any

from hybrid_rl.dist import DistContext, all_reduce_sum
from hybrid_rl.rollout.base import RolloutEngine, SamplingSpec


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
    engine: RolloutEngine,
    records: list[Any],
    pool: Any,
    tokenizer: Any,
    ctx: DistContext,
    max_tokens: int,
    pass_k: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
    accuracy_fn: str = "math",
) -> dict[str, float]:
    """``val/accuracy`` (greedy), ``val/score``, and with ``pass_k`` > 0 ``val/pass@k`` and ``val/mean@k``.

    Each rank evaluates records ``rank::world``; counts are summed over ranks.
    """
    mine = records[ctx.rank :: ctx.world_size]
    sums = [0.0] * 6  # n, correct, score, length, passk_hits, meank_correct
    if mine:
        greedy = engine.generate(
            [r.prompt_ids for r in mine], SamplingSpec(n=1, temperature=0.0, max_tokens=max_tokens, seed=seed)
        )
        texts = [[tokenizer.decode(g.completions[0].token_ids, skip_special_tokens=True)] for g in greedy]
        scored = score_texts(pool, mine, texts)
        sums[0] = len(mine)
        sums[1] = sum(correct(s[0], accuracy_fn) for s in scored)
        sums[2] = sum(s[0].score for s in scored)
        sums[3] = sum(len(g.completions[0].token_ids) for g in greedy)
        if pass_k > 0:
            sampled = engine.generate(
                [r.prompt_ids for r in mine],
                SamplingSpec(n=pass_k, temperature=temperature, max_tokens=max_tokens, seed=seed + 1),
            )
            texts = [[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in g.completions] for g in sampled]
            scored_k = score_texts(pool, mine, texts)
            sums[4] = sum(any(correct(s, accuracy_fn) for s in group) for group in scored_k)
            sums[5] = sum(sum(correct(s, accuracy_fn) for s in group) / pass_k for group in scored_k)
    n, hits, score, length, passk, meank = all_reduce_sum(sums)
    n = max(n, 1.0)
    out = {"val/accuracy": hits / n, "val/score": score / n, "val/response_length": length / n, "val/n": n}
    if pass_k > 0:
        out[f"val/pass@{pass_k}"] = passk / n
        out[f"val/mean@{pass_k}"] = meank / n
    return out
