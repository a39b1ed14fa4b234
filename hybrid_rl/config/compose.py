"""Composing configs the way the command line does, from inside the program: the recipe of a
builtin warm start, and the list of files a composition reads (for required keys)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def conf_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "conf"


def repo_path(path: str) -> str:
    """A relative path as given if it exists from the working directory, else from the repository root."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return str(p)
    candidate = conf_dir().parent / p
    return str(candidate if candidate.exists() else p)


def compose_recipe(recipe: str, preset: str) -> Any:
    """A recipe's config, composed with Hydra as the command line would."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = [f"+recipe={recipe}", f"model.preset={preset}"]
    if GlobalHydra.instance().is_initialized():
        return compose(config_name="config", overrides=overrides)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def composed_files(config_name: str, overrides: list[str]) -> list[tuple[str, str]]:
    """``(config path, package)`` of every file the composition merges, in merge order (Hydra's
    defaults list; Hydra must be initialised)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    loader = GlobalHydra.instance().config_loader()
    defaults = loader.compute_defaults_list(config_name, overrides, RunMode.RUN).defaults
    return [(d.config_path, d.package or "") for d in defaults if d.config_path and not d.config_path.startswith("hydra/")]
