"""Benchmark: where one GRPO update's time goes, and what the levers on it buy.

    python -m benchmarks.profile_update [--preset base] [--ranks 2] [--prompts 8] [--group 8]
                                        [--new-tokens 64] [--dtype auto] [--levers micro,reshard,reduce,adamw,compile,sdpa,rs]

Under real torchrun ranks (gloo, one thread each, as the trainer runs them) each rank builds the
actor of ``+recipe=grpo_math`` on the ``--preset`` model (the default recipe's settings: packing,
shared prefix, fused AdamW, ``micro_batch_size`` 64) and runs the trainer's own update
(``FSDPEngine.train_batch`` with the recipe's GRPO loss) on a GRPO-shaped batch: ``--prompts``
prompts of 30-50 tokens, ``--group`` answers each of 16..``--new-tokens`` tokens, advantages of
+-1, the rows split over the ranks. This is the work of the update phase of one step of
``benchmarks/vs_trl.py`` at the same sizes.

1. Timing: the median of ``--repeats`` updates after a warm-up.
2. Profile: one update under ``torch.profiler`` on rank 0. Every op's self time is put in one
   bucket (``hybrid_rl/trainer/profiling.py``, as ``trainer.profile_steps`` does), the first
   that matches: the optimizer (clip + AdamW, ``hybrid_rl/optimizer``), collectives (FSDP2's
   all-gather / reduce-scatter and their waits, gloo), the log-prob head (``hybrid_rl/logprob_head``:
   the LM head's matmul, log-softmax and entropy, forward and its recompute in backward), attention (SDPA and its backward), GEMMs (mm / addmm / bmm, forward
   and backward), dtype casts and copies, other tensor ops; what is left of the wall time is
   Python and framework overhead. Shares of the update's wall time. ``aten::copy_``, the largest
   op after the GEMMs, is split by caller (:func:`copies_by_caller`).
3. MFU: the update's model FLOPs (``hybrid_rl/engine/flops.py``, the trainer's count) per second
   against the GEMM peak of the compute dtype on the same cores, measured in the same run (a
   2048^3 matmul on all cores), and the matmuls' own rate per rank (the FLOPs over the time the
   profile puts in the GEMM, attention and head buckets).
4. Levers (``--levers``). Those the engine reads at every update are timed against the default
   in interleaved pairs inside the profiled run's processes, free of the drift between runs
   (``interleaved_ab``): ``sdpa`` (``actor.prefix_attention=sdpa`` against the CPU segment
   kernel, ``hybrid_rl/engine/segment_attention.py``), ``reshard``
   (``actor.reshard_after_forward=false``) and ``rs`` (gradients reduce-scattered by an in-place
   all-reduce of FSDP2's scratch buffer, :class:`AllReduceInPlace`, instead of gloo's
   clone-then-all-reduce; a measured lever, not a trainer setting). The others are full re-measurements in their own
   processes: micro-batch sizes, packing and the shared prefix off (what they already save),
   ``actor.reduce_dtype=bfloat16`` (gradients reduce-scattered in bf16), foreach vs fused AdamW,
   ``torch.compile`` of each decoder layer (inductor, the CPU's own kernels; the same batch
   every repeat, so no recompilation is counted).

Writes results/profile_update_<preset>.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import figure, machine_info, save_figure, write_json
from hybrid_rl.trainer.profiling import BUCKETS, busiest_thread, profile_buckets

HERE = Path(__file__).resolve().parent


def make_batch(args, rank: int, world: int, pad_id: int, vocab: int):
    from hybrid_rl.batch import Sample, collate

    rng = random.Random(0)
    samples = []
    for g in range(args.prompts):
        prompt = [rng.randrange(8, vocab) for _ in range(rng.randint(30, 50))]
        for _ in range(args.group):
            r = [rng.randrange(8, vocab) for _ in range(rng.randint(16, args.new_tokens))]
            samples.append(Sample(prompt, r, [0.0] * len(r), [1] * len(r), "stop", g))
    n = len(samples)  # whole groups per rank where the group count divides (the shared prefix then runs once per prompt)
    batch = collate(samples[rank * n // world : (rank + 1) * n // world], pad_id)
    import torch

    sign = torch.tensor([1.0 if (i % 2) else -1.0 for i in range(batch.size)])[:, None]
    batch.advantages = sign * batch.response_mask
    return batch, samples


def worker(args: argparse.Namespace) -> None:
    from hybrid_rl.env import setup_process_env

    setup_process_env(threads_per_rank=max((os.cpu_count() or 1) // args.ranks, 1))
    import torch
    from omegaconf import OmegaConf

    from benchmarks.precision import gemm_peak
    from hybrid_rl.algorithms.losses import agg_weights, make_actor_loss
    from hybrid_rl.config import register_configs, resolve_precision
    from hybrid_rl.config.compose import compose_recipe
    from hybrid_rl.dist import all_reduce_sum, barrier, finish_rank, init_distributed
    from hybrid_rl.engine.builders import build_policy_engine
    from hybrid_rl.engine.flops import DecoderFlops
    from hybrid_rl.models.tiny import tiny_model_path

    ctx = init_distributed("cpu")
    path = str(tiny_model_path(args.preset)) if ctx.rank == 0 else None
    barrier()
    path = str(tiny_model_path(args.preset))
    register_configs()
    cfg = compose_recipe("grpo_math", args.preset)
    OmegaConf.set_struct(cfg, False)
    for k, v in (kv.split("=", 1) for kv in args.set):
        OmegaConf.update(cfg, k, None if v == "null" else v)  # the schema converts the string
    if args.dtype != "auto":
        cfg.actor.param_dtype = None if args.dtype == "float32" else args.dtype
    resolve_precision(cfg, "cpu")  # auto: what the trainer would pick on this CPU
    dtype = str(cfg.actor.param_dtype or "float32")
    actor = build_policy_engine(path, cfg.model, cfg.actor, ctx, total_steps=100)
    if args.compile:
        for layer in actor.module.decoder_layers():
            layer.compile()
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(path)
    batch, samples = make_batch(args, ctx.rank, ctx.world_size, 0, hf.vocab_size)
    n_tok, n_seq = all_reduce_sum([float(batch.response_mask.sum()), float(batch.size)])
    batch.loss_weights = agg_weights(batch.response_mask, cfg.algorithm.loss_agg_mode, n_tok, n_seq, args.new_tokens)
    loss_fn = make_actor_loss(cfg.algorithm)
    flops = DecoderFlops.from_hf_config(hf)
    groups = [s.group for s in samples]
    update_flops = flops.train_shared_prefix([len(s.prompt_ids) for s in samples], [len(s.response_ids) for s in samples], groups)

    def one() -> float:
        barrier()
        t = time.perf_counter()
        actor.train_batch(batch, loss_fn)
        return time.perf_counter() - t

    warm = [one() for _ in range(args.warmup)]
    times = [one() for _ in range(args.repeats)]
    result = {"times_s": times, "warmup_s": warm, "median_s": statistics.median(times), "dtype": dtype, "update_flops": update_flops}
    variants = {"sdpa": ("prefix_kernel", "sdpa"), "reshard": ("reshard_after_forward", False), "rs": ("inplace", True)}
    owners = {"sdpa": actor.module, "reshard": actor, "rs": ReduceScatterLever(actor.module)}
    result["ab"] = {}
    for name in [x for x in args.ab.split(",") if x]:
        owner = owners[name]
        result["ab"][name] = interleaved_ab(one, args.repeats, owner, *variants[name])
    if args.profile:  # the pass an exactly on-policy step skips (actor.recompute_old_logprobs=auto)
        olds = []
        for _ in range(3):
            barrier()
            t = time.perf_counter()
            actor.forward_outputs(batch)
            olds.append(time.perf_counter() - t)
        result["old_logprob_pass_s"] = statistics.median(olds)
        from torch.profiler import ProfilerActivity, profile

        barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wall = one()
        result["profile_wall_s"] = wall
        result["buckets_s"] = profile_buckets(prof, wall)
        result["top_ops"] = [
            {"name": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count}
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        ]
        result["copies_by_caller"] = copies_by_caller(prof)
    if ctx.rank == 0:
        result["threads_per_rank"] = torch.get_num_threads()
        result["gemm_peak_tflops_all_cores"] = gemm_peak(dtype, 2048, 2048, 2048) / 1e12 if args.profile else None
        Path(args.out).write_text(json.dumps(result))
    barrier()
    finish_rank(0)


def copies_by_caller(prof, top: int = 10) -> list[dict]:
    """``aten::copy_``'s self time on the busiest thread, by who called it: the nearest enclosing
    op (``aten::_to_copy`` is a dtype cast, ``aten::split_with_sizes_copy`` FSDP2's all-gather
    copy-out, ...) and the nearest labelled range (``FSDP::all_gather_copy_in``,
    ``FSDP::post_backward_reduce``, ``hybrid_rl/...``). The profiler's own grouping by stack needs
    ``with_stack``, which slows the profiled update; the parents are already recorded."""
    events = prof.profiler.function_events
    main = busiest_thread(events)
    out: dict[str, list[float]] = {}
    for e in events:
        if e.thread != main or e.name != "aten::copy_":
            continue
        op = rng = None
        p = e.cpu_parent
        while p is not None and (op is None or rng is None):
            if op is None and p.name.startswith("aten::") and p.name != "aten::copy_":
                op = p.name
            if rng is None and (p.name.startswith("FSDP::") or p.name.startswith("hybrid_rl/")):
                rng = p.name.split(" (")[0]  # FSDP's ranges carry the module's name
            p = p.cpu_parent
        t = out.setdefault(f"{op or '(direct)'} in {rng or '(no range)'}", [0.0, 0])
        t[0] += e.self_cpu_time_total / 1e6
        t[1] += 1
    rows = sorted(out.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"caller": k, "self_s": v[0], "calls": v[1]} for k, v in rows]


class AllReduceInPlace:
    """An FSDP2 reduce-scatter (``fully_shard``'s ``set_custom_reduce_scatter``) for gloo. gloo's
    ``reduce_scatter_tensor`` clones its whole input, all-reduces the clone and copies this rank's
    chunk out (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``); FSDP2's input is a scratch
    buffer that it frees right after, so all-reducing that buffer in place skips the clone (one
    copy of every layer's full gradient per update). Same result: ``out = chunk_rank(sum_r g_r)``,
    divided by the world size for ``AVG``."""

    def allocate(self, size, *, dtype, device):
        import torch

        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        import torch.distributed as dist

        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # e.g. PREMUL_SUM: gloo's own path
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        dist.all_reduce(input_tensor, op=dist.ReduceOp.SUM, group=group)
        output_tensor.copy_(input_tensor.chunk(group.size())[group.rank()])
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(group.size())
        return None


class ReduceScatterLever:
    """``inplace``: every FSDP2 module under ``root`` reduce-scatters with :class:`AllReduceInPlace`
    (True) or FSDP2's default (False), switchable between updates for :func:`interleaved_ab`."""

    def __init__(self, root) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.modules = [m for m in root.modules() if isinstance(m, FSDPModule)]
        self._inplace = False

    @property
    def inplace(self) -> bool:
        return self._inplace

    @inplace.setter
    def inplace(self, on: bool) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

        self._inplace = on
        for m in self.modules:
            m.set_custom_reduce_scatter(AllReduceInPlace() if on else DefaultReduceScatter())


def interleaved_ab(one, repeats: int, owner, attr: str, variant) -> dict:
    """Updates with ``owner.attr`` as built (the default) and set to ``variant``, in interleaved
    pairs in the same processes, so that the machine's drift (this class of VM runs the same GEMM
    at 1x-3x speed over minutes) falls on both sides of a pair alike. ``ratio``: the median over
    the pairs of the variant's time over the default's (below 1: the variant is faster). Levers
    that the engine reads at every update: ``actor.prefix_attention`` (the module's
    ``prefix_kernel``) and ``actor.reshard_after_forward``."""
    default = getattr(owner, attr)
    a, b = [], []
    for _ in range(max(repeats, 5)):
        for value, xs in ((default, a), (variant, b)):
            setattr(owner, attr, value)
            xs.append(one())
    setattr(owner, attr, default)
    ratios = [y / x for x, y in zip(a, b)]
    return {"setting": f"{attr}={variant}", "default_s": a, "variant_s": b, "pair_ratios": ratios, "ratio": statistics.median(ratios)}


def run(args: argparse.Namespace, extra: list[str], profile: bool = False, compile_layers: bool = False, ab: str = "") -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}", "-m", "benchmarks.profile_update"]
    cmd += ["--worker", "--out", str(out), "--preset", args.preset, "--ranks", str(args.ranks), "--prompts", str(args.prompts)]
    cmd += ["--group", str(args.group), "--new-tokens", str(args.new_tokens), "--dtype", args.dtype, "--repeats", str(args.repeats)]
    cmd += ["--warmup", str(args.warmup + (2 if compile_layers else 0))]
    cmd += (["--profile"] if profile else []) + (["--compile"] if compile_layers else []) + (["--ab", ab] if ab else [])
    cmd += [a for kv in extra for a in ("--set", kv)]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parent, check=False, timeout=3600)
    text = out.read_text()
    out.unlink()
    if p.returncode != 0 or not text:
        return {"error": (p.stderr or p.stdout)[-1500:], "wall_s": time.perf_counter() - t}
    return json.loads(text)


