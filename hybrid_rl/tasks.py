"""The tasks at the top: ``trainer.task`` -> a function of ``(cfg, ctx)``; and the builtin models.

A task resolves ``model.path`` (building ``builtin:tiny-sft`` / ``builtin:tiny-rm`` with their
recipes on first use, which runs a whole SFT or reward-model job, so it lives here, above the
trainers) and hands the trainer a local folder. Trainers never resolve paths themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_rl.dist import DistContext, barrier, broadcast_object
from hybrid_rl.env import cache_root
from hybrid_rl.errors import ModelPathError
from hybrid_rl.models.tiny import tiny_model_path
from hybrid_rl.trainer.build import build_rl_parts, check_model_dir, compose_recipe, recipe_cache_key
from hybrid_rl.trainer.evaluate import run_eval
from hybrid_rl.trainer.preference import run_dpo, run_rm
from hybrid_rl.trainer.sft import run_sft

if TYPE_CHECKING:  # annotations only
    from hybrid_rl.config import Config

log = logging.getLogger("hybrid_rl")


def resolve_builtin(path: str, cfg: Config, ctx: DistContext) -> str:
    """A builtin model: ``builtin:tiny`` (random init) or one a recipe builds on first use and caches:
    ``builtin:tiny-sft`` (``model.sft_recipe``) and ``builtin:tiny-rm`` (``rm_math``)."""
    preset = cfg.model.preset
    if path == "builtin:tiny":
        if ctx.is_main:
            tiny_model_path(preset)
        barrier()
        return str(tiny_model_path(preset))
    recipes = {"builtin:tiny-sft": cfg.model.sft_recipe, "builtin:tiny-rm": "rm_math"}
    if path not in recipes:
        raise ModelPathError(f"model path {path!r}: unknown builtin; known: builtin:tiny, {', '.join(recipes)}")
    recipe = recipes[path]
    recipe_cfg = compose_recipe(recipe, preset)
    out = cache_root() / "models" / f"{preset}-{recipe}-{recipe_cache_key(recipe_cfg)}"
    if not (out / "model.safetensors").exists():
        log.info("building %s with the %s recipe (once; cached at %s)", path, recipe, out)
        start = resolve_model_path(recipe_cfg, ctx)
        if recipe_cfg.trainer.task == "rm":
            run_rm(recipe_cfg, ctx, start, export_dir=str(out))
        else:
            run_sft(recipe_cfg, ctx, start, export_dir=str(out))
    barrier()
    return str(out)


def resolve_model_path(cfg: Config, ctx: DistContext) -> str:
    """A local folder for ``model.path``, building the project's own model on first use."""
    path = cfg.model.path
    if path.startswith("builtin:"):
        return resolve_builtin(path, cfg, ctx)
    if cfg.trainer.task == "eval" and (Path(path) / "manifest.json").is_file():
        return path  # a checkpoint: the eval task exports it first
    check_model_dir(path)
    return str(broadcast_object(path))


def run_rl(cfg: Config, ctx: DistContext) -> dict[str, float]:
    from hybrid_rl.trainer.rl import RLTrainer

    rm = cfg.reward.reward_model
    rm_paths = [resolve_builtin(p, cfg, ctx) if p.startswith("builtin:") else p for p in ([rm.path] if rm.path else []) + list(rm.ensemble)]
    trainer = RLTrainer(cfg, ctx, build_rl_parts(cfg, ctx, resolve_model_path(cfg, ctx), rm_paths))
    try:
        return trainer.fit()
    finally:
        trainer.close()


TASKS: dict[str, Callable[[Any, DistContext], Any]] = {
    "rl": run_rl,
    "sft": lambda cfg, ctx: run_sft(cfg, ctx, resolve_model_path(cfg, ctx), evaluate_after=True),
    "dpo": lambda cfg, ctx: run_dpo(cfg, ctx, resolve_model_path(cfg, ctx)),
    "rm": lambda cfg, ctx: run_rm(cfg, ctx, resolve_model_path(cfg, ctx)),
    "eval": lambda cfg, ctx: run_eval(cfg, ctx, resolve_model_path(cfg, ctx)),
}
