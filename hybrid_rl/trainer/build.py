"""Building the pieces a run needs from the typed config: model path, tokenizer, engines, data."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hybrid_rl.config import ConfigError
from hybrid_rl.dist import DistContext, barrier, broadcast_object

log = logging.getLogger("hybrid_rl")


class ModelPathError(ConfigError):
    """model.path is missing, corrupt, or not a usable HF folder."""


def check_model_dir(path: str) -> None:
    """Fail early, naming the path, if a local model folder cannot work."""
    p = Path(path)
    if not p.is_dir():
        raise ModelPathError(f"model.path={path!r} does not exist (a local HF folder, or builtin:tiny / builtin:tiny-sft)")
    if not (p / "config.json").is_file():
        raise ModelPathError(f"model.path={path!r} has no config.json: not a Hugging Face model folder")
    try:
        json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ModelPathError(f"model.path={path!r}: config.json is corrupt ({e})") from e
    weights = list(p.glob("*.safetensors")) + list(p.glob("*.bin"))
    if not weights:
        raise ModelPathError(f"model.path={path!r} has no weights (*.safetensors or *.bin)")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ModelPathError(f"model.path={path!r} has no tokenizer files")


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelPathError(f"model.path={path!r}: cannot load the tokenizer ({type(e).__name__}: {e})") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def sft_cache_key(sft_cfg: Any) -> str:
    """Hash of what determines the SFT warm start (model, data, actor, steps, seed)."""
    parts = {k: OmegaConf.to_container(sft_cfg[k], resolve=True) for k in ("model", "data", "actor")}
    parts["trainer"] = {k: sft_cfg.trainer[k] for k in ("total_steps", "seed", "sft_epochs")}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:10]


def compose_sft_config(preset: str) -> Any:
    """The ``sft_math`` recipe's config (composed with Hydra, as the command line would)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = ["+recipe=sft_math", f"model.preset={preset}", "model.path=builtin:tiny"]
    if GlobalHydra.instance().is_initialized():
        return compose(config_name="config", overrides=overrides)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose(config_name="config", overrides=overrides)


def conf_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "conf"


def resolve_model_path(cfg: Any, ctx: DistContext) -> str:
    """A local folder for ``model.path``, building the project's own model on first use."""
    from hybrid_rl.env import cache_root
    from hybrid_rl.models.tiny import tiny_model_path

    path = cfg.model.path
    if path == "builtin:tiny":
        if ctx.is_main:
            tiny_model_path(cfg.model.preset)
        barrier()
        return str(tiny_model_path(cfg.model.preset))
    if path == "builtin:tiny-sft":
        sft_cfg = compose_sft_config(cfg.model.preset)
        out = cache_root() / "models" / f"{cfg.model.preset}-sft-{sft_cache_key(sft_cfg)}"
        if not (out / "model.safetensors").exists():
            log.info("building the SFT warm start (once, cached at %s)", out)
            from hybrid_rl.trainer.sft import run_sft

            run_sft(sft_cfg, ctx, export_dir=str(out))
        barrier()
        return str(out)
    if path.startswith("builtin:"):
        raise ModelPathError(f"model.path={path!r}: unknown builtin; known: builtin:tiny, builtin:tiny-sft")
    check_model_dir(path)
    return str(broadcast_object(path))


def build_rollout_engine(model_path: str, cfg: Any, ctx: DistContext, max_model_len: int, seed: int):
    """The vLLM engine for this rank (imports vllm, which only hybrid_rl.rollout does)."""
    from hybrid_rl.rollout.vllm_engine import VLLMRollout

    return VLLMRollout(model_path, cfg.rollout, cfg.model.dtype, seed + ctx.rank, ctx.device, max_model_len)


def check_lengths(cfg: Any, model_path: str, extra: int = 0) -> int:
    """max_model_len for the engine; error if prompt + response exceed the model's positions."""
    conf = json.loads((Path(model_path) / "config.json").read_text())
    limit = int(conf.get("max_position_embeddings", 1 << 30))
    need = cfg.data.max_prompt_length + cfg.rollout.max_response_length + extra
    if need > limit:
        raise ConfigError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + rollout.max_response_length "
            f"({cfg.rollout.max_response_length}){f' + {extra}' if extra else ''} = {need} exceeds the model's "
            f"max_position_embeddings={limit} ({model_path})"
        )
    return need
