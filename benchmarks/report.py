"""Markdown tables from benchmarks/results/*.json, as the README shows them.

python -m benchmarks.report            # every section whose JSON exists
python -m benchmarks.report switch     # one section
"""

from __future__ import annotations

import sys

from benchmarks.common import load_result


def switch(d: dict) -> str:
    out = []
    for r in d["rows"]:
        h, n = r["hybrid"], r["naive"]
        ms = lambda x: f"{x * 1e3:.0f} ms" if x >= 0.01 else f"{x * 1e3:.1f} ms"  # noqa: E731
        out.append(
            f"| {r['preset']} | {h['params'] / 1e6:.0f}M | {h['param_bytes'] / 2**20:.0f} | {ms(h['memcpy_floor']['median_s'])} | "
            f"{ms(h['gather_only']['median_s'])} | {ms(h['vllm_load_only']['median_s'])} | {ms(h['phases_median_s']['to_rollout/sync_weights'])} | "
            f"{r['sync_over_memcpy']:.0f}x | {ms(h['to_rollout_median_s'] + h['to_train_median_s'])} | "
            f"{n['total_s']:.2f} s ({n['save_s']:.2f} + {n['engine_start_s']:.2f} + {n['first_token_s']:.2f}) | {r['naive_over_switch']:.1f}x |"
        )
    return "\n".join(out)


def split(d: dict) -> str:
    m = d["median_s"]
    rows = ["| layout | step | generate | reward + update | weight sync |", "|---|---|---|---|---|"]
    for lay, name in (("hybrid", "hybrid: 1 pool, 2 ranks"), ("split", "split: 2 pools, 1 core each")):
        x = m[lay]
        rows.append(f"| {name} | {x['total']:.2f} s | {x['generate']:.2f} s | {x['update']:.2f} s | {x['sync'] * 1e3:.0f} ms |")
    s = d["settings"]
    rows.append("")
    rows.append(
        f"{s['prompts']} prompts x G={s['group']} x {s['max_tokens']} tokens, {s['preset']} model: the split layout's step is "
        f"**{d['split_over_hybrid']:.2f}x** the hybrid one's."
    )
    return "\n".join(rows)


def prefix(d: dict) -> str:
    rows = []
    summ = d["summary"]
    for length in sorted({s["L"] for s in summ}):
        cells = []
        for g in (2, 4, 8, 16, 32):
            s = next((x for x in summ if x["L"] == length and x["G"] == g and x["mode"] == "n=G"), None)
            cells.append(f"{s['computed_on_over_off']:.3f}" if s else "-")
        t = next((x for x in summ if x["L"] == length and x["G"] == 32 and x["mode"] == "n=G"), None)
        rows.append(f"| L={length} | " + " | ".join(cells) + f" | {t['time_off_over_on']:.1f}x |" if t else "")
    rows.append("| 1/G (seed account) | 0.500 | 0.250 | 0.125 | 0.063 | 0.031 | |")
    return "\n".join(rows)


def rollout(d: dict) -> str:
    rows = ["| model | vLLM tok/s | transformers tok/s | ratio |", "|---|---|---|---|"]
    for r in d["rows"]:
        rows.append(f"| {r['preset']} | {r['vllm_tokens_per_s']:.0f} | {r['hf_tokens_per_s']:.0f} | {r['vllm_over_hf']:.1f}x |")
    return "\n".join(rows)


def train(d: dict) -> str:
    rows = ["| layout | tokens/s | micro-batches | padding computed | vs padded |", "|---|---|---|---|---|"]
    for r in d["result"]["rows"]:
        rows.append(
            f"| {r['layout']} | {r['tokens_per_s']:.0f} | {r['micro_batches']:.0f} | {r['padding_share']:.0%} | {r['speedup_over_padded']:.2f}x |"
        )
    return "\n".join(rows)


def trl(d: dict) -> str:
    rows = ["| run | s/step (median of steps 2-N) | TRL / this |", "|---|---|---|"]
    for k, v in d["median_step_s"].items():
        rows.append(
            f"| {k} | {v:.2f} | {d['trl_over_hybrid'][k]:.2f}x |" if k in d["trl_over_hybrid"] else f"| {k} | {v:.2f} | |"
        )
    return "\n".join(rows)


def sandbox(d: dict) -> str:
    rows = ["| concurrent calls | median | p90 | runs/s |", "|---|---|---|---|"]
    for r in d["rows"]:
        rows.append(f"| {r['concurrency']} | {r['median_s'] * 1e3:.0f} ms | {r['p90_s'] * 1e3:.0f} ms | {r['runs_per_s']:.1f} |")
    rows.append(f"| plain `python3 -c`, no sandbox | {d['bare_python_median_s'] * 1e3:.0f} ms | | |")
    return "\n".join(rows)


def summary(d: dict) -> str:
    mark = {True: "met", False: "**missed**", None: ""}
    return "\n".join(f"| {r['figure']} | {r['measured']:.3g} | {r['target']} | {mark[r['met']]} |" for r in d["rows"])


SECTIONS = {
    "summary": summary,
    "switch": switch,
    "split": split,
    "prefix": prefix,
    "rollout": rollout,
    "train": train,
    "trl": trl,
    "sandbox": sandbox,
}
FILES = {
    "summary": "summary",
    "switch": "switch_overhead",
    "split": "split_pool",
    "prefix": "prefix_cache",
    "rollout": "rollout_throughput",
    "train": "train_throughput",
    "trl": "vs_trl",
    "sandbox": "sandbox_latency",
}


def main() -> None:
    names = sys.argv[1:] or list(SECTIONS)
    for name in names:
        d = load_result(FILES[name])
        if d is not None:
            print(f"<!-- {name} -->\n{SECTIONS[name](d)}\n")


if __name__ == "__main__":
    main()
