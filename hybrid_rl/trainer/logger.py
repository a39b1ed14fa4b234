"""Metrics sinks: console lines, a progress bar, ``metrics.jsonl``, tensorboard, wandb, mlflow.

Only rank 0 logs. ``metrics.jsonl`` gets one JSON object per step with ``step`` and every metric
by name (validation ones under ``val/``), so runs can be compared by script.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only
    from hybrid_rl.config import LoggerConfig

log = logging.getLogger("hybrid_rl")

# Shown on the console line, in this order, when present.
CONSOLE_KEYS = [
    ("critic/score/mean", "reward"),
    ("val/accuracy", "val_acc"),
    ("response_length/mean", "len"),
    ("actor/entropy", "ent"),
    ("actor/grad_norm", "gnorm"),
    ("actor/kl_loss", "kl"),
    ("timing_s/step", "step_s"),
    ("switch/to_rollout_s", "switch_s"),
    ("sft/nll", "nll"),
]


class MetricsLogger:
    def __init__(self, cfg: LoggerConfig, output_dir: str | Path, run_config: dict, total_steps: int, enabled: bool) -> None:
        self.enabled = enabled
        self.backends = set(cfg.backends)
        self.dir = Path(output_dir)
        self.jsonl = None
        self.tb = None
        self.wandb = None
        self.mlflow = None
        self.bar = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if "jsonl" in self.backends:
            self.jsonl = (self.dir / "metrics.jsonl").open("a", encoding="utf-8")
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.dir / "tensorboard"))
        if "wandb" in self.backends:
            self.wandb = self._optional("wandb")
            if self.wandb is not None:
                self.wandb.init(project=cfg.project, name=self.dir.name, config=run_config, dir=str(self.dir))
        if "mlflow" in self.backends:
            self.mlflow = self._optional("mlflow")
            if self.mlflow is not None:
                self.mlflow.set_experiment(cfg.project)
                self.mlflow.start_run(run_name=self.dir.name)
                self.mlflow.log_params({k: str(v)[:250] for k, v in _flatten(run_config).items()})
        if cfg.progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, desc="steps", dynamic_ncols=True)

    @staticmethod
    def _optional(name: str):
        try:
            return __import__(name)
        except ImportError:
            log.warning("logger backend %s is enabled but not installed (pip install %s); skipping it", name, name)
            return None

    def log_text(self, step: int, tag: str, text: str) -> None:
        """Text (markdown) for TensorBoard's text tab, e.g. generated samples."""
        if self.enabled and self.tb is not None:
            self.tb.add_text(tag, text, step)
            self.tb.flush()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        # Non-finite values are logged as they are (NaN / Infinity in metrics.jsonl): a NaN loss
        # must show up in the curves, not vanish from them.
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if self.mlflow is not None:
            self.mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in clean.items()}, step=step)
        if "console" in self.backends:
            parts = [f"{short}={clean[k]:.4g}" for k, short in CONSOLE_KEYS if k in clean]
            line = f"step {step}: " + " ".join(parts)
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)
        if self.bar is not None and step > (self.bar.n or 0):
            self.bar.n = step
            self.bar.refresh()

    def truncate_after(self, step: int) -> int:
        """On resume from a checkpoint at ``step``: drop ``metrics.jsonl`` rows of later steps
        (written before the run was killed and about to be redone), so each step appears once.
        Returns the number of rows dropped."""
        if self.jsonl is None:
            return 0
        path = Path(self.jsonl.name)
        self.jsonl.close()
        lines = path.read_text(encoding="utf-8").splitlines()
        keep = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= step]
        path.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
        self.jsonl = path.open("a", encoding="utf-8")
        return len(lines) - len(keep)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
