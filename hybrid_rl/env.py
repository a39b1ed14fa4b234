"""Process environment that vLLM's CPU backend, torch and the HF libraries need.

Call :func:`setup_process_env` before importing torch or vllm (``hybrid_rl.main`` and
``tests/conftest.py`` do), so a user sets nothing by hand. Every value is a default: a variable
the user already exported wins.

Why each one (measured on 2-core CPU machines, see FEASIBILITY.md in the design notes):

- ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine runs in the trainer's own process. Engine start
  drops from 15-26 s to 2.5-4.4 s, and weight pushes are plain function calls (tensors are passed
  by reference, no serialisation).
- ``OMP_NUM_THREADS``: one OpenMP thread per rank unless the user says otherwise; with several
  ranks on few cores oversubscription costs more than it gains.
- ``VLLM_CPU_KVCACHE_SPACE``: if unset vLLM reserves ~0.9 x RAM for the KV cache; we size the
  cache explicitly per engine (``rollout.kv_cache_gib``), this is only the fallback.
- ``VLLM_CACHE_ROOT`` / ``HF_HOME``: somewhere of ours, never a shared home directory.
- ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``: no hub is reachable; fail fast instead of
  retrying network calls for local folders.
- ``TOKENIZERS_PARALLELISM=false``: the tokenizer's thread pool deadlocks after ``fork``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """Where hybrid_rl keeps generated models, datasets and library caches."""
    root = os.environ.get("HYBRID_RL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "hybrid_rl"
    )
    return Path(root)


def is_cuda_available() -> bool:
    """CUDA without importing torch (so env vars can still be set before torch loads)."""
    if os.environ.get("HYBRID_RL_FORCE_CPU") == "1":
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False


def setup_process_env(threads_per_rank: int | None = None) -> None:
    """Set the environment variables the stack needs, keeping any the user set."""
    root = cache_root()
    defaults = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_CONFIGURE_LOGGING": "1",
        "HF_HOME": str(root / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRANSFORMERS_VERBOSITY": "error",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    if threads_per_rank is not None:
        defaults["OMP_NUM_THREADS"] = str(threads_per_rank)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    (root / "vllm").mkdir(parents=True, exist_ok=True)
