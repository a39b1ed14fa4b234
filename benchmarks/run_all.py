"""Run every benchmark with its defaults, one after another (they each use all cores):

    make bench            # or: python -m benchmarks.run_all [--skip vs_trl,...]

Each writes benchmarks/results/<name>.json (machine info, versions, settings, figures) and
<name>.png; this script then writes results/summary.json with the headline ratios against the
targets of the project's benchmark issue.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, load_result, machine_info, write_json

ALL = [
    "switch_overhead",
    "split_pool",
    "prefix_cache",
    "rollout_throughput",
    "train_throughput",
    "shared_prefix",
    "vs_trl",
    "sandbox_latency",
    "checkpoint_cost",
    "preflight",
    "export_memory",
]
ROOT = Path(__file__).resolve().parents[1]


def summary() -> list[dict]:
    rows = []
    if d := load_result("switch_overhead"):
        for r in d["rows"]:
            big = r["hybrid"]["params"] >= 50e6
            rows.append(
                {
                    "figure": f"sync / memcpy floor ({r['preset']}, {r['hybrid']['params'] / 1e6:.0f}M)",
                    "measured": r["sync_over_memcpy"],
                    "target": "<= 3" if big else "(target is for 50M+)",
                    "met": r["sync_over_memcpy"] <= 3 if big else None,
                }
            )
            rows.append(
                {
                    "figure": f"naive / hybrid switch ({r['preset']})",
                    "measured": r["naive_over_switch"],
                    "target": ">= 20",
                    "met": r["naive_over_switch"] >= 20,
                }
            )
    if d := load_result("split_pool"):
        rows.append(
            {
                "figure": "split-pool step / hybrid step (same cores)",
                "measured": d["split_over_hybrid"],
                "target": "(no target)",
                "met": None,
            }
        )
    if d := load_result("prefix_cache"):
        for s in d["summary"]:
            if s["G"] == 8 and s["mode"] == "n=G":
                rows.append(
                    {
                        "figure": f"prefill computed, cache on/off (G=8, L={s['L']})",
                        "measured": s["computed_on_over_off"],
                        "target": "<= 0.1375 (1.1/G)",
                        "met": s["computed_on_over_off"] <= 1.1 / 8,
                    }
                )
    if d := load_result("rollout_throughput"):
        for r in d["rows"]:
            rows.append(
                {
                    "figure": f"vLLM / transformers generate tokens/s ({r['preset']})",
                    "measured": r["vllm_over_hf"],
                    "target": ">= 5",
                    "met": r["vllm_over_hf"] >= 5,
                }
            )
    if d := load_result("train_throughput"):
        r = {x["layout"]: x for x in d["result"]["rows"]}
        rows.append(
            {
                "figure": "packed / padded training tokens/s",
                "measured": r["packed"]["speedup_over_padded"],
                "target": ">= 1.5",
                "met": r["packed"]["speedup_over_padded"] >= 1.5,
            }
        )
        rows.append(
            {
                "figure": "packed+budget / padded training tokens/s",
                "measured": r["packed+budget"]["speedup_over_padded"],
                "target": ">= 1.5",
                "met": r["packed+budget"]["speedup_over_padded"] >= 1.5,
            }
        )
    if d := load_result("shared_prefix"):
        for r in d["result"]["rows"]:
            rows.append({"figure": f"shared-prefix / packed training tokens/s (prompt/response {r['ratio']:g})",
                         "measured": r["gain"], "target": "(measured)", "met": None})  # fmt: skip
    for path in sorted(RESULTS.glob("vs_trl_*.json")):
        d = load_result(path.stem)
        s = d["settings"]
        target = s["preset"] == "base"  # the 3x is for the 101M preset
        for k, v in d["trl_over_hybrid"].items():
            rows.append({"figure": f"{d['trl_reference']} step / {k} step ({s['preset']}, {s['max_tokens']} tokens)",
                         "measured": v, "target": ">= 3" if target else "(target is for 101M)",
                         "met": v >= 3 if target else None})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip", default="", help="comma-separated benchmark names to leave out")
    ap.add_argument("--only", default="", help="comma-separated benchmark names to run")
    args = ap.parse_args()
    names = [n for n in (args.only.split(",") if args.only else ALL) if n and n not in args.skip.split(",")]
    seconds = {}
    for name in names:
        print(f"== {name}", flush=True)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", f"benchmarks.{name}"], cwd=ROOT, check=True)
        seconds[name] = time.perf_counter() - t
    rows = summary()
    for r in rows:
        mark = {True: "met", False: "MISSED", None: "-"}[r["met"]]
        print(f"{r['figure']:<55} {r['measured']:8.3f}  target {r['target']:<22} {mark}")
    write_json("summary", {"machine": machine_info(), "seconds": seconds, "rows": rows})


if __name__ == "__main__":
    main()
