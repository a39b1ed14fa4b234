"""Preference data: (prompt, chosen, rejected) pairs and ranked lists, from parquet/jsonl files,
or generated on the synthetic task from the SFT model (correct vs incorrect answers).

Row schema (parquet or jsonl)::

    prompt:    chat messages [{role, content}, ...] or a string
    chosen:    the preferred response (string)             -- pairs
    rejected:  the other response (string)                 -- pairs
    responses: [response, ...]  and  ranks: [int, ...]     -- ranked lists (rank 0 = best; ties allowed)

Errors name the file, the row and the field.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybrid_rl.data.dataset import DataError, PromptSettings, encode_prompt, read_rows, row_messages
from hybrid_rl.env import cache_root


@dataclass
class PreferenceExample:
    prompt_ids: list[int]
    responses: list[list[int]]  # [chosen, rejected] for pairs; K responses for lists
    ranks: list[int]  # [0, 1] for pairs
    source: str


def _response_ids(tokenizer: Any, text: Any, where: str, field: str) -> list[int]:
    if not isinstance(text, str) or not text.strip():
        raise DataError(f"{where}: {field} must be a non-empty string")
    return tokenizer(text + (tokenizer.eos_token or ""), add_special_tokens=False)["input_ids"]


def load_preferences(files: list[Path], tokenizer: Any, cfg: PromptSettings, kind: str = "pairs", limit: int = 0) -> list[PreferenceExample]:
    """Pairs (``kind="pairs"``) or ranked lists (``kind="lists"``) from ``files``."""
    out: list[PreferenceExample] = []
    for path in files:
        for i, row in enumerate(read_rows(path)):
            if limit and len(out) >= limit:
                return out
            where = f"{path}: row {i}"
            messages = row_messages(row, cfg.prompt_key, where, cfg.system_prompt)
            prompt_ids = encode_prompt(tokenizer, messages)
            if len(prompt_ids) > cfg.max_prompt_length:
                if cfg.truncation == "error":
                    raise DataError(f"{where}: prompt is {len(prompt_ids)} tokens, over data.max_prompt_length")
                continue
            if kind == "pairs":
                for key in ("chosen", "rejected"):
                    if key not in row:
                        raise DataError(f"{where}: missing {key!r}; a preference pair needs prompt, chosen, rejected")
                resp = [
                    _response_ids(tokenizer, row["chosen"], where, "chosen"),
                    _response_ids(tokenizer, row["rejected"], where, "rejected"),
                ]
                out.append(PreferenceExample(prompt_ids, resp, [0, 1], where))
            else:
                texts, ranks = row.get("responses"), row.get("ranks")
                if not isinstance(texts, list) or not isinstance(ranks, list) or len(texts) != len(ranks) or len(texts) < 2:
                    raise DataError(f"{where}: a ranked list needs 'responses' and 'ranks' of equal length >= 2")
                resp = [_response_ids(tokenizer, t, where, f"responses[{j}]") for j, t in enumerate(texts)]
                out.append(PreferenceExample(prompt_ids, resp, [int(r) for r in ranks], where))
    if not out:
        raise DataError(f"no usable preference rows in {', '.join(map(str, files))}")
    return out


def build_synthetic_preferences(
    model_path: str,
    engine: Any,
    tokenizer: Any,
    prompts: list[Any],
    pool: Any,
    samples: int,
    list_size: int,
    seed: int,
    pairs_per_prompt: int = 1,
) -> list[dict]:
    """Rows from the model's own answers: for each prompt, ``samples`` answers scored by the math
    verifier; a pair takes one correct (chosen) and one incorrect (rejected) answer, up to
    ``pairs_per_prompt`` distinct pairs per prompt; a ranked list takes ``list_size`` answers,
    correct ones ranked 0 and incorrect ones 1 (the same list on each of a prompt's rows).
    Prompts whose answers are all right or all wrong give no row."""
    from hybrid_rl.rollout.base import SamplingSpec

    rng = random.Random(seed)
    results = engine.generate([p.prompt_ids for p in prompts], SamplingSpec(n=samples, temperature=1.0, max_tokens=64, seed=seed))
    items, owners = [], []
    for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
        for c in r.completions:
            items.append((p.data_source, tokenizer.decode(c.token_ids, skip_special_tokens=True), p.ground_truth, {}))
            owners.append(i)
    scored = pool.score(items)
    by_prompt: dict[int, list[tuple[str, bool]]] = {}
    for owner, item, s in zip(owners, items, scored, strict=True):
        by_prompt.setdefault(owner, []).append((item[1], s.score > 0.5))
    rows = []
    for i, answers in by_prompt.items():
        good = sorted({t for t, ok in answers if ok})
        bad = sorted({t for t, ok in answers if not ok})
        if not good or not bad:
            continue
        combos = [(g, b) for g in good for b in bad]
        rng.shuffle(combos)
        k_good = min(len(good), max(1, list_size // 2))
        picks = [(t, 0) for t in rng.sample(good, k_good)] + [(t, 1) for t in rng.sample(bad, min(len(bad), list_size - k_good))]
        if len(picks) < list_size:
            continue
        rng.shuffle(picks)
        for chosen, rejected in combos[:pairs_per_prompt]:
            rows.append(
                {
                    "prompt": prompts[i].messages,
                    "chosen": chosen,
                    "rejected": rejected,
                    "responses": [t for t, _ in picks],
                    "ranks": [r for _, r in picks],
                    "data_source": prompts[i].data_source,
                }
            )
    return rows


def split_by_prompt(rows: list[dict], val_fraction: float) -> tuple[list[dict], list[dict]]:
    """(train, val) with every prompt's rows on one side only (no prompt leaks into validation)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(json.dumps(r["prompt"], sort_keys=True), []).append(r)
    keys = list(groups)
    n_val = max(1, int(len(keys) * val_fraction))
    return [r for k in keys[n_val:] for r in groups[k]], [r for k in keys[:n_val] for r in groups[k]]


def synthetic_preference_dir(model_path: str, settings: dict) -> Path:
    """Cache folder for the preference set built from ``model_path`` with ``settings``."""
    key = json.dumps([str(Path(model_path).resolve()), settings], sort_keys=True)
    return cache_root() / "data" / f"synth_pref-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
