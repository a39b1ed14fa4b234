"""The memory model: device bytes per rank in training and in rollout mode, from a model's shape
and the GPU recipe's settings (``conf/recipe/grpo_math_gpu.yaml``). Arithmetic only; the GPU
check (``benchmarks/gpu_train_check.py``) measures the same phases on the 0.5B / 1.5B shapes.

    python -m benchmarks.memory_model            # markdown table (README) + results/memory_model.json

Per rank, N ranks (FSDP2 data parallel, one vLLM engine per rank, tensor parallel 1), P params:

train mode
    master weights fp32       4 P / N
    gradients fp32            4 P / N      (actor.grad_accumulation=sharded; unsharded: 4 P)
    AdamW moments fp32        8 P / N
    gathered bf16 params      2 (2 L_p + E)   two decoder layers in flight (prefetch) + embedding/head
    activations               T_m h L 2 (checkpointed layer inputs, bf16)
                              + T_m (8 h + 3 I) 2 (one layer recomputed in backward)
    log-prob head             3 C V 4       (chunk of C tokens: logits, softmax, grad; fp32)
    vLLM asleep (level 1)     0             (KV cache freed, weights offloaded to host)
rollout mode
    master weights fp32       4 P / N       (the actor stays; its optimizer state is on the host)
    vLLM                      u M           (gpu_memory_utilization x device memory: bf16 weights
                                             2 P, its activations, the rest is KV cache)
    KV cache per token        2 L n_kv d 2  (K and V, bf16)

T_m = actor.max_tokens_per_micro, C = actor.logprob_chunk, L layers, h hidden, I intermediate,
V vocabulary, n_kv KV heads of width d, E = V h (x2 if the head is not tied), L_p one layer's params.
Not counted: the CUDA context (~0.5 GiB) and allocator fragmentation.
"""

from __future__ import annotations

import json

from benchmarks.common import write_json

GiB = 2**30

# Qwen2.5 shapes (config.json of the released checkpoints).
SHAPES = {
    "Qwen2.5-0.5B": dict(h=896, inter=4864, layers=24, heads=14, kv=2, vocab=151936, tied=True),
    "Qwen2.5-1.5B": dict(h=1536, inter=8960, layers=28, heads=12, kv=2, vocab=151936, tied=True),
    "Qwen2.5-7B": dict(h=3584, inter=18944, layers=28, heads=28, kv=4, vocab=152064, tied=False),
}
# conf/recipe/grpo_math_gpu.yaml
RECIPE = dict(max_tokens_per_micro=16384, logprob_chunk=1024, gpu_memory_utilization=0.5, device_gib=80)


def params(s: dict) -> tuple[int, int, int]:
    """(total, one decoder layer, embedding + head) parameter counts."""
    d = s["h"] // s["heads"]
    attn = s["h"] * s["h"] * 2 + s["h"] * s["kv"] * d * 2 + s["h"] + 2 * s["kv"] * d  # q,o + k,v (+ biases)
    mlp = 3 * s["h"] * s["inter"]
    layer = attn + mlp + 2 * s["h"]
    emb = s["vocab"] * s["h"] * (1 if s["tied"] else 2)
    return layer * s["layers"] + emb + s["h"], layer, emb


def per_rank(name: str, n: int, accumulation: str = "sharded") -> dict:
    s = SHAPES[name]
    p, layer, emb = params(s)
    tm, c = RECIPE["max_tokens_per_micro"], RECIPE["logprob_chunk"]
    d = s["h"] // s["heads"]
    train = {
        "weights_fp32": 4 * p / n,
        "grads_fp32": 4 * p / n if accumulation == "sharded" else 4 * p,
        "adam_fp32": 8 * p / n,
        "gathered_bf16": 2 * (2 * layer + emb),
        "activations": tm * s["h"] * s["layers"] * 2 + tm * (8 * s["h"] + 3 * s["inter"]) * 2,
        "logprob_head": 3 * c * s["vocab"] * 4,
    }
    vllm_budget = RECIPE["gpu_memory_utilization"] * RECIPE["device_gib"] * GiB
    kv_per_token = 2 * s["layers"] * s["kv"] * d * 2
    rollout = {"weights_fp32": 4 * p / n, "vllm_total": vllm_budget}
    kv_bytes = vllm_budget - 2 * p - 1 * GiB  # ~1 GiB of vLLM activations / graphs
    return {
        "model": name,
        "params": p,
        "ranks": n,
        "train": train,
        "train_total": sum(train.values()),
        "rollout": rollout,
        "rollout_total": sum(rollout.values()),
        "vllm_weights_bf16": 2 * p,
        "kv_bytes_per_token": kv_per_token,
        "kv_cache_tokens": int(kv_bytes / kv_per_token),
    }


def table(rows: list[dict]) -> str:
    g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
    head = (
        "| model | GPUs | weights fp32 | grads | AdamW | gathered bf16 | activations | log-prob head | **train** | "
        "vLLM (bf16 weights / KV tokens) | **rollout** |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        t = r["train"]
        lines.append(
            f"| {r['model']} | {r['ranks']} | {g(t['weights_fp32'])} | {g(t['grads_fp32'])} | {g(t['adam_fp32'])} | "
            f"{g(t['gathered_bf16'])} | {g(t['activations'])} | {g(t['logprob_head'])} | **{g(r['train_total'])}** | "
            f"{g(r['rollout']['vllm_total'])} ({g(r['vllm_weights_bf16'])} / {r['kv_cache_tokens'] / 1e6:.1f}M) | "
            f"**{g(r['rollout_total'])}** |"
        )
    return "\n".join(lines)


def main() -> None:
    rows = [per_rank(m, n) for m in SHAPES for n in (1, 8)]
    write_json("memory_model", {"recipe": RECIPE, "rows": rows})
    print(f"GiB per rank, GPU recipe (max_tokens_per_micro={RECIPE['max_tokens_per_micro']}, bf16 compute, "
          f"gpu_memory_utilization={RECIPE['gpu_memory_utilization']} of {RECIPE['device_gib']} GB):\n")  # fmt: skip
    print(table(rows))
    print(json.dumps({r["model"]: r["params"] for r in rows[::2]}))


if __name__ == "__main__":
    main()
