"""Entry point: ``python -m hybrid_rl.main +recipe=grpo_math [overrides]``.

Composes the typed config with Hydra, starts ``trainer.nproc_per_node`` ranks of itself with
:mod:`hybrid_rl.launch` when that is > 1 (and it is not already a rank), sets the process
environment, then runs the task (``rl`` or ``sft``). Configuration and input errors are printed
as one line naming the key/file and exit with status 2.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import hydra
from omegaconf import DictConfig

from hybrid_rl.config import register_configs
from hybrid_rl.config.preflight import one_line_error
from hybrid_rl.env import setup_process_env

log = logging.getLogger("hybrid_rl")
register_configs()
# What the launching process has to say before Hydra has opened main.log (the changed settings a
# resume goes on with, where an earlier run's files went): said by main() once it has, so the
# lines reach the console and main.log like every other.
STARTUP_LINES: list[str] = []


def preflight_or_exit(argv: list[str]) -> DictConfig | None:
    """Compose the command line's config and run every check of its task before anything starts
    (:mod:`hybrid_rl.config.preflight`): each problem named, one line, exit 2. Returns the
    composed config when Hydra will run the job (not for ``--help``, ``--cfg``, ``--info``...).

    Runs in the launching process; ranks started by our launcher skip it (it ran there), ranks of
    an external torchrun (Slurm, multi-node) run it themselves, as cheaply."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser

    from hybrid_rl.config.compose import conf_dir
    from hybrid_rl.config.preflight import preflight, required_problems

    # Hydra's own parser separates its flags and their values (--cfg job, -p PKG, --config-name X,
    # --info [topic], ...) from the overrides; anything it rejects is left for Hydra to report.
    try:
        args = get_args_parser().parse_intermixed_args(argv)
    except SystemExit:
        return None
    if args.help or args.hydra_help or args.shell_completion or args.multirun:
        return None
    overrides = [a for a in args.overrides if not a.startswith(("hydra.", "hydra/", "+hydra", "~hydra"))]
    name = args.config_name or "config"
    notes: list[str] = []
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = compose(config_name=name, overrides=overrides)
            required = required_problems(name, overrides)
            world = int(os.environ.get("WORLD_SIZE", "0")) or max(1, cfg.trainer.nproc_per_node)
            problems = preflight(cfg, world, required, notes)
    except Exception as e:
        problems = [one_line_error(e)]
    if problems:
        print(f"config error: {'; '.join(problems)}", file=sys.stderr)
        sys.exit(2)
    if notes:
        STARTUP_LINES.append(f"resuming with changed settings: {'; '.join(notes)}")
    return None if args.cfg or args.info or args.experimental_rerun else cfg


def start_clean_or_exit(cfg: DictConfig | None) -> None:
    """A run of ``cfg`` that starts from step 0 (``trainer.resume=never``, or ``auto`` without a
    finished checkpoint) where an earlier run left its files moves them to
    ``<output_dir>/previous/<time>/`` first (:func:`hybrid_rl.resume.set_aside_earlier_run`), so the
    two runs' steps and checkpoints never mix.

    The launching process does it before Hydra opens main.log there and before any rank exists,
    so no rank waits on it; an external torchrun's ranks leave it to rank 0's
    :class:`~hybrid_rl.trainer.run_control.RunControl`. A folder it cannot move: one line, exit 2."""
    from hybrid_rl.resume import checkpoint_to_resume, set_aside_earlier_run, set_aside_newer_checkpoints

    if cfg is None or cfg.trainer.task != "rl":
        return
    if (chosen := checkpoint_to_resume(cfg)) is not None:
        if str(cfg.trainer.resume) not in ("auto", "must") and (line := set_aside_newer_checkpoints(cfg.trainer.output_dir, chosen)):
            STARTUP_LINES.append(line)
        return
    rm, data = cfg.reward.reward_model, cfg.data
    reads = [cfg.model.path, *([rm.path] if rm.path else []), *rm.ensemble, *data.train_files, *data.val_files,
             *[f.path for f in cfg.reward.functions if f.path]]  # fmt: skip
    try:
        line = set_aside_earlier_run(str(cfg.trainer.resume), cfg.trainer.output_dir, reads=tuple(str(r) for r in reads))
    except (OSError, ValueError) as e:
        where = f"trainer.output_dir={cfg.trainer.output_dir}"
        print(f"config error: {where}: cannot move the earlier run's files aside: {e}", file=sys.stderr)
        sys.exit(2)
    if line:
        STARTUP_LINES.append(line)


def say_startup_lines() -> None:
    """:data:`STARTUP_LINES`, once Hydra's logging (console and main.log) is set up."""
    for line in STARTUP_LINES:
        log.warning(line)
    STARTUP_LINES.clear()


def relaunch_with_ranks(nproc: int, shutdown_grace_s: float, preload: list[str] | None = None) -> None:
    """Run ``nproc`` ranks of this same command under :mod:`hybrid_rl.launch` and exit with its
    status (the launcher lets the ranks checkpoint on Ctrl-C / SIGTERM; see there), with
    ``preload`` in their ``LD_PRELOAD``."""
    from hybrid_rl.launch import launch

    log.info("starting %d ranks%s", nproc, f" (LD_PRELOAD {':'.join(preload)})" if preload else "")
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(launch(nproc, sys.argv[1:], shutdown_grace_s, preload))


def to_log_file(message: str) -> None:
    """``message`` into main.log alone (the console has it already): the reason a run ended is
    where a person reads the run's story afterwards, not only on a terminal that may be gone."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers + log.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def run(cfg: DictConfig) -> None:
    from hybrid_rl.launch import die_with_launcher

    die_with_launcher()
    # Slurm's USR1 may come while the engines are still being built: ignore it until the RL
    # trainer installs its handler (USR1's default action would kill the rank).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    setup_process_env(threads_per_rank=max(1, (os.cpu_count() or 1) // max(world, 1)))
    from hybrid_rl.config import resolve_precision
    from hybrid_rl.dist import finish_rank, init_distributed
    from hybrid_rl.errors import HybridRLError
    from hybrid_rl.tasks import TASKS

    ctx = init_distributed(cfg.trainer.device, cfg.trainer.collective_timeout_s)
    precision = resolve_precision(cfg, ctx.device.type)
    if ctx.is_main:
        log.info(precision)
    code = 0
    try:
        TASKS[cfg.trainer.task](cfg, ctx)
    except HybridRLError as e:  # expected: one line naming what is at fault, exit 2
        print(f"error (rank {ctx.rank}): {e}", file=sys.stderr, flush=True)
        to_log_file(f"error (rank {ctx.rank}): {e}")
        code = 2
    # Every run, one rank or many, ends in finish_rank: the interpreter's own teardown can abort
    # (gloo threads, vLLM's atexit hook) and takes ~1.6 s on 2 cores; the task closed what it keeps.
    finish_rank(code)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    say_startup_lines()
    if cfg.trainer.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        from hybrid_rl.env import preload_libraries
        from hybrid_rl.errors import ConfigError

        try:
            preload = preload_libraries(cfg.trainer.preload, cfg.trainer.device)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            sys.exit(2)
        relaunch_with_ranks(cfg.trainer.nproc_per_node, cfg.trainer.shutdown_grace_s, preload)
    run(cfg)


if __name__ == "__main__":
    if "HYBRID_RL_LAUNCHER_PID" not in os.environ:
        composed = preflight_or_exit(sys.argv[1:])
        if "RANK" not in os.environ:  # not a rank of an external torchrun (see start_clean_or_exit)
            start_clean_or_exit(composed)
    main()
