"""The training side of the GPU check, without vLLM: run under torchrun on the GPU node.

    python3 -m torch.distributed.run --standalone --nproc-per-node=1 benchmarks/gpu_train_check.py \
        --out $OUT --presets qwen0.5b,qwen1.5b

For each preset (random-init models in Qwen2.5's shapes, built locally; no hub): FSDP2 over NCCL
with sharded (meta-device) init, bf16 compute with fp32 master weights and AdamW state, the
chunked log-prob head on the 151,936-row vocabulary against the naive full ``log_softmax`` (values
and peak memory), one training step at a fixed micro-batch, the optimizer / reference offload of
the switch (bytes moved, memory after), and the transformers rollout backend (bf16): a weight
push from the FSDP shards and a generate. Peak device memory is read per phase
(``torch.cuda.max_memory_allocated``, reset before each). Writes ``gpu_train_<preset>.json``.

It also runs on CPU (``--device cpu --presets micro``) so the script itself is tested where CI runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from hybrid_rl.env import setup_process_env


def _mem(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        import resource

        return {"host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    return {
        "allocated_gib": torch.cuda.memory_allocated(device) / 2**30,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "reserved_gib": torch.cuda.memory_reserved(device) / 2**30,
    }


class Phases:
    """Times and peak memory per named phase."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.out = device, {}

    def __call__(self, name: str):
        phases = self

        class _Phase:
            def __enter__(self):
                if phases.device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(phases.device)
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                if phases.device.type == "cuda":
                    torch.cuda.synchronize()
                phases.out[name] = {"seconds": time.perf_counter() - self.t, **_mem(phases.device)}

        return _Phase()


