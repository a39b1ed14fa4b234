"""Plot a run's ``metrics.jsonl``: ``python -m hybrid_rl.plot RUN_DIR/metrics.jsonl --out curve.png``.

Draws the training reward (raw and a moving average) and every validation metric it finds.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def load(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot(
    rows: list[dict], out: str | Path, title: str = "", keys: tuple[str, ...] = ("critic/score/mean",), window: int = 5
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if not pts:
            continue
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, alpha=0.3, label=f"{key} (per step)")
        avg = [sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]
        ax.plot(xs, avg, label=f"{key} ({window}-step mean)")
    # Validation accuracies (overall and per data source) with one binomial standard error over
    # the problems they count (val/n, val/n/<source>); per-level ones (val/accuracy_level2 ...)
    # stay in the JSONL to keep the figure readable.
    val_keys = sorted({k for r in rows for k in r if VAL_CURVE.match(k) and "_level" not in k})
    if any(VAL_CURVE.match(k).group(2) for k in val_keys):  # per source: the pooled figure mixes the sets
        val_keys = [k for k in val_keys if VAL_CURVE.match(k).group(2)]
    for key in val_keys:
        n_key = "val/n" + (VAL_CURVE.match(key).group(2) or "")
        pts = [(r["step"], r[key], r.get(n_key, r.get("val/n", 0.0))) for r in rows if key in r]
        xs, ys, ns = zip(*pts, strict=True)
        se = [(y * (1 - y) / n) ** 0.5 if n and 0 <= y <= 1 else 0.0 for y, n in zip(ys, ns, strict=True)]
        ax.errorbar(xs, ys, yerr=se, marker="o", capsize=3, label=f"{key} (+-1 s.e.)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# val/accuracy, val/mean@4, val/pass@4 and their per-source forms (group 2: "/<source>" or "").
VAL_CURVE = re.compile(r"^val/(accuracy|mean@\d+|pass@\d+)(/.+)?$")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("metrics")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    print(plot(load(args.metrics), args.out, args.title))


if __name__ == "__main__":
    main()
