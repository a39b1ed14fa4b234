"""Benchmark: training throughput on variable-length rollouts, padded vs packed micro-batches,
fixed-size vs dynamic (token-budget) batching.

    python -m benchmarks.train_throughput [--preset tiny] [--rows 64] [--repeats 3]

One FSDP2 engine (world size 1, all cores), one optimizer step per measurement over the same
batch of GRPO-shaped rows: prompts of 20-60 tokens, responses of 8-``--max-response`` tokens
(uniform, the spread a group of sampled answers has). Four layouts:
  padded        micro-batches of ``--micro`` rows, each trimmed to its longest row;
  padded+budget micro-batches balanced by a token budget (verl's dynamic batching);
  packed        the same rows repacked first-fit into fewer rows (padding-free);
  packed+budget both.
Reports real (non-pad) tokens per second; writes results/train_throughput.json and .png.
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.common import actor_config, figure, machine_info, model_config, one_rank_on_all_cores, save_figure, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--max-response", type=int, default=256)
    ap.add_argument("--param-dtype", default="null", help="FSDP2 compute dtype (null = the model's fp32)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    ctx, path, vocab = one_rank_on_all_cores(args.preset)
    from hybrid_rl.batch import Sample, collate
    from hybrid_rl.engine.builders import build_policy_engine
    rng = random.Random(0)
    samples = []
    for g in range(args.rows):
        p = [rng.randrange(8, vocab) for _ in range(rng.randint(20, 60))]
        r = [rng.randrange(8, vocab) for _ in range(rng.randint(8, args.max_response))]
        samples.append(Sample(p, r, [0.0] * len(r), [1] * len(r), "stop", g // 8))
    batch = collate(samples, pad_id=0)
    real_tokens = int(batch.attention_mask.sum())
    n_resp = float(batch.response_mask.sum())

    def loss_fn(out, mb):
        return -(out.logprobs * mb.response_mask).sum() / n_resp * 1e-3, {}

    mc = model_config()
    rows = []
    for name, packing, budget in (
        ("padded", False, 0),
        ("padded+budget", False, args.token_budget),
        ("packed", True, 0),
        ("packed+budget", True, args.token_budget),
    ):
        ac = actor_config(
            lr=1e-6, micro_batch_size=args.micro, max_tokens_per_micro=budget, packing=packing,
            param_dtype=args.param_dtype if args.param_dtype != "null" else None,
        )  # fmt: skip
        engine = build_policy_engine(path, mc, ac, ctx, total_steps=100)
        engine.train_batch(batch, loss_fn)  # warm-up
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            m = engine.train_batch(batch, loss_fn)
            times.append(time.perf_counter() - t)
        # rows the model actually ran on (after repacking), summed over micro-batches
        from hybrid_rl.engine.fsdp import micro_batches
        from hybrid_rl.engine.heads import pack_plan

        mbs = micro_batches(batch, args.micro, budget)
        computed = sum(
            (pack_plan(mb.attention_mask)[3] if packing and mb.size > 1 else mb.size) * mb.input_ids.shape[1] for mb in mbs
        )
        rows.append(
            {
                "layout": name,
                "seconds": times,
                "tokens_per_s": real_tokens / min(times),
                "micro_batches": m["actor/micro_batches"],
                "computed_positions": computed,
                "padding_share": 1 - real_tokens / computed,
            }
        )
        print(
            f"{name:>14}: {real_tokens / min(times):8.0f} tok/s  ({min(times):.2f} s, {int(m['actor/micro_batches'])} micro-batches, {rows[-1]['padding_share']:.0%} padding)",
            flush=True,
        )
        del engine
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["speedup_over_padded"] = r["tokens_per_s"] / base
    result = {"rows": rows, "real_tokens": real_tokens, "target_packed_over_padded_min": 1.5}
    path_json = write_json(
        "train_throughput", {"benchmark": "train_throughput", "machine": machine_info(), "settings": vars(args), "result": result}
    )

    fig, ax = figure((6, 3.6))
    ax.bar([r["layout"] for r in rows], [r["tokens_per_s"] for r in rows], color=["C1", "C1", "C0", "C0"])
    for i, r in enumerate(rows):
        ax.text(
            i,
            r["tokens_per_s"],
            f"{r['speedup_over_padded']:.2f}x\n{r['padding_share']:.0%} pad",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("trained tokens / s (fwd + bwd + step)")
    ax.set_title(f"Training throughput, {args.rows} variable-length rows ({args.preset})", fontsize=9)
    ax.margins(y=0.2)
    print(f"wrote {path_json} and {save_figure(fig, 'train_throughput')}")


if __name__ == "__main__":
    main()
