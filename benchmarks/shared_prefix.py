"""Benchmark: the shared-prefix training forward against the packed one, on GRPO batches.

    python -m benchmarks.shared_prefix [--preset tiny] [--ratios 0.25,0.5,1] [--repeats 3]

One FSDP2 engine (world size 1, all cores), one optimizer step (forward + backward + AdamW) per
measurement over the same batch: ``--groups`` prompts x G=``--n`` responses; responses of
``--response/2 .. --response`` tokens (uniform: the spread of sampled answers), prompts of
``ratio x`` the mean response length. Layouts: ``packed`` (actor.packing, the default: rows
repacked padding-free, each prompt computed once per response) and ``shared_prefix``
(actor.shared_prefix: each prompt computed once per group, packed, attention per segment).
Reports trained tokens per second (prompt + response tokens of every row, the same numerator for
both, the trainer's ``train/tokens_per_s``), the gain, and the largest log-prob difference
between the layouts. Writes results/shared_prefix.json and .png.
"""

from __future__ import annotations

import argparse
import random
import time

from benchmarks.common import actor_config, figure, machine_info, model_config, one_rank_on_all_cores, save_figure, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--ratios", default="0.25,0.5,1")
    ap.add_argument("--param-dtype", default="null", help="FSDP2 compute dtype (null = fp32)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    ctx, path, vocab = one_rank_on_all_cores(args.preset)
    import torch

    from hybrid_rl.batch import Sample, collate
    from hybrid_rl.engine.builders import build_policy_engine
    dtype = None if args.param_dtype == "null" else args.param_dtype
    rows = []
    for ratio in [float(x) for x in args.ratios.split(",")]:
        rng = random.Random(0)
        prompt_len = max(1, round(ratio * 0.75 * args.response))
        samples = []
        for g in range(args.groups):
            prompt = [rng.randrange(8, vocab) for _ in range(prompt_len)]
            for _ in range(args.n):
                r = [rng.randrange(8, vocab) for _ in range(rng.randint(args.response // 2, args.response))]
                samples.append(Sample(prompt, r, [0.0] * len(r), [1] * len(r), "stop", g))
        batch = collate(samples, pad_id=0)
        tokens = int(batch.attention_mask.sum())
        n_resp = float(batch.response_mask.sum())

        def loss_fn(out, mb, n_resp=n_resp):
            return -(out.logprobs * mb.response_mask).sum() / n_resp * 1e-3, {}

        row = {"ratio": ratio, "prompt_len": prompt_len, "tokens": tokens, "rows": batch.size}
        logprobs = {}
        for layout, shared in (("packed", False), ("shared_prefix", True)):
            ac = actor_config(lr=1e-6, micro_batch_size=args.micro, packing=True, shared_prefix=shared, param_dtype=dtype)
            engine = build_policy_engine(path, model_config(), ac, ctx, total_steps=100)
            logprobs[layout] = engine.forward_logprobs(batch)
            engine.train_batch(batch, loss_fn)  # warm-up
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                engine.train_batch(batch, loss_fn)
                times.append(time.perf_counter() - t)
            row[f"{layout}_seconds"] = times
            row[f"{layout}_tokens_per_s"] = tokens / min(times)
            del engine
        row["gain"] = row["shared_prefix_tokens_per_s"] / row["packed_tokens_per_s"]
        # The FLOP share that sharing removes: (G-1)/G of the prompt tokens.
        row["computed_token_share"] = 1 - (args.groups * (args.n - 1) * prompt_len) / tokens
        diff = (logprobs["packed"] - logprobs["shared_prefix"]).abs() * batch.response_mask
        row["max_logprob_diff"] = float(diff.max())
        rows.append(row)
        print(
            f"ratio {ratio}: packed {row['packed_tokens_per_s']:7.0f} tok/s, shared_prefix {row['shared_prefix_tokens_per_s']:7.0f}"
            f" tok/s ({row['gain']:.2f}x; computes {row['computed_token_share']:.0%} of the tokens; max |dlogprob| {row['max_logprob_diff']:.1e})",
            flush=True,
        )
        torch.manual_seed(0)
    result = {"rows": rows}
    path_json = write_json("shared_prefix", {"benchmark": "shared_prefix", "machine": machine_info(), "settings": vars(args), "result": result})
    fig, ax = figure((6.5, 3.8))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["packed_tokens_per_s"] for r in rows], 0.4, label="packed (default)")
    ax.bar([x + 0.2 for x in xs], [r["shared_prefix_tokens_per_s"] for r in rows], 0.4, label="shared_prefix")
    for x, r in zip(xs, rows, strict=True):
        ax.text(x + 0.2, r["shared_prefix_tokens_per_s"], f"{r['gain']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"prompt/response {r['ratio']:g}" for r in rows])
    ax.set_ylabel("trained tokens / s (fwd + bwd + step)")
    ax.set_title(f"GRPO batch {args.groups} x G={args.n}, responses {args.response // 2}-{args.response} tokens ({args.preset})", fontsize=9)
    ax.legend()
    ax.margins(y=0.15)
    print(f"wrote {path_json} and {save_figure(fig, 'shared_prefix')}")


if __name__ == "__main__":
    main()
