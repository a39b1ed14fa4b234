"""Rollout backends by name (``rollout.backend``): a backend is a class implementing
:class:`hybrid_rl.rollout.base.RolloutEngine` whose constructor takes
``(model_path, rollout_cfg, dtype, seed, device, max_model_len, trust_remote_code)``.

Backends are named here as ``"module:Class"`` and imported only when selected, so importing this
module never imports vLLM. Adding a backend: its module, one line in :data:`BACKENDS` (or
:func:`register_backend` from your own code), and its test.
"""

from __future__ import annotations

import importlib
from typing import Any

from hybrid_rl.rollout.base import RolloutEngine

BACKENDS: dict[str, str] = {
    "vllm": "hybrid_rl.rollout.vllm_engine:VLLMRollout",
    # transformers' generate: no vLLM needed (GPU check, fallback); slower, no prefix sharing.
    "hf": "hybrid_rl.rollout.hf_engine:HFRollout",
}


def register_backend(name: str, target: str) -> None:
    """Make ``rollout.backend=name`` build ``target`` (``"package.module:Class"``)."""
    if ":" not in target:
        raise ValueError(f"rollout backend {name!r}: target {target!r} must be 'package.module:Class'")
    BACKENDS[name] = target


def build_backend(name: str, *args: Any, **kwargs: Any) -> RolloutEngine:
    if name not in BACKENDS:
        raise KeyError(f"unknown rollout.backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(*args, **kwargs)
