"""Benchmark: rollout throughput, vLLM group sampling vs transformers ``generate``.

    python -m benchmarks.rollout_throughput [--presets tiny,small,base] [--prompts 8] [--group 8] [--max-tokens 64]

The same model, the same N prompts of the synthetic math task (chat template applied), G samples
each, exactly ``max_tokens`` new tokens per sample (EOS ignored in both), temperature 1:
  - vLLM: one ``generate`` with ``n=G`` per prompt (continuous batching, paged KV, prefix cache);
  - transformers: ``model.generate(num_return_sequences=G, do_sample=True)`` on left-padded
    batches of ``--hf-batch`` prompts, SDPA attention, KV cache on.
Both run in one process with all cores. Writes results/rollout_throughput.json and .png.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from benchmarks.common import figure, machine_info, rollout_config, save_figure, write_json


def measure(args, preset: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybrid_rl.data import synth_math
    from hybrid_rl.engine.fsdp import to_dtype
    from hybrid_rl.models.tiny import tiny_model_path
    from hybrid_rl.rollout.base import SamplingSpec
    from hybrid_rl.rollout.vllm_engine import VLLMRollout

    path = str(tiny_model_path(preset))
    tok = AutoTokenizer.from_pretrained(path)
    rng = random.Random(0)
    prompts = []
    for _ in range(args.prompts):
        p = synth_math.make_problem(rng, rng.choice([1, 2, 3]))
        msgs = [{"role": "user", "content": f"{p.question} {synth_math.INSTRUCTION}"}]
        prompts.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    new_tokens = args.prompts * args.group * args.max_tokens

    rc = rollout_config(kv_cache_gib=1.0)
    max_len = max(len(p) for p in prompts) + args.max_tokens
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    engine = VLLMRollout(path, rc, args.dtype, seed=0, device=device, max_model_len=max_len)
    spec = SamplingSpec(n=args.group, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine.generate(prompts[:2], spec)  # warm-up
    vllm_s = []
    for _ in range(args.repeats):
        engine.reset_prefix_cache()
        t = time.perf_counter()
        out = engine.generate(prompts, spec)
        vllm_s.append(time.perf_counter() - t)
        assert sum(len(c.token_ids) for r in out for c in r.completions) == new_tokens
    if device.type == "cuda":
        engine.sleep(2)  # give the HF model the memory back
    del engine

    model = AutoModelForCausalLM.from_pretrained(path, dtype=to_dtype(args.dtype), attn_implementation="sdpa").to(device).eval()
    pad = tok.pad_token_id

    def hf_generate(batch: list[list[int]]) -> int:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = (
            torch.arange(width, device=device)[None] >= torch.tensor([width - len(p) for p in batch], device=device)[:, None]
        ).long()
        with torch.inference_mode():
            y = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=args.group,
                max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens,
                pad_token_id=pad,
            )
        return (y.shape[1] - width) * y.shape[0]

    hf_generate(prompts[:2])  # warm-up
    hf_s = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        n = sum(hf_generate(prompts[i : i + args.hf_batch]) for i in range(0, len(prompts), args.hf_batch))
        hf_s.append(time.perf_counter() - t)
        assert n == new_tokens, (n, new_tokens)
    best_v, best_h = min(vllm_s), min(hf_s)
    return {
        "preset": preset,
        "device": device.type,
        "vllm_seconds": vllm_s,
        "hf_seconds": hf_s,
        "new_tokens": new_tokens,
        "vllm_tokens_per_s": new_tokens / best_v,
        "hf_tokens_per_s": new_tokens / best_h,
        "vllm_over_hf": best_h / best_v,
        "prompt_len_mean": sum(map(len, prompts)) / len(prompts),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,small,base")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16, help="prompts per transformers generate call")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from hybrid_rl.env import setup_process_env

    setup_process_env(threads_per_rank=os.cpu_count() or 1)
    rows = []
    for preset in args.presets.split(","):
        r = measure(args, preset)
        rows.append(r)
        print(
            f"{preset:>8}: vLLM {r['vllm_tokens_per_s']:.0f} tok/s, transformers generate {r['hf_tokens_per_s']:.0f} tok/s: "
            f"{r['vllm_over_hf']:.1f}x (target >= 5x)",
            flush=True,
        )
    payload = {
        "benchmark": "rollout_throughput",
        "machine": machine_info(),
        "settings": vars(args),
        "rows": rows,
        "target_min": 5.0,
    }
    path_json = write_json("rollout_throughput", payload)

    fig, ax = figure((6, 3.6))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["vllm_tokens_per_s"] for r in rows], 0.4, label="vLLM (n=G)")
    ax.bar([x + 0.2 for x in xs], [r["hf_tokens_per_s"] for r in rows], 0.4, label="transformers generate")
    for x, r in zip(xs, rows, strict=True):
        ax.text(x, r["vllm_tokens_per_s"], f"{r['vllm_over_hf']:.1f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [r["preset"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(
        f"Rollout: {args.prompts} prompts x G={args.group} x {args.max_tokens} tokens ({args.dtype}, {rows[0]['device']})",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    print(f"wrote {path_json} and {save_figure(fig, 'rollout_throughput')}")


if __name__ == "__main__":
    main()
