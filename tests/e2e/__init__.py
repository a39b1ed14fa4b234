"""End-to-end tests: real runs of ``python -m hybrid_rl.main`` in their own processes."""

import json
from pathlib import Path


def step_rows(out: Path) -> dict[int, dict]:
    """The training steps' rows of a run's metrics.jsonl by step, each step asserted to appear once
    (a resume drops the rows of the steps it redoes)."""
    rows: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "actor/loss" in r:
            assert r["step"] not in rows, f"step {r['step']} logged twice"
            rows[r["step"]] = r
    return rows
