"""Evaluation as a task (``trainer.task=eval``, ``+recipe=eval_math``): a model folder or a
checkpoint, greedy accuracy and (with ``rollout.val_pass_k``) pass@k / mean@k on
``data.val_files``, each with its standard error and per data source, through the rollout engine
and reward code that training uses. A checkpoint is evaluated on its run's own held-out files,
lengths and reward unless the command line sets them (:mod:`hybrid_rl.trainer.eval_setup`) and
is first exported (:mod:`hybrid_rl.export`). Each eval writes its own folder
(``output_dir/<model>-<time>``): ``eval.json`` and every greedy sample in
``generations/eval.jsonl``."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hybrid_rl.dist import DistContext, all_gather_objects, barrier, broadcast_object
from hybrid_rl.trainer.build import build_rollout_engine, build_tools, load_tokenizer, max_model_len, validation_pool

if TYPE_CHECKING:  # annotations only
    from hybrid_rl.config import Config

log = logging.getLogger("hybrid_rl")


def model_folder(path: str, out_dir: Path, ctx: DistContext) -> str:
    """``path`` itself, or for a checkpoint directory its policy exported to ``out_dir/model``."""
    if not (Path(path) / "manifest.json").is_file():
        return path
    target = out_dir / "model"
    if ctx.is_main:
        from hybrid_rl.export import export_checkpoint

        export_checkpoint(path, target, overwrite=True)  # the eval's own folder: a re-run replaces it
    barrier()
    return str(target)


def standard_errors(metrics: dict[str, float], n: float, pass_k: int) -> dict[str, float]:
    """Binomial s.e. sqrt(p (1 - p) / n) of pass@k and mean@k over the n problems (for mean@k, an
    upper bound: the k samples of a problem average out some of its variance)."""
    keys = [f"val/pass@{pass_k}", f"val/mean@{pass_k}"] if pass_k > 0 else []
    return {f"{k}_se": math.sqrt(max(metrics[k] * (1 - metrics[k]), 0.0) / max(n, 1.0)) for k in keys}


def run_eval(cfg: Config, ctx: DistContext, model_path: str) -> dict[str, float]:
    from hybrid_rl.data.dataset import load_prompts, resolve_files
    from hybrid_rl.trainer.eval_setup import prepare_eval
    from hybrid_rl.trainer.validation import evaluate, single_turn_sampler

    start = time.perf_counter()
    out_dir = Path(broadcast_object(str(prepare_eval(cfg, model_path, ctx.is_main))))
    folder = broadcast_object(model_folder(model_path, out_dir, ctx))
    tok = load_tokenizer(folder, cfg.model.trust_remote_code)
    _, schemas = build_tools(cfg)
    d = cfg.data
    records, report = load_prompts(resolve_files(d.val_files, "val", d.synth), tok, d, d.val_size, tools=schemas)
    if ctx.is_main:
        log.info(report.summary("data.val_files", d.max_prompt_length))
    engine = build_rollout_engine(folder, cfg, ctx, max_model_len(cfg, folder), cfg.trainer.seed)
    pool = validation_pool(cfg.reward, announce=ctx.is_main)
    try:
        r = cfg.rollout
        result = evaluate(single_turn_sampler(engine, tok), records, pool, ctx, r.max_response_length, r.val_pass_k,
                          r.temperature, cfg.trainer.seed, keep_samples=len(records), top_p=r.top_p, top_k=r.top_k)  # fmt: skip
    finally:
        pool.close()
        barrier()
        engine.shutdown()
    metrics = {
        **result.metrics,
        **standard_errors(result.metrics, result.metrics["val/n"], cfg.rollout.val_pass_k),
        **report.metrics("val"),
    }
    metrics["timing_s/eval"] = time.perf_counter() - start
    samples = [s for part in all_gather_objects(result.samples) for s in part]
    if ctx.is_main:
        write_results(out_dir, cfg, model_path, folder, metrics, samples)
    return metrics


def write_results(
    out_dir: Path, cfg: Config, model_path: str, folder: str, metrics: dict[str, float], samples: list[dict]
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {
        "model": model_path, "model_folder": folder, "val_files": list(cfg.data.val_files), "n": metrics["val/n"],
        "pass_k": cfg.rollout.val_pass_k, "temperature": cfg.rollout.temperature, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "metrics": metrics,
    }  # fmt: skip
    (out_dir / "eval.json").write_text(json.dumps(summary, indent=1))
    gen = out_dir / "generations"
    gen.mkdir(exist_ok=True)
    with (gen / "eval.jsonl").open("w", encoding="utf-8") as fh:
        for s in samples:
            fh.write(json.dumps(s, ensure_ascii=False) + "\n")
    log.info(
        "eval: accuracy %.4f +- %.4f on %d problems; %s",
        metrics["val/accuracy"],
        metrics["val/accuracy_se"],
        int(metrics["val/n"]),
        out_dir / "eval.json",
    )
