"""Benchmark: one pool that switches (hybrid) vs two pools that don't (split), same GRPO work.

    python -m benchmarks.split_pool [--prompts 16] [--group 8] [--max-tokens 64] [--steps 5]

Both layouts get the same devices (this machine's cores, split evenly) and run the same
synchronous on-policy GRPO step with the project's parts (FSDP2 engine, vLLM rollout, math
reward, GRPO advantage, actor loss):

  hybrid  torchrun with 2 ranks; every rank holds an FSDP2 shard and a vLLM engine, generates
          for half the prompts, trains on its half, then the switch streams the all-gathered
          weights into its own engine (no copy crosses a process boundary).
  split   a trainer process (FSDP2, world size 1) and a rollout process (vLLM), one core each,
          verl-/OpenRLHF-style separate pools: prompts go to the rollout process, completions
          come back, the trainer updates, and the full weights are broadcast over a gloo group
          to the rollout process, which loads them. Nothing switches, but each pool idles while
          the other works.

Per step: generate, reward + update, weight sync, total. Writes results/split_pool.json / .png.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

from benchmarks.common import (
    actor_config,
    figure,
    machine_info,
    model_config,
    rollout_config,
    run_in_session,
    save_figure,
    write_json,
)

HERE = Path(__file__).resolve().parent
RC = rollout_config()


def arm_watchdog(args) -> None:
    """A process of this benchmark that hangs (a peer that died, a port another process took)
    prints every thread's stack to stderr and exits, so the parent reports where it stuck instead
    of waiting for its own timeout with nothing to show."""
    faulthandler.dump_traceback_later(max(30, args.timeout - 30), exit=True)


def exit_if_child_dies(child: subprocess.Popen, done: threading.Event) -> None:
    """The split trainer waits on its rollout process (accept, recv, broadcast); if that process
    dies first, nothing would ever wake it, so a thread ends the trainer with the child's code."""

    def watch():
        code = child.wait()
        if not done.is_set():
            print(f"split: the rollout process exited with code {code} before the trainer finished", file=sys.stderr)
            sys.stderr.flush()
            os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def make_prompts(tok, n: int, step: int) -> list[tuple[list[int], str]]:
    import random

    from hybrid_rl.data import synth_math

    rng = random.Random(1000 + step)
    out = []
    for _ in range(n):
        p = synth_math.make_problem(rng, rng.choice([1, 2, 3]))
        msgs = [{"role": "user", "content": f"{p.question} {synth_math.INSTRUCTION}"}]
        out.append((tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False), str(p.answer)))
    return out


