"""When an RL run saves, resumes and stops: checkpoint scheduling, signals, the resume point.
A component of the loop (:class:`hybrid_rl.trainer.rl.RLTrainer`), which says *what* the run
state is; this says *when* and *where* it is written."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_rl.dist import DistContext, all_reduce_max, barrier
from hybrid_rl.errors import NumericalError
from hybrid_rl.faults import maybe_fail
from hybrid_rl.resume import set_aside_earlier_run, set_aside_newer_checkpoints
from hybrid_rl.trainer import checkpoint as ckpt

if TYPE_CHECKING:  # annotations only
    from hybrid_rl.config import TrainerConfig

log = logging.getLogger("hybrid_rl")


class RunControl:
    """Checkpoints of the actor (and critic) under ``out_dir/checkpoints``, their schedule
    (``trainer.save_every`` / ``save_every_minutes``), the resume point (``trainer.resume``) and the
    stop request a signal makes."""

    def __init__(self, cfg: TrainerConfig, ctx: DistContext, out_dir: Path, actor: Any, critic: Any | None, made_from: dict | None = None) -> None:
        self.cfg, self.ctx, self.out_dir, self.made_from = cfg, ctx, out_dir, made_from
        self.actor, self.critic = actor, critic
        self.stop_requested = False
        self.last_save = time.monotonic()
        self.saved_step: int | None = None  # the step the newest checkpoint holds
        self.start_clean()

    def start_clean(self) -> None:
        """A run from step 0 moves an earlier run's files in ``out_dir`` aside before it writes
        anything (:func:`hybrid_rl.resume.set_aside_earlier_run`). The launching process has done
        so already, unless the ranks came from an external torchrun: then rank 0 decides and moves
        them (leaving this run's main.log and .hydra/, which Hydra opened already) while the other
        ranks wait, so none reads a checkpoint or writes a file mid-move. Collective: every rank
        passes the barrier, whatever it would have decided."""
        if self.ctx.is_main:
            chosen = self.resume_point()
            if chosen is None:
                line = set_aside_earlier_run(str(self.cfg.resume), self.out_dir, keep=("main.log", ".hydra"))
            else:  # an explicit older checkpoint of this run: its newer ones move aside
                line = set_aside_newer_checkpoints(self.out_dir, chosen) if str(self.cfg.resume) not in ("auto", "must") else None
            if line:
                log.warning(line)
        barrier()

    def app_states(self) -> dict[str, ckpt.AppState]:
        states = {"app": ckpt.AppState(self.actor)}
        if self.critic is not None:
            states["critic"] = ckpt.AppState(self.critic)
        return states

    def save(self, step: int, run_state: dict) -> None:
        """Checkpoint ``step``, unless it is already on disk (a stop right after a scheduled
        save, or a resume at ``total_steps``): saving it twice would only open a window in which
        the one good copy is being replaced."""
        if self.saved_step == step:
            return
        if not self.actor.params_finite():
            raise NumericalError(f"step {step}: the policy has non-finite parameters; refusing to write a checkpoint")
        maybe_fail("save", step, self.ctx.rank)
        path = ckpt.save_checkpoint(
            self.out_dir / "checkpoints", step, self.app_states(), run_state, self.cfg.keep_last, self.ctx.rank, self.ctx.world_size,
            self.made_from,
        )  # fmt: skip
        self.last_save = time.monotonic()
        self.saved_step = step
        if self.ctx.is_main:
            log.info("saved checkpoint %s", path)

    def resume_point(self) -> Path | None:
        """The checkpoint ``trainer.resume`` names: auto / must (the newest here), never, or a
        directory (the launcher checked it was made from this model: :mod:`hybrid_rl.resume`)."""
        mode = str(self.cfg.resume)
        if mode in ("never", "none"):
            return None
        return ckpt.latest_checkpoint(self.out_dir / "checkpoints") if mode in ("auto", "must") else Path(mode)

    def load(self, path: Path) -> dict:
        """Load the model and optimizer states from ``path``; returns the run state saved with them."""
        state = ckpt.load_checkpoint(path, self.app_states(), self.ctx.rank)
        self.saved_step = int(state["step"])
        return state

    def due(self, step: int) -> bool:
        """Every ``trainer.save_every`` steps, or once ``trainer.save_every_minutes`` of wall time
        passed since the last checkpoint (rank 0's clock decides for all: one collective)."""
        by_steps = bool(self.cfg.save_every) and step % self.cfg.save_every == 0
        by_time = self.cfg.save_every_minutes > 0 and time.monotonic() - self.last_save >= 60 * self.cfg.save_every_minutes
        return all_reduce_max(float(by_steps or (by_time and self.ctx.is_main))) > 0

    def stop_agreed(self) -> bool:
        """A signal may reach one rank only; all ranks stop together."""
        self.stop_requested = all_reduce_max(float(self.stop_requested)) > 0
        return self.stop_requested

    def install_signal_handler(self) -> None:
        """SIGINT (Ctrl-C), SIGTERM (kill, scancel) and SIGUSR1 (Slurm's warning before a time
        limit): checkpoint after the current step, then exit 0. Idempotent: a signal that
        reaches a rank twice (from the launcher and from Slurm) still means "stop after this
        step"; stopping at once is the launcher's job (a second signal to it)."""

        def handler(signum: int, frame: Any) -> None:
            if not self.stop_requested:
                log.warning("signal %d: saving a checkpoint after the current step, then exiting", signum)
            self.stop_requested = True

        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)
