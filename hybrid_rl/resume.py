"""What a checkpoint was made from, and whether a run may resume from it (no torch here).

A checkpoint's ``manifest.json`` records the model it was made from (:func:`model_identity`) and
the run's resolved config. Before anything starts, :func:`resume_problems` finds the checkpoint
``trainer.resume`` would load and compares:

- another model (path, builtin preset or warm-start recipe, or a ``config.json`` that changed) is
  refused: its tensors would not fit, or would silently continue a different model's optimizer;
- settings whose checkpointed state would override the new value (the optimizer and its LR
  schedule), or that change what the checkpoint holds (a critic) or where the data position points
  (files, which rows are kept and how they read, batch size, order) are refused, with the reason;
- any other change is printed and the run goes on (steps, validation, sampling, loss settings...).

``trainer.resume``: ``auto`` (the newest checkpoint of ``output_dir``, if any), ``never`` (start
over; ``none`` is the same), ``must`` (fail if there is none) or a checkpoint directory.

A run that starts from step 0 in an ``output_dir`` holding an earlier run's results first moves
them to ``<output_dir>/previous/<time>/`` (:func:`set_aside_earlier_run`): otherwise its metrics
would follow the old ones in ``metrics.jsonl`` and a later ``resume=auto`` could pick the old
run's newer checkpoint over its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

MANIFEST = "manifest.json"

# Keys whose new value a resume cannot honour, and why.
REFUSED = {
    "actor.lr": "the optimizer and LR schedule come from the checkpoint (the new value would be silently ignored)",
    "actor.betas": "the optimizer comes from the checkpoint",
    "actor.weight_decay": "the optimizer comes from the checkpoint",
    "actor.warmup_steps": "the LR schedule comes from the checkpoint",
    "actor.lr_schedule": "the LR schedule comes from the checkpoint",
    "actor.min_lr_ratio": "the LR schedule comes from the checkpoint",
    "actor.optimizer_impl": "the optimizer comes from the checkpoint",
    "critic.enable": "the checkpoint holds (or lacks) a critic",
    "actor.lora.rank": "the checkpoint holds adapters of another rank (or the full model)",
    "actor.lora.target_modules": "the checkpoint holds adapters for other layers",
    "actor.lora.alpha": "the adapters were trained at another scale",
    "critic.lr": "the critic's optimizer comes from the checkpoint",
    "critic.lora.rank": "the checkpoint holds a critic with adapters of another rank (or the full critic)",
    "critic.lora.target_modules": "the checkpoint holds critic adapters for other layers",
    "critic.lora.alpha": "the critic's adapters were trained at another scale",
    "data.train_files": "the data position in the checkpoint refers to the old files",
    "data.train_size": "the data position in the checkpoint refers to the old rows",
    "data.train_batch_size": "the data position in the checkpoint counts batches of the old size",
    "data.shuffle": "the data position in the checkpoint refers to the old order",
    "data.seed": "the data position in the checkpoint refers to the old order",
    # What decides which rows are kept (too-long prompts are skipped) and what a kept row reads:
    # another value would index other prompts from the same data position.
    "data.max_prompt_length": "it decides which prompts are kept, so the data position in the checkpoint would index other rows",
    "data.truncation": "it decides which prompts are kept, so the data position in the checkpoint would index other rows",
    "data.system_prompt": "prompts are rendered with it (and their length decides which are kept): the data position in the checkpoint refers to the old prompts",
    "data.prompt_key": "the prompts come from another column: the data position in the checkpoint refers to the old prompts",
    "rollout.agent.enable": "the tools' descriptions are part of every prompt (and its length decides which are kept): the data position in the checkpoint refers to the old prompts",
    "rollout.agent.tool_config": "the tools' descriptions are part of every prompt (and its length decides which are kept): the data position in the checkpoint refers to the old prompts",
    # The generated task's training split (refused only when it is what the run trains on).
    "data.synth.n_train": "the generated training split changes, so the data position in the checkpoint would index other problems",
    "data.synth.seed": "the generated training split changes, so the data position in the checkpoint would index other problems",
    "data.synth.levels": "the generated training split changes, so the data position in the checkpoint would index other problems",
    "data.synth.heldout_fraction": "the generated training split changes, so the data position in the checkpoint would index other problems",
}
# Prefixes of REFUSED keys that matter only when the checkpoint's run trained on the generated task.
SYNTH_KEYS = "data.synth."
# Parts of a model's identity that are not the model: compared only when the checkpoint has them.
PROMPT_IDENTITY = {
    "chat_template_sha256": "the model's chat template changed: prompts render to other tokens and the data position in the "
    "checkpoint would index other rows",
}
# Keys that differ between runs without changing what is trained (never reported).
IGNORED = ("trainer.resume", "trainer.output_dir", "trainer.run_name", "logger.", "trainer.nproc_per_node", "trainer.profile_steps")


def list_checkpoints(root: str | Path) -> list[Path]:
    """Valid checkpoints (with a manifest whose files are all there), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("step_") and (p / MANIFEST).is_file():
            try:
                manifest = json.loads((p / MANIFEST).read_text())
            except (json.JSONDecodeError, OSError):
                continue
            if all((p / name).is_file() for name in manifest.get("files", [])):
                found.append(p)
    return sorted(found, key=lambda p: p.name)