def rl_trainer(ctx, actor, engine, switch, tok, args):
    """The project's own RL trainer over the benchmark's parts: its ``train_on_batch`` (log-probs,
    GRPO advantage, update) is the update of both layouts, not a copy of it."""
    from hydra import compose, initialize_config_dir

    from hybrid_rl.config import register_configs
    from hybrid_rl.trainer.build import RLParts, conf_dir
    from hybrid_rl.trainer.rl import RLTrainer

    register_configs()
    overrides = [
        "+recipe=grpo_math", f"trainer.nproc_per_node={ctx.world_size}", "trainer.resume=none", "logger.backends=[]",
        f"trainer.output_dir={tempfile.mkdtemp(prefix='split-pool-')}", "logger.progress_bar=false",
        f"data.train_batch_size={args.prompts}", f"rollout.n={args.group}", f"rollout.max_response_length={args.max_tokens}",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return RLTrainer(cfg, ctx, RLParts(tok, [], [], [], None, actor, None, None, engine, switch, None, None, None))


def grpo_update(trainer, tok, prompts, completions) -> dict:
    """Score with the math verifier, then the trainer's own update on the scored rollout."""
    from hybrid_rl.batch import Rollout, Sample
    from hybrid_rl.rewards.functions import math_reward

    samples = []
    for g, ((ids, answer), comps) in enumerate(zip(prompts, completions, strict=True)):
        for toks, lps in comps:
            score = math_reward("synth_math", tok.decode(toks, skip_special_tokens=True), answer)
            samples.append(Sample(ids, toks, lps, [1] * len(toks), "stop", g, score=score))
    m = trainer.train_on_batch(Rollout(samples, trainer.switch.engine_version))
    return {"reward": sum(s.score for s in samples) / len(samples), "loss": m["actor/loss"]}


class RemoteEngine:
    """The split layout's trainer-side handle on the rollout engine in the other process: loading
    weights broadcasts them over the gloo group and waits for the engine's acknowledgement, so
    the trainer's own switch stamps the engine's weights version as in the hybrid layout."""

    supports_sleep = False

    def __init__(self, conn, pg) -> None:
        self.conn, self.pg = conn, pg

    def load_weights(self, weights):
        self.conn.send(("sync",))
        for _, t in weights:
            self.pg.broadcast(t.contiguous(), 0).wait()
        if self.conn.recv() != "ok":
            raise RuntimeError("the rollout process did not acknowledge the weights")

    def reset_prefix_cache(self):
        pass  # the rollout process resets its own after loading

    def sleep(self, level=1):
        return False

    def memory_report(self):
        return {}


def completions_of(results) -> list[list[tuple[list[int], list[float]]]]:
    return [[(c.token_ids, c.logprobs) for c in r.completions] for r in results]


# ----------------------------------------------------------------------------- hybrid layout
def hybrid(args) -> None:
    arm_watchdog(args)
    from hybrid_rl.env import setup_process_env

    setup_process_env(threads_per_rank=max(1, (os.cpu_count() or 2) // 2))
    from hybrid_rl.dist import barrier, init_distributed
    from hybrid_rl.engine.builders import build_policy_engine
    from hybrid_rl.engine.fsdp import to_dtype
    from hybrid_rl.hybrid.switch import HybridSwitch
    from hybrid_rl.models.tiny import tiny_model_path
    from hybrid_rl.rollout.base import SamplingSpec
    from hybrid_rl.rollout.vllm_engine import VLLMRollout

    ctx = init_distributed("cpu")
    path = str(tiny_model_path(args.preset))
    actor = build_policy_engine(path, model_config(), actor_config(args.dtype, lr=3e-5), ctx, total_steps=100)
    engine = VLLMRollout(path, RC, args.dtype, seed=ctx.rank, device=ctx.device, max_model_len=512)
    switch = HybridSwitch(actor, engine, sync_dtype=to_dtype(args.dtype), bucket_bytes=64 << 20, device=ctx.device)
    tok = engine.tokenizer
    trainer = rl_trainer(ctx, actor, engine, switch, tok, args)
    steps = []
    for step in range(args.steps + 1):
        barrier()
        t0 = time.perf_counter()
        prompts = make_prompts(tok, args.prompts, step)[ctx.rank :: ctx.world_size]
        spec = SamplingSpec(n=args.group, max_tokens=args.max_tokens, seed=step * 100 + ctx.rank)
        results = engine.generate([p for p, _ in prompts], spec)
        t1 = time.perf_counter()
        switch.to_train()
        m = grpo_update(trainer, tok, prompts, completions_of(results))
        t2 = time.perf_counter()
        switch.to_rollout()
        barrier()
        t3 = time.perf_counter()
        steps.append({"generate": t1 - t0, "update": t2 - t1, "sync": t3 - t2, "total": t3 - t0, **m})
    if ctx.rank == 0:
        Path(args.out).write_text(json.dumps(steps))
    barrier()
    sys.stdout.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- split layout
def split_rollout(args) -> None:
    """The rollout pool: a vLLM engine that generates on request and loads broadcast weights."""
    arm_watchdog(args)
    from hybrid_rl.env import setup_process_env

    setup_process_env(threads_per_rank=max(1, (os.cpu_count() or 2) // 2))
    import torch
    import torch.distributed as dist

    from hybrid_rl.models.tiny import tiny_model_path
    from hybrid_rl.rollout.base import SamplingSpec
    from hybrid_rl.rollout.vllm_engine import VLLMRollout

    engine = VLLMRollout(str(tiny_model_path(args.preset)), RC, args.dtype, seed=1, device=torch.device("cpu"), max_model_len=512)
    conn = Client(("127.0.0.1", args.ctl_port), authkey=b"split")
    store = dist.TCPStore("127.0.0.1", args.pg_port, 2, is_master=False, timeout=datetime.timedelta(seconds=300))
    pg = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=300))
    meta = conn.recv()  # [(name, shape, dtype)] of the full parameters, in send order
    while True:
        msg = conn.recv()
        if msg[0] == "generate":
            _, prompts, step = msg
            spec = SamplingSpec(n=args.group, max_tokens=args.max_tokens, seed=step * 100)
            conn.send(completions_of(engine.generate(prompts, spec)))
        elif msg[0] == "sync":

            def received():
                for name, shape, dtype in meta:
                    t = torch.empty(shape, dtype=getattr(torch, dtype))
                    pg.broadcast(t, 0).wait()
                    yield name, t

            engine.load_weights(received())
            engine.reset_prefix_cache()
            conn.send("ok")
        else:
            break
    sys.stdout.flush()
    os._exit(0)


def split_trainer(args) -> None:
    arm_watchdog(args)
    from hybrid_rl.env import setup_process_env

    setup_process_env(threads_per_rank=max(1, (os.cpu_count() or 2) // 2))
    import torch.distributed as dist

    from hybrid_rl.dist import init_distributed
    from hybrid_rl.engine.builders import build_policy_engine
    from hybrid_rl.engine.fsdp import to_dtype
    from hybrid_rl.models.tiny import tiny_model_path

    # Both listening ports are bound here, before the child starts, so no other process (the
    # rollout's own vLLM engine picks free ports too) can take one between choosing and binding.
    listener = Listener(("127.0.0.1", 0), authkey=b"split")
    ctl_port = listener.address[1]
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=300), wait_for_workers=False)
    pg_port = store.port
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.split_pool",
        "--role",
        "split-rollout",
        "--ctl-port",
        str(ctl_port),
        "--pg-port",
        str(pg_port),
    ]
    cmd += [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in ("preset", "dtype", "group", "max-tokens", "timeout")]
    child = subprocess.Popen(cmd, cwd=HERE.parent)
    done = threading.Event()
    exit_if_child_dies(child, done)
    conn = listener.accept()
    pg = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=300))
    ctx = init_distributed("cpu")  # the trainer's own world of 1
    path = str(tiny_model_path(args.preset))
    actor = build_policy_engine(path, model_config(), actor_config(args.dtype, lr=3e-5), ctx, total_steps=100)
    dt = to_dtype(args.dtype)
    conn.send([(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in actor.iter_full_params(64 << 20, dt)])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    from hybrid_rl.hybrid.switch import HybridSwitch

    switch = HybridSwitch(actor, RemoteEngine(conn, pg), sync_dtype=dt, bucket_bytes=64 << 20, device=ctx.device)
    trainer = rl_trainer(ctx, actor, switch.rollout, switch, tok, args)
    steps = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        prompts = make_prompts(tok, args.prompts, step)
        conn.send(("generate", [p for p, _ in prompts], step))
        comps = conn.recv()
        t1 = time.perf_counter()
        m = grpo_update(trainer, tok, prompts, comps)
        t2 = time.perf_counter()
        switch.to_rollout()
        t3 = time.perf_counter()
        steps.append({"generate": t1 - t0, "update": t2 - t1, "sync": t3 - t2, "total": t3 - t0, **m})
    done.set()
    conn.send(("stop",))
    child.wait(timeout=60)
    Path(args.out).write_text(json.dumps(steps))
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds each layout may run before it is killed")
    ap.add_argument("--role", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ctl-port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--pg-port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        {"hybrid": hybrid, "split-trainer": split_trainer, "split-rollout": split_rollout}[args.role](args)
        return
    common = [
        f"--{k}={getattr(args, k.replace('-', '_'))}"
        for k in ("preset", "dtype", "prompts", "group", "max-tokens", "steps", "timeout")
    ]
    runs = {}
    for layout in ("hybrid", "split"):
        out = Path(tempfile.mkstemp(suffix=".json")[1])
        if layout == "hybrid":
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                "-m",
                "benchmarks.split_pool",
                "--role",
                "hybrid",
            ]
        else:
            cmd = [sys.executable, "-m", "benchmarks.split_pool", "--role", "split-trainer"]
        # its own session: past --timeout the whole layout (torchrun's ranks, the rollout child) is killed
        code, _, err = run_in_session([*cmd, *common, "--out", str(out)], args.timeout, cwd=HERE.parent)
        if code != 0 or out.stat().st_size == 0:
            why = f"killed after {args.timeout} s" if code is None else f"exit code {code}"
            raise SystemExit(f"{layout} failed ({why}):\n{err[-4000:]}")
        runs[layout] = json.loads(out.read_text())[1:]  # step 0 is warm-up
    med = {
        lay: {k: statistics.median(s[k] for s in steps) for k in ("generate", "update", "sync", "total")}
        for lay, steps in runs.items()
    }
    for lay, m in med.items():
        print(
            f"{lay:>6}: step {m['total']:.2f} s = generate {m['generate']:.2f} + update {m['update']:.2f} + sync {m['sync']:.3f}"
        )
    ratio = med["split"]["total"] / med["hybrid"]["total"]
    print(f"split / hybrid step time: {ratio:.2f}x")
    path = write_json(
        "split_pool",
        {
            "benchmark": "split_pool",
            "machine": machine_info(),
            "settings": vars(args),
            "steps": runs,
            "median_s": med,
            "split_over_hybrid": ratio,
        },
    )

    fig, ax = figure((6, 3.4))
    bottom = [0.0, 0.0]
    for k, c in (("generate", "C0"), ("update", "C1"), ("sync", "C3")):
        vals = [med["hybrid"][k], med["split"][k]]
        ax.barh(["hybrid (1 pool, 2 ranks)", "split (2 pools, 1 core each)"], vals, left=bottom, color=c, label=k)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xlabel("seconds per GRPO step (median)")
    ax.set_title(
        f"{args.prompts} prompts x G={args.group} x {args.max_tokens} tokens, {args.preset}: split/hybrid = {ratio:.2f}x",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    print(f"wrote {path} and {save_figure(fig, 'split_pool', grid_axis='x')}")


if __name__ == "__main__":
    main()