def lever_runs(args: argparse.Namespace) -> list[dict]:
    """One re-measured update per lever setting (``--levers``), against the default settings."""
    rows = []
    levers = [x for x in args.levers.split(",") if x]
    settings: list[tuple[str, list[str], bool]] = []  # (name, overrides, compile)
    if "micro" in levers:
        settings += [(f"micro_batch_size={m}", [f"actor.micro_batch_size={m}"], False) for m in (16, 32)]
        settings += [("packing off", ["actor.packing=false"], False), ("shared prefix off", ["actor.shared_prefix=false"], False)]
    if "reduce" in levers:
        settings.append(("reduce_dtype=bfloat16", ["actor.reduce_dtype=bfloat16"], False))
    if "adamw" in levers:
        settings.append(("AdamW foreach", ["actor.optimizer_impl=foreach"], False))
    if "compile" in levers:
        settings.append(("torch.compile per layer", [], True))
    for name, extra, comp in settings:
        r = run(args, extra, compile_layers=comp)
        r["lever"] = name
        rows.append(r)
        print(f"  {name:>26}: " + (f"{r['median_s']:.3f} s" if "median_s" in r else f"failed: {r['error'][-300:]}"), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="base")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", help="compute dtype: auto (the trainer's choice here) | float32 | bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--levers", default="micro,reshard,reduce,adamw,compile,sdpa,rs")
    ap.add_argument("--name", default="", help="results/<name>.json (default profile_update_<preset>)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ab", default="", help="worker: levers timed against the default in interleaved pairs (sdpa,reshard,rs)")
    ap.add_argument("--set", action="append", default=[], help="worker: a config override key=value")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    levers = args.levers.split(",")
    base = run(args, [], profile=True, ab=",".join(x for x in ("sdpa", "reshard", "rs") if x in levers))
    if "error" in base:
        raise SystemExit(f"profile_update failed:\n{base['error']}")
    report(args, base, lever_runs(args))


def report(args: argparse.Namespace, base: dict, levers: list[dict]) -> None:
    wall = base["profile_wall_s"]
    shares = {k: v / wall for k, v in base["buckets_s"].items()}
    tflops = base["update_flops"] / base["median_s"] / 1e12
    peak = base["gemm_peak_tflops_all_cores"]
    gemm_s = base["buckets_s"]["gemm"] + base["buckets_s"]["attention"] + base["buckets_s"]["logprob_head"]
    result = {
        "median_update_s": base["median_s"],
        "dtype": base["dtype"],
        "update_tflops_per_s": tflops,
        "gemm_peak_tflops": peak,
        "mfu": tflops / peak,
        "target_mfu_min": 0.5,
        "profile_wall_s": wall,
        "buckets_s": base["buckets_s"],
        "shares": shares,
        "matmul_tflops_in_matmul_time": base["update_flops"] / max(gemm_s, 1e-9) / 1e12 / args.ranks,
        "old_logprob_pass_s": base.get("old_logprob_pass_s"),
        "top_ops": base["top_ops"],
        "copies_by_caller": base.get("copies_by_caller"),
        "interleaved_ab": base.get("ab"),
        "levers": [{k: v for k, v in r.items() if k in ("lever", "median_s", "times_s", "warmup_s", "error")} for r in levers],
    }
    for r in result["levers"]:
        if "median_s" in r:
            r["speedup"] = base["median_s"] / r["median_s"]
    name = args.name or f"profile_update_{args.preset}"
    path = write_json(name, {"benchmark": "profile_update", "machine": machine_info(), "settings": vars(args), "result": result})
    print(f"update {base['median_s']:.3f} s ({base['dtype']}), {tflops:.4f} TFLOP/s = {tflops / peak:.0%} of the {peak:.3f} GEMM peak")
    for k in BUCKETS:
        print(f"  {k:>18}: {base['buckets_s'][k]:7.3f} s  {shares[k]:5.1%}")
    for c in result["copies_by_caller"] or []:
        print(f"  copy_ {c['self_s']:6.3f} s over {c['calls']:5d} calls: {c['caller']}")
    for ab in (base.get("ab") or {}).values():
        print(f"  {ab['setting']} (interleaved): {statistics.median(ab['variant_s']):.3f} s vs the default's "
              f"{statistics.median(ab['default_s']):.3f} s, median pair ratio {ab['ratio']:.2f}")
    print(f"wrote {path} and {plot(name, f'{args.preset}, {args.prompts}x{args.group}x{args.new_tokens}', result)}")


def plot(name: str, what: str, result: dict) -> Path:
    """The profile's buckets, the levers re-measured in their own runs, and, when timed, each
    interleaved lever's pair ratios (variant / default; under 1 the variant is faster)."""
    ab = result.get("interleaved_ab") or {}
    fig, axes = figure((16 if ab else 11, 4), ncols=3 if ab else 2)
    a1, a2 = axes[0], axes[1]
    shares = result["shares"]
    a1.barh(list(BUCKETS)[::-1], [shares[k] * 100 for k in BUCKETS][::-1], color="C0")
    a1.set_xlabel("% of the update's wall time (rank 0, profiled)")
    a1.set_title(f"One GRPO update, {what}, {result['dtype']}: MFU {result['mfu']:.0%}", fontsize=9)
    done = [r for r in result["levers"] if "median_s" in r]
    names, secs = ["default"] + [r["lever"] for r in done], [result["median_update_s"]] + [r["median_s"] for r in done]
    a2.barh(names[::-1], secs[::-1], color=["C1"] * (len(names) - 1) + ["C0"])
    a2.set_xlabel("update seconds (median)")
    a2.set_title("Levers, each re-measured in its own run", fontsize=9)
    if ab:
        a3 = axes[2]
        for i, v in enumerate(ab.values()):
            a3.scatter(v["pair_ratios"], [i] * len(v["pair_ratios"]), color="C1", alpha=0.7)
            a3.scatter([v["ratio"]], [i], color="C0", marker="|", s=400)
        a3.axvline(1.0, color="grey", lw=1)
        a3.set_yticks(range(len(ab)), [v["setting"] for v in ab.values()])
        a3.set_ylim(-0.5, len(ab) - 0.5)
        a3.set_xlabel("variant / default time per pair (bar: median)")
        a3.set_title("Levers timed in interleaved pairs in one process", fontsize=9)
    return save_figure(fig, name, grid_axis="x")

if __name__ == "__main__":
    main()
