"""What the policy wrote, where a person can read it (verl's ``log_val_generations`` /
``rollout_data_dir``, TRL's ``log_completions``): the first ``logger.generations`` samples of
every validation and of every ``logger.generations_every``-th training step, as
``generations/{val,train}_step_XXXX.jsonl`` (prompt, response, score, ground truth, data source;
for training samples also their group and advantage) and as TensorBoard text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybrid_rl.batch import Rollout, TrainBatch


class GenerationLog:
    def __init__(self, out_dir: Path, n: int, every: int, logger: Any, enabled: bool) -> None:
        self.dir, self.n, self.every, self.logger = out_dir / "generations", n, every, logger
        self.enabled = enabled and n > 0

    def train_due(self, step: int) -> bool:
        return self.enabled and self.every > 0 and step % self.every == 0

    def write(self, kind: str, step: int, rows: list[dict[str, Any]]) -> None:
        """``rows`` (at most ``n`` are kept) to ``generations/<kind>_step_XXXX.jsonl`` and TensorBoard."""
        if not self.enabled or not rows:
            return
        rows = rows[: self.n]
        self.dir.mkdir(parents=True, exist_ok=True)
        with (self.dir / f"{kind}_step_{step:04d}.jsonl").open("w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        text = "\n\n".join(
            f"**score {r['score']:.3g}** (truth: `{r['ground_truth']}`, {r['data_source']})\n\n"
            f"prompt: {r['prompt']}\n\nresponse: {r['response']}"
            for r in rows
        )  # fmt: skip
        self.logger.log_text(step, f"generations/{kind}", text)


def rollout_rows(rollout: Rollout, tokenizer: Any, n: int, batch: TrainBatch | None = None) -> list[dict[str, Any]]:
    """The first ``n`` samples of a scored rollout, decoded (tool output included, as the model
    saw it); with its ``batch`` after the advantages, also each sample's ``group`` (samples of one
    prompt share it) and ``advantage`` (at its first response token: the sample's advantage for
    the outcome estimators, the first token's for GAE and REINFORCE++), and what the loss trains on
    (``trained_tokens``, and ``untrained``: the text of the response tokens the loss mask leaves
    out, a multi-turn rollout's tool output)."""
    rows = []
    for i, s in enumerate(rollout.samples[:n]):
        row = {
            "prompt": tokenizer.decode(s.prompt_ids, skip_special_tokens=True),
            "response": tokenizer.decode(s.response_ids, skip_special_tokens=True),
            "score": s.score,
            "ground_truth": str(s.ground_truth),
            "data_source": s.data_source,
        }
        if batch is not None and batch.advantages is not None:
            row.update(group=int(batch.group_ids[i]), advantage=float(batch.advantages[i, 0]), response_tokens=len(s.response_ids))
            row.update(_masked(s.response_ids, batch.response_mask[i], tokenizer))
        rows.append(row)
    return rows


def _masked(response_ids: list[int], mask: Any, tokenizer: Any) -> dict[str, Any]:
    """The batch's own loss mask over one response (``mask``: [R] float, padded past the
    response): how many tokens it trains on and the decoded text of those it does not."""
    keep = [m > 0 for m in mask[: len(response_ids)].tolist()]
    left_out = [t for t, k in zip(response_ids, keep, strict=True) if not k]
    return {"trained_tokens": sum(keep), "untrained": tokenizer.decode(left_out, skip_special_tokens=False)}