def random_batch(vocab: int, rows: int, prompt: int, response: int, pad_id: int, seed: int):
    from hybrid_rl.batch import Sample, collate

    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(rows):
        p = torch.randint(3, vocab, (prompt,), generator=g).tolist()
        r = torch.randint(3, vocab, (response,), generator=g).tolist()
        samples.append(Sample(p, r, [0.0] * response, [1] * response, "length", i // 4))
    return collate(samples, pad_id)


def check_preset(preset: str, ctx, args) -> dict:
    from safetensors import safe_open

    from hybrid_rl.algorithms.losses import agg_weights, make_sft_loss
    from hybrid_rl.config import ActorConfig, ModelConfig, RolloutConfig
    from hybrid_rl.dist import barrier
    from hybrid_rl.engine.builders import build_policy_engine
    from hybrid_rl.engine.heads import logprobs_and_entropy
    from hybrid_rl.hybrid.switch import HybridSwitch
    from hybrid_rl.models.tiny import tiny_model_path
    from hybrid_rl.rollout.backends import build_backend
    from hybrid_rl.rollout.base import SamplingSpec

    dev = ctx.device
    if ctx.is_main:
        tiny_model_path(preset, max_len=args.prompt + args.response + 64)
    barrier()
    path = str(tiny_model_path(preset, max_len=args.prompt + args.response + 64))
    cfg = json.loads((Path(path) / "config.json").read_text())
    res: dict = {"preset": preset, "world_size": ctx.world_size, "device": str(dev), "vocab_size": cfg["vocab_size"]}
    ph = Phases(dev)
    actor_cfg = ActorConfig(
        lr=1e-6, param_dtype=args.param_dtype, micro_batch_size=args.micro_batch, gradient_checkpointing=True,
        logprob_chunk=1024, packing=False,
    )  # fmt: skip
    with ph("init_sharded"):
        actor = build_policy_engine(path, ModelConfig(attn_implementation="sdpa", sharded_init=True), actor_cfg, ctx, 10)
    res["params"] = sum(p.numel() for p in actor.module.parameters())
    res["master_dtypes"] = sorted({str(p.dtype) for p in actor.module.parameters()})
    # The shards hold the checkpoint's values (sharded init read the right rows).
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        name = "model.layers.0.mlp.down_proj.weight"
        full = dict(actor.module.named_parameters())[f"lm.{name}"].detach().full_tensor().cpu()
        res["sharded_init_max_abs_diff"] = float((full - f.get_tensor(name).float()).abs().max())

    # Chunked head vs the naive full log_softmax on the real vocabulary (fp32 and memory).
    w = dict(actor.module.named_parameters())["lm.model.embed_tokens.weight"].full_tensor().detach()
    n_tok = args.rows * args.response
    h = torch.randn(n_tok, w.shape[1], device=dev) * 0.5
    tgt = torch.randint(0, w.shape[0], (n_tok,), device=dev)
    with ph("head_chunked"):
        hc = h.clone().requires_grad_(True)
        lp_c, _ = logprobs_and_entropy(hc, w, tgt, 1.0, 1024)
        lp_c.sum().backward()
    with ph("head_naive"):
        hn = h.clone().requires_grad_(True)
        lp_n = torch.log_softmax((hn @ w.T).float(), -1).gather(-1, tgt[:, None]).squeeze(-1)
        lp_n.sum().backward()
    res["head_tokens"] = n_tok
    res["head_max_abs_diff"] = float((lp_c - lp_n).abs().max())
    res["head_grad_max_abs_diff"] = float((hc.grad - hn.grad).abs().max())
    del h, hc, hn, lp_c, lp_n, w

    batch = random_batch(min(cfg["vocab_size"], 512), args.rows, args.prompt, args.response, 0, ctx.rank)
    batch.loss_weights = agg_weights(
        batch.response_mask, "token-mean", float(batch.response_mask.sum()) * ctx.world_size, args.rows
    )
    before = {n: p.to_local().detach().clone() for n, p in actor.module.named_parameters()}
    steps = []
    for i in range(args.steps):
        with ph(f"train_step_{i}"):
            m = actor.train_batch(batch, make_sft_loss())
        steps.append({"loss": m["actor/loss"], "grad_norm": m["actor/grad_norm"]})
    res["train_steps"] = steps
    changed = sum(int(not torch.equal(before[n], p.to_local())) for n, p in actor.module.named_parameters())
    res["params_changed_fraction"] = changed / len(before)
    states = [v for s in actor.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    res["adam_state_dtypes"] = sorted({str(v.dtype) for v in states})
    res["train_tokens_per_step"] = int(batch.attention_mask.sum()) * ctx.world_size
    del before

    ref = build_policy_engine(path, ModelConfig(attn_implementation="sdpa"), actor_cfg, ctx, 1, trainable=False)
    engine = build_backend(
        "hf", path, RolloutConfig(max_num_seqs=256), args.rollout_dtype, 0, dev, args.prompt + args.response + 64
    )
    switch = HybridSwitch(actor, engine, sync_dtype=getattr(torch, args.rollout_dtype), bucket_bytes=256 << 20,
                          device=dev, idle={"ref": ref})  # fmt: skip
    with ph("to_rollout"):
        switch.policy_updated()
        rep = switch.to_rollout()
    res["to_rollout"] = {"seconds": rep.seconds, "moved_bytes": rep.moved_bytes}
    prompts = [list(range(5, 5 + args.prompt)) for _ in range(args.gen_prompts)]
    with ph("generate"):
        out = engine.generate(prompts, SamplingSpec(n=args.gen_n, max_tokens=args.gen_tokens, temperature=1.0, seed=1))
    res["generated_tokens"] = sum(len(c.token_ids) for g in out for c in g.completions)
    res["generate_tokens_per_s"] = res["generated_tokens"] / ph.out["generate"]["seconds"]
    with ph("to_train"):
        rep = switch.to_train()
    res["to_train"] = {"seconds": rep.seconds, "moved_bytes": rep.moved_bytes, "freed": rep.freed}
    res["phases"] = ph.out
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results/gpu"))
    ap.add_argument("--presets", default="qwen0.5b,qwen1.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--param-dtype", default="bfloat16")
    ap.add_argument("--rollout-dtype", default="bfloat16")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--gen-prompts", type=int, default=8)
    ap.add_argument("--gen-n", type=int, default=4)
    ap.add_argument("--gen-tokens", type=int, default=128)
    args = ap.parse_args()
    setup_process_env(threads_per_rank=int(os.environ.get("OMP_NUM_THREADS", "2")))
    from hybrid_rl.dist import finish_rank, init_distributed

    ctx = init_distributed(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ok = True
    for preset in args.presets.split(","):
        try:
            res = check_preset(preset, ctx, args)
        except Exception as e:  # one preset failing (e.g. out of memory) still leaves the others' results
            import traceback

            res = {"preset": preset, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            ok = False
        if ctx.is_main:
            (out / f"gpu_train_{preset}.json").write_text(json.dumps(res, indent=1))
            print(json.dumps({k: v for k, v in res.items() if k not in ("phases", "traceback")}), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    finish_rank(0 if ok else 1)


if __name__ == "__main__":
    main()
