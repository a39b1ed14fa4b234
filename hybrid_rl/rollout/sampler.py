"""GRPO group sampling: G samples per prompt in one request, so the group shares the prompt's KV.

With prefix caching and ``n=G`` the prompt is prefilled once and its KV blocks are shared by
the G siblings: prefill work drops from ``N*G*L`` to about ``N*L`` tokens (only full blocks are
shared, so the last partial block of each prompt is recomputed per sibling).
"""

from __future__ import annotations

from typing import Any

from hybrid_rl.batch import Rollout, Sample
from hybrid_rl.rollout.base import RolloutEngine, SamplingSpec


def sample_groups(
    engine: RolloutEngine,
    prompts: list[Any],
    group_offset: int,
    spec: SamplingSpec,
    weights_version: int,
) -> Rollout:
    """Generate ``spec.n`` responses for each prompt record; one :class:`Sample` per response.

    ``prompts`` are :class:`hybrid_rl.data.dataset.PromptRecord`; sample ``group`` ids are
    ``group_offset + i`` so they are unique across ranks.
    """
    results = engine.generate([p.prompt_ids for p in prompts], spec)
    samples = []
    for i, (record, result) in enumerate(zip(prompts, results, strict=True)):
        for comp in result.completions:
            samples.append(
                Sample(
                    prompt_ids=list(record.prompt_ids),
                    response_ids=list(comp.token_ids),
                    rollout_logprobs=list(comp.logprobs),
                    response_mask=[1] * len(comp.token_ids),
                    finish_reason=comp.finish_reason,
                    group=group_offset + i,
                    ground_truth=record.ground_truth,
                    data_source=record.data_source,
                    extra_info=dict(record.extra_info),
                )
            )
    st = engine.last_stats
    stats = {
        "rollout/prompt_tokens": float(st.prompt_tokens),
        "rollout/prefix_cached_tokens": float(st.cached_prompt_tokens),
        "rollout/prefix_computed_tokens": float(st.computed_prompt_tokens),
        "rollout/generated_tokens": float(st.generated_tokens),
        "rollout/generate_s": st.seconds,
    }
    return Rollout(samples, weights_version, stats)
