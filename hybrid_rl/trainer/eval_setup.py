"""What an evaluation of a checkpoint evaluates on, and where it writes.

A checkpoint records the resolved config of the run that wrote it (``manifest.json``'s
``config``). Evaluating it should measure what that run measured: its held-out files, its prompt
and response lengths, its prompt settings and its reward, not the defaults of the ``eval_math``
recipe (the builtin task at the default lengths). So every setting in :data:`INHERITED` that the
command line did not set is taken from the recorded config, and the eval says which.

Each evaluation writes its own folder, ``<output_dir>/<model>-<time>`` (``outputs/eval_math/
my_run-step_000100-20261207-193000``), so a second eval never overwrites the first; an explicit
``trainer.output_dir=`` on the command line is used as it is.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

log = logging.getLogger("hybrid_rl")

# Settings that decide which held-out problems are asked, how, for how long, and how answers score.
INHERITED = (
    "data.val_files",
    "data.prompt_key",
    "data.answer_key",
    "data.max_prompt_length",
    "data.truncation",
    "data.system_prompt",
    "data.synth",
    "rollout.max_response_length",
    "reward.functions",
    "reward.timeout_s",
    "reward.failure_score",
    "model.trust_remote_code",
)


def command_line_keys() -> set[str]:
    """The config keys set on this run's command line (Hydra's task overrides), without ``+``/``~``."""
    from hydra.core.hydra_config import HydraConfig

    try:
        overrides = HydraConfig.get().overrides.task
    except ValueError:  # not under @hydra.main (a direct call from code or a test)
        return set()
    return {o.split("=", 1)[0].lstrip("+~").strip("'\"") for o in overrides}


def _given(key: str, keys: set[str]) -> bool:
    return any(k == key or k.startswith(key + ".") or key.startswith(k + ".") for k in keys)


def recorded_config(checkpoint: str | Path) -> dict[str, Any] | None:
    """The resolved config a checkpoint's run recorded, or None (a model folder, an older checkpoint)."""
    manifest = Path(checkpoint) / "manifest.json"
    if not manifest.is_file():
        return None
    return json.loads(manifest.read_text()).get("config")


def inherit_run_settings(cfg: Any, checkpoint: str | Path, given: set[str]) -> list[str]:
    """Copy each :data:`INHERITED` setting not in ``given`` from the checkpoint's recorded config
    into ``cfg`` (in place); returns ``key=value`` for each one that changed."""
    recorded = recorded_config(checkpoint)
    if not recorded:
        return []
    source = OmegaConf.create(recorded)
    taken = []
    for key in INHERITED:
        if _given(key, given) or OmegaConf.select(source, key, default="<missing>") == "<missing>":
            continue
        value = OmegaConf.select(source, key)
        if OmegaConf.select(cfg, key) != value:
            OmegaConf.update(cfg, key, value, merge=True)  # merge: a typed node validates the recorded value
            shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            taken.append(f"{key}={shown}")
    return taken


def eval_folder(output_dir: str, model_path: str, given: set[str]) -> Path:
    """``output_dir`` when the command line set it, else a new ``output_dir/<model>-<time>``."""
    base = Path(output_dir)
    if "trainer.output_dir" in given:
        return base
    path = Path(model_path)
    label = f"{path.parent.parent.name}-{path.name}" if (path / "manifest.json").is_file() else path.name
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") or "model"
    out = base / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while out.exists():  # two evals in one second
        n += 1
        out = base / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    return out


def prepare_eval(cfg: Any, model_path: str, is_main: bool) -> Path:
    """Take the checkpoint's run settings into ``cfg`` and choose the eval's folder (rank 0's
    choice is what the caller broadcasts); says both on rank 0."""
    given = command_line_keys()
    taken = inherit_run_settings(cfg, model_path, given)
    out = eval_folder(cfg.trainer.output_dir, model_path, given)
    if is_main:
        if taken:
            log.info("eval: from the run that wrote %s (set on the command line to change): %s", model_path, "; ".join(taken))
        log.info("eval: results go to %s", out)
    return out