class ModelSettings(Protocol):
    """What names the model a run trains (the ``model`` config has it)."""

    path: str
    preset: str
    sft_recipe: str


class ResumeSettings(Protocol):
    """Where the run keeps its checkpoints and which one it resumes (the ``trainer`` config has it)."""

    resume: str
    output_dir: str


class RunSettings(Protocol):
    """The two sections resuming reads (the root config has them); this module sits below the config."""

    model: ModelSettings
    trainer: ResumeSettings


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = list_checkpoints(root)
    return ckpts[-1] if ckpts else None


def model_identity(model_cfg: ModelSettings) -> dict[str, str]:
    """The model a run trains: a builtin by its preset (and warm-start recipe), a local folder by
    its absolute path, a hash of its ``config.json`` (architecture, sizes, vocabulary) and one of
    its chat template (what every prompt is rendered with)."""
    path = str(model_cfg.path)
    if path.startswith("builtin:"):
        ident = {"path": path, "preset": str(model_cfg.preset)}
        if path == "builtin:tiny-sft":
            ident["sft_recipe"] = str(model_cfg.sft_recipe)
        return ident
    config = Path(path) / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else "missing"
    return {"path": str(Path(path).resolve()), "config_sha256": digest, "chat_template_sha256": chat_template_digest(Path(path))}


def chat_template_digest(folder: Path) -> str:
    """A hash of the chat template(s) a model folder's tokenizer renders prompts with: the
    ``chat_template.jinja`` / ``chat_template.json`` files and ``tokenizer_config.json``'s
    ``chat_template`` ("missing" when there is none)."""
    parts = [(folder / name).read_bytes() for name in ("chat_template.jinja", "chat_template.json") if (folder / name).is_file()]
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):  # no (readable) tokenizer_config.json: preflight says so
        template = None
    if template:
        parts.append(json.dumps(template, sort_keys=True).encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16] if parts else "missing"


def checkpoint_to_resume(cfg: RunSettings) -> Path | None:
    """The checkpoint ``trainer.resume`` names for this run, or None to start over."""
    mode = str(cfg.trainer.resume)
    if mode in ("never", "none"):
        return None
    if mode in ("auto", "must"):
        return latest_checkpoint(Path(cfg.trainer.output_dir) / "checkpoints")
    return Path(mode)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def config_changes(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """``key -> (saved, current)`` for every resolved setting that differs (ignoring run bookkeeping)."""
    a, b = _flat(saved), _flat(current)
    keys = sorted(k for k in set(a) | set(b) if not k.startswith(IGNORED) and not k.startswith("hydra"))
    # "auto" (precision, device) is resolved when the run starts; the checkpoint holds what it became.
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k) and b.get(k) != "auto"}


def resume_problems(cfg: RunSettings, resolved: dict) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of resuming this RL run: problems refuse it (exit 2), notes are the
    changed settings it goes on with. ``resolved`` is the run's config as a plain dict."""
    mode = str(cfg.trainer.resume)
    path = checkpoint_to_resume(cfg)
    if path is None:
        return (["trainer.resume=must: no checkpoint in " + str(Path(cfg.trainer.output_dir) / "checkpoints")] if mode == "must" else []), []
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        return [f"trainer.resume={mode}: {str(path)!r} is not a finished checkpoint (no {MANIFEST})"], []
    manifest = json.loads(manifest_file.read_text())
    made_from = manifest.get("model")
    where = f"checkpoint {path}"
    if made_from is None:  # written before checkpoints recorded their model: nothing to compare
        return [], [f"{where} does not record its model or settings; resuming without checking them"]
    here = model_identity(cfg.model)
    saved_model, this_model = _split_identity(made_from), _split_identity(here)
    if saved_model != this_model:
        return [
            f"{where} was made from model {_show(saved_model)}, this run uses {_show(this_model)}: resume it with that model, "
            "or start over with trainer.resume=never (or another trainer.run_name)"
        ], []
    saved = manifest.get("config", {})
    changes = config_changes(saved, resolved)
    refused = refused_changes(changes, saved) + [
        f"{k}: {made_from[k]!r} -> {here.get(k)!r} ({reason})"
        for k, reason in PROMPT_IDENTITY.items()
        if k in made_from and made_from[k] != here.get(k)  # absent: the checkpoint predates the key
    ]
    if refused:
        return [f"cannot resume {where} with changed settings: " + "; ".join(refused)
                + ". Start over with trainer.resume=never (or another trainer.run_name)"], []  # fmt: skip
    return [], [f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()]


