"""Everything that can be checked about a run before it starts, checked in the launching process.

:func:`preflight` runs before any rank, warm-start job, tokenizer, model or engine exists, reads
only small files, and names every problem at once (``main`` prints them as one line and exits 2):

- keys left required (``???``) by a recipe or the base config and not set after it;
- the typed config (:func:`omegaconf.OmegaConf.to_object`) and the task's cross-field checks
  (:mod:`hybrid_rl.config.checks`);
- a local model folder: ``config.json``, weights, tokenizer files and a chat template, and
  prompt + response lengths against its ``max_position_embeddings`` (no weights are read);
- data files, the agent's tool config, and custom reward functions (file, function, signature);
- resuming (``trainer.resume``): the checkpoint must come from the same model and keep the
  settings its state depends on (:mod:`hybrid_rl.resume`); other changes are printed;
- the recipe of a builtin warm start (``builtin:tiny-sft``, ``builtin:tiny-rm``), which would
  otherwise run a whole SFT or reward-model job before the run's own config is looked at.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from hybrid_rl.config.checks import problems as config_problems
from hybrid_rl.config.compose import compose_recipe, composed_files, conf_dir, repo_path
from hybrid_rl.errors import ModelPathError
from hybrid_rl.models.tiny import max_positions as builtin_max_positions
from hybrid_rl.resume import resume_problems

if TYPE_CHECKING:  # annotations only: Config is defined in the package __init__, which imports this module
    from hybrid_rl.config import Config

# The builtin models and the recipes that build them on first use.
BUILTIN_RECIPES = {"builtin:tiny-sft": "model.sft_recipe", "builtin:tiny-rm": "rm_math"}
# A reward function is called as fn(data_source, solution_str, ground_truth, extra_info) (verl's signature).
REWARD_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def preflight(cfg: Config, world_size: int, required: list[str] | None = None, notes: list[str] | None = None) -> list[str]:
    """Every problem of the composed ``cfg`` (a DictConfig) on ``world_size`` ranks, as one message
    each; what the run will go on with but should say (changed settings on resume) goes to ``notes``."""
    found = list(required or []) + [renamed_key(k) or f"{k} is not a key of the schema" for k in added_keys(cfg)]
    try:
        typed = OmegaConf.to_object(cfg)
    except Exception as e:  # a ??? no recipe set, or a value the schema refuses
        return [*found, one_line_error(e)]
    found += config_problems(typed, world_size) + data_problems(typed) + reward_problems(typed)
    if not any(p.startswith("model.path ") for p in found):  # else the default path would be checked
        found += model_problems(typed) + warm_start_problems(typed, world_size)
    if typed.trainer.task == "rl" and not found:
        refused, changed = resume_problems(typed, OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
        found += refused
        if notes is not None:
            notes += changed
    return list(dict.fromkeys(found))


def added_keys(node: Any, prefix: str = "") -> list[str]:
    """Keys a ``+key=value`` override added to a typed section: Hydra opens the struct for
    ``+``, and the typed object then drops the key, so a typo there would be silently ignored."""
    from dataclasses import fields, is_dataclass

    from omegaconf import DictConfig, ListConfig

    out = []
    if isinstance(node, ListConfig):
        for i, item in enumerate(node):
            out += added_keys(item, f"{prefix}[{i}]")
    elif isinstance(node, DictConfig):
        schema = OmegaConf.get_type(node)
        known = {f.name for f in fields(schema)} if is_dataclass(schema) else None
        for key in node.keys():
            name = f"{prefix}.{key}" if prefix else str(key)
            if known is not None and key not in known:
                out.append(name)
            else:
                out += added_keys(node._get_node(key), name)
    return out


def one_line_error(exc: BaseException) -> str:
    """Hydra/OmegaConf errors span several lines; keep what names the key and why."""
    text = str(exc)
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause) and str(cause) not in text:
        text = f"{text} {cause}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    full_key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    keep = [ln for ln in lines if not ln.startswith(("full_key:", "object_type=", "reference_type=", "Set the environment"))]
    msg = " ".join(keep)
    if full_key and full_key not in msg:
        msg = f"{msg} (key: {full_key})"
    return renamed_key(text) or msg


def renamed_key(text: str) -> str | None:
    """The line for an error about a key that moved or went away (:data:`MOVED_KEYS`), else None."""
    import typing

    from hybrid_rl.config.training import MOVED_KEYS, REMOVED_KEYS, AlgorithmConfig

    keys = re.findall(r"algorithm\.\w+(?![\w.])", text)
    # A plain value where a section now is, from a file: the error names only the section's type.
    sections = {tp.__name__: f"algorithm.{name}" for name, tp in typing.get_type_hints(AlgorithmConfig).items() if isinstance(tp, type)}
    keys += [sections[t] for t in re.findall(r"is not a subclass of (\w+)", text) if t in sections]
    for old in keys:
        if old in MOVED_KEYS:
            return f"{old} is now {MOVED_KEYS[old]}"
        if old in REMOVED_KEYS:
            return f"{old} was removed: {REMOVED_KEYS[old]}"
    return None


def required_problems(config_name: str, overrides: list[str]) -> list[str]:
    """Keys a composed file marks ``???`` that no later file and no command-line override sets.

    OmegaConf keeps an existing value when a ``???`` is merged over it, so a recipe's ``model.path:
    ???`` would otherwise leave the base config's default in place and run on it."""
    required: dict[str, str] = {}
    for path, package in composed_files(config_name, overrides):
        file = conf_dir() / f"{path}.yaml"
        if not file.is_file():
            continue  # a structured-config schema node, not a file
        node = OmegaConf.to_container(OmegaConf.load(file), resolve=False)
        node.pop("defaults", None)
        for key, value in _leaves(node, package):
            if value == "???":
                required[key] = path
            else:
                required.pop(key, None)
    set_on_command_line = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    return [
        f"{key} is required (marked ??? in conf/{where}.yaml): set it on the command line, e.g. {key}=..."
        for key, where in required.items()
        if key not in set_on_command_line
    ]