def refused_changes(changes: dict[str, tuple[Any, Any]], saved: dict) -> list[str]:
    """``key: old -> new (why)`` for each change in ``changes`` a resume cannot honour
    (:data:`REFUSED`); ``saved`` is the checkpoint's config."""
    synth = "builtin:synth_math" in ((saved.get("data") or {}).get("train_files") or [])
    recorded = _flat(saved)
    return [
        f"{k}: {old!r} -> {new!r} ({REFUSED[k]})"
        for k, (old, new) in changes.items()
        # A key the checkpoint's config lacks came with a later version at its default: not a change
        # to refuse. A key it holds as null (data.system_prompt) is one.
        if k in REFUSED and k in recorded and (synth or not k.startswith(SYNTH_KEYS))
        # the tools reach the prompts only with the agent on
        and (k != "rollout.agent.tool_config" or recorded.get("rollout.agent.enable"))
    ]


def _split_identity(ident: dict) -> dict:
    """The model part of an identity (without what only changes how prompts render)."""
    return {k: v for k, v in ident.items() if k not in PROMPT_IDENTITY}


def _show(ident: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in ident.items())


# What a run writes into its output_dir, Hydra's main.log and .hydra/ included: moved aside
# together when a run starts over there (a user's own files there stay). RESULTS show that a run
# got going (a main.log alone is a run that failed to start). Checkpoints first: a move cut short
# then leaves no checkpoint that a later resume could pick beside the moved metrics, and the next
# start from step 0 moves the rest.
RESULTS = ("checkpoints", "metrics.jsonl", "generations", "tensorboard", "profile", "hf", "wandb")
RUN_FILES = (*RESULTS, "slurm_jobs.txt", "main.log", ".hydra")


def earlier_results(out_dir: str | Path) -> list[str]:
    """The names of an earlier run's results in ``out_dir`` (:data:`RESULTS`), [] when none."""
    out = Path(out_dir)
    return [n for n in RESULTS if (out / n).is_file() or ((out / n).is_dir() and any((out / n).iterdir()))]


def set_aside_earlier_run(mode: str, out_dir: str | Path, keep: tuple[str, ...] = (), reads: tuple[str, ...] = ()) -> str | None:
    """Before a run starts from step 0 in ``out_dir``: move an earlier run's files there
    (:data:`RUN_FILES` less ``keep``, what this run wrote already) to ``out_dir/previous/<time>/``
    and return the line that says so (None when there was no earlier run).

    Without it the new run's rows would follow the old run's in ``metrics.jsonl`` (each step
    twice), and the old run's newer checkpoint would stay beside the new run's: a later
    ``trainer.resume=auto`` resumed the discarded run and pruned the new one. One process only
    (the launching process, or rank 0 while the other ranks wait).

    ``reads``: paths this run reads (its model, data, reward files). One inside the files to move
    (``model.path=<output_dir>/hf`` of an earlier run of the same name) raises ValueError instead:
    moving it would take the run's own input away."""
    out = Path(out_dir)
    found = earlier_results(out)
    if not found:
        return None
    for name in RUN_FILES:
        inside = [r for r in reads if name not in keep and (out / name).exists() and Path(r).resolve().is_relative_to((out / name).resolve())]
        if inside:
            raise ValueError(
                f"{inside[0]} is part of the earlier run's files in {out} ({name}) that a start from step 0 moves to "
                f"{out / 'previous'}: copy it elsewhere, or use another trainer.run_name"
            )
    newest = latest_checkpoint(out / "checkpoints")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest, n = out / "previous" / stamp, 1
    while dest.exists():
        dest, n = out / "previous" / f"{stamp}-{n}", n + 1
    dest.mkdir(parents=True)
    for name in RUN_FILES:
        if name not in keep and os.path.lexists(out / name):
            os.replace(out / name, dest / name)
    what = ", ".join(f"checkpoints up to {newest.name}" if name == "checkpoints" and newest else name for name in found)
    why = "starting over" if mode in ("never", "none") else f"no finished checkpoint in {out / 'checkpoints'}, starting over"
    return f"trainer.resume={mode}: {why}; the earlier run's files in {out} ({what}) were moved to {dest}"


def set_aside_newer_checkpoints(out_dir: str | Path, chosen: str | Path) -> str | None:
    """Resuming an explicit, older checkpoint of this run (``trainer.resume=<output_dir>/checkpoints/
    step_000050`` beside ``step_000100``): the newer ones belong to the run being rewound. Left in
    place, the first save's pruning keeps the newest by name (the discarded run's) and hides the new
    one, and a later ``resume=auto`` continues the discarded run. They move to
    ``out_dir/previous/<time>/checkpoints/``; returns the line that says so (None when none is newer
    or the checkpoint is not this run's)."""
    root, chosen = Path(out_dir) / "checkpoints", Path(chosen)
    if not root.is_dir() or chosen.resolve().parent != root.resolve():
        return None
    newer = [p for p in list_checkpoints(root) if p.name > chosen.name]
    if not newer:
        return None
    dest = Path(out_dir) / "previous" / time.strftime("%Y%m%d-%H%M%S") / "checkpoints"
    dest.mkdir(parents=True, exist_ok=True)
    for p in newer:
        os.replace(p, dest / p.name)
    return (f"trainer.resume={chosen}: the run's newer checkpoints ({', '.join(p.name for p in newer)}) were moved to {dest}, "
            "so the resumed run's own checkpoints are the newest")  # fmt: skip