def _leaves(node: Any, prefix: str) -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of a plain nested dict."""
    out = []
    for key, value in node.items() if isinstance(node, dict) else []:
        full = f"{prefix}.{key}" if prefix else str(key)
        out += _leaves(value, full) if isinstance(value, dict) and value else [(full, value)]
    return out


def model_dir_problems(path: str, key: str = "model.path", chat: bool = True) -> list[str]:
    """Why the local folder ``path`` is not a usable HF model (empty when it is). Reads
    ``config.json`` and ``tokenizer_config.json`` only, never weights."""
    p = Path(path)
    if not p.is_dir():
        return [f"{key}={path!r} does not exist (a local HF folder, or builtin:tiny / builtin:tiny-sft)"]
    if not (p / "config.json").is_file():
        return [f"{key}={path!r} has no config.json: not a Hugging Face model folder"]
    try:
        json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        return [f"{key}={path!r}: config.json is corrupt ({e})"]
    found = []
    if not list(p.glob("*.safetensors")) + list(p.glob("*.bin")):
        found.append(f"{key}={path!r} has no weights (*.safetensors or *.bin)")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        found.append(f"{key}={path!r} has no tokenizer files")
    elif chat and not _has_chat_template(p):
        found.append(
            f"{key}={path!r}: the tokenizer has no chat template; prompts are chat messages, so use an "
            "instruct/chat checkpoint or add a chat_template to its tokenizer_config.json"
        )
    return found


def check_model_dir(path: str) -> None:
    """Raise :class:`ModelPathError` naming the path if a local model folder cannot work."""
    found = model_dir_problems(path, chat=False)
    if found:
        raise ModelPathError(found[0])


def _has_chat_template(p: Path) -> bool:
    if (p / "chat_template.jinja").is_file() or (p / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((p / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, json.JSONDecodeError):
        return False


def max_positions(path: str, preset: str) -> int:
    """``max_position_embeddings`` of a model folder or builtin model (unbounded when absent)."""
    if path.startswith("builtin:"):
        return builtin_max_positions(preset)  # what hybrid_rl.models.tiny builds the preset with
    return int(json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings", 1 << 30))


def model_problems(cfg: Config) -> list[str]:
    path = cfg.model.path
    if path.startswith("builtin:"):
        if path != "builtin:tiny" and path not in BUILTIN_RECIPES:
            return [f"model.path={path!r}: unknown builtin; known: builtin:tiny, {', '.join(BUILTIN_RECIPES)}"]
    elif cfg.trainer.task == "eval" and (Path(path) / "manifest.json").is_file():
        source = json.loads((Path(path) / "manifest.json").read_text()).get("model_dir", "")
        if not (Path(source) / "config.json").is_file():
            return [f"model.path={path!r} is a checkpoint whose model folder ({source or 'not recorded'}) is gone: export it with --model-dir"]
        path = source
    else:
        found = model_dir_problems(path)
        if found:
            return found
    rm = cfg.reward.reward_model
    rm_paths = [p for p in ([rm.path] if rm.path else []) + list(rm.ensemble) if not p.startswith("builtin:")]
    found = [m for p in rm_paths for m in model_dir_problems(p, "reward.reward_model.path", chat=False)]
    if cfg.trainer.task in ("rl", "eval"):
        r, ag = cfg.rollout, cfg.rollout.agent
        extra = ag.max_response_tokens - r.max_response_length if ag.enable else 0
        need, limit = cfg.data.max_prompt_length + r.max_response_length + extra, max_positions(path, cfg.model.preset)
        if need > limit:
            found.append(
                f"data.max_prompt_length ({cfg.data.max_prompt_length}) + rollout.max_response_length ({r.max_response_length})"
                f"{f' + {extra}' if extra else ''} = {need} exceeds the model's max_position_embeddings={limit} ({path})"
            )
    return found


def data_problems(cfg: Config) -> list[str]:
    d = cfg.data
    # builtin:synth_math generates the synthetic task; builtin:synth_pref (dpo/rm) builds preference pairs from it.
    builtins = ("builtin:synth_math", "builtin:synth_pref") if cfg.trainer.task in ("dpo", "rm") else ("builtin:synth_math",)
    found = [
        f"data.{split}_files: {f!r} does not exist"
        for split, files in (("train", d.train_files), ("val", d.val_files))
        for f in files
        if not f.startswith("builtin:") and not Path(f).is_file()
    ]
    found += [
        f"data.{split}_files: unknown builtin {f!r}; known: {', '.join(builtins)}"
        for split, files in (("train", d.train_files), ("val", d.val_files))
        for f in files
        if f.startswith("builtin:") and f not in builtins
    ]
    ag = cfg.rollout.agent
    if ag.enable and not Path(repo_path(ag.tool_config)).is_file():
        found.append(f"rollout.agent.tool_config: {ag.tool_config!r} does not exist")
    return found


def reward_problems(cfg: Config) -> list[str]:
    """Each custom reward function resolved: the file exists, defines the function, and the
    function takes the four arguments it is called with."""
    from hybrid_rl.rewards.functions import BUILTIN

    found = []
    for i, fn in enumerate(cfg.reward.functions):
        key = f"reward.functions[{i}]"
        if fn.name != "custom":
            if fn.name not in BUILTIN:
                found.append(f"{key}.name={fn.name!r} is unknown; known: {', '.join(sorted(BUILTIN))}, custom")
            continue
        if not fn.path or not fn.function:
            found.append(f"{key}: a custom reward needs path and function")
            continue
        found += _custom_reward_problems(key, fn.path, fn.function)
    return found


def _custom_reward_problems(key: str, path: str, function: str) -> list[str]:
    from hybrid_rl.rewards.functions import load_custom

    if not Path(path).is_file():
        return [f"{key}.path: reward function file {path!r} does not exist"]
    try:
        fn = load_custom(path, function)
    except Exception as e:  # the user's file failed to import, or lacks the function
        return [f"{key}: {type(e).__name__}: {e}"]
    try:
        inspect.signature(fn).bind(*REWARD_ARGS)
    except TypeError as e:
        return [f"{key}.function: {function}{inspect.signature(fn)} in {path!r} cannot be called as {function}({', '.join(REWARD_ARGS)}): {e}"]
    except ValueError:  # a builtin or C function without a signature: it will be called as is
        pass
    return []


def warm_start_problems(cfg: Config, world_size: int) -> list[str]:
    """The problems of the recipes that build ``builtin:tiny-sft`` / ``builtin:tiny-rm`` for this run."""
    paths = [cfg.model.path, *([cfg.reward.reward_model.path] if cfg.reward.reward_model.path else []), *cfg.reward.reward_model.ensemble]
    recipes = {cfg.model.sft_recipe if p == "builtin:tiny-sft" else "rm_math" for p in paths if p in BUILTIN_RECIPES}
    found = []
    for recipe in sorted(recipes):
        if not (conf_dir() / "recipe" / f"{recipe}.yaml").is_file():
            found.append(f"model.sft_recipe={recipe!r}: no recipe conf/recipe/{recipe}.yaml")
            continue
        inner = compose_recipe(recipe, cfg.model.preset)
        found += [f"warm start {recipe}: {m}" for m in preflight(inner, world_size)]
    return found
