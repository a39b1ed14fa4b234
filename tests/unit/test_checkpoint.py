"""Checkpoint visibility: only whole checkpoints (a manifest and every file it lists) are ever
resumed from, whatever point a save or a removal was killed at."""

import json
from pathlib import Path

import pytest
import torch

from hybrid_rl.trainer import checkpoint as ckpt
from hybrid_rl.trainer.checkpoint import MANIFEST, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.unit


def test_unfinished_checkpoints_are_invisible(tmp_path):
    root = tmp_path / "checkpoints"
    for step, finished in [(2, True), (4, True), (6, False)]:
        d = root / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"x")
        if finished:
            (d / MANIFEST).write_text(json.dumps({"step": step}))
    (root / ".step_000008.tmp").mkdir()  # a save killed before the rename
    (root / "step_000010").mkdir()
    (root / "step_000010" / MANIFEST).write_text("{trunc")  # a torn manifest
    assert [p.name for p in list_checkpoints(root)] == ["step_000002", "step_000004"]
    assert latest_checkpoint(root).name == "step_000004"
    assert latest_checkpoint(tmp_path / "none") is None


def test_a_manifest_next_to_missing_shards_is_invisible(tmp_path):
    d = tmp_path / "step_000002"
    d.mkdir()
    (d / "trainer_rank0.pt").write_bytes(b"x")
    (d / MANIFEST).write_text(json.dumps({"step": 2, "files": ["__0_0.distcp", "trainer_rank0.pt"]}))
    assert list_checkpoints(tmp_path) == []


def _save(root, step, value):
    state = {"app": {"w": torch.full((4,), float(value))}}
    return save_checkpoint(root, step, state, {"step": step}, keep_last=2, rank=0, world=1)


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs."""


def _rmtree_killed_midway(path, ignore_errors=False):
    """Remove one file of the tree, then die, as a kill during shutil.rmtree would."""
    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
    files[0].unlink()
    raise Killed


@pytest.mark.parametrize("how", ["same_step_saved_again", "pruned"])
def test_a_kill_while_a_checkpoint_is_removed_leaves_the_newest_whole(tmp_path, monkeypatch, how):
    """CI saw this: a stop right after a scheduled save wrote the same step again, the old copy
    was removed in place, and a kill mid-removal left step_000002 with its manifest and without
    rank 0's shard; the resume then failed. Now a removed checkpoint is renamed away first."""
    root = tmp_path / "checkpoints"
    _save(root, 1, 1.0)
    _save(root, 2, 2.0)
    monkeypatch.setattr(ckpt.shutil, "rmtree", _rmtree_killed_midway)
    with pytest.raises(Killed):
        _save(root, 2, 3.0) if how == "same_step_saved_again" else _save(root, 3, 3.0)
    monkeypatch.undo()
    newest = latest_checkpoint(root)
    state = {"app": {"w": torch.zeros(4)}}
    got = load_checkpoint(newest, state, rank=0)
    assert (newest.name, got["step"], state["app"]["w"].tolist()) == (
        ("step_000002", 2, [3.0] * 4) if how == "same_step_saved_again" else ("step_000003", 3, [3.0] * 4)
    )
    assert all(load_checkpoint(p, {"app": {"w": torch.zeros(4)}}, rank=0) for p in list_checkpoints(root))
    _save(root, 4, 4.0)  # the next save clears what the kill left behind (keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == [f"step_{s:06d}" for s in ((2, 4) if how != "pruned" else (3, 4))]


# ---------------------------------------------------------------- settings a resume refuses


def _checkpoint_of(cfg, root: Path, saved: dict, model: dict | None = None) -> None:
    """A finished (empty) checkpoint under ``root/checkpoints`` whose manifest records ``saved``."""
    from hybrid_rl.resume import model_identity

    ckpt_dir = root / "checkpoints" / "step_000002"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"step": 2, "files": [], "model": model or model_identity(cfg.model), "config": saved}
    (ckpt_dir / MANIFEST).write_text(json.dumps(manifest))


def _grpo(tmp_path):
    from hybrid_rl.config import register_configs
    from hybrid_rl.config.compose import compose_recipe

    register_configs()
    cfg = compose_recipe("grpo_math", "tiny")
    cfg.trainer.output_dir = str(tmp_path)
    return cfg


def _resolved(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


# Each changes which training rows are kept or what a kept row reads, so the checkpoint's data
# position (an index into the kept rows) would point at other prompts: 1.7% of an epoch's prompts
# were drawn twice after resuming with another data.max_prompt_length.
ROW_SETTINGS = [
    ("data.max_prompt_length", 96),
    ("data.truncation", "left"),
    ("data.system_prompt", "Answer briefly."),
    ("data.prompt_key", "question"),
    ("data.synth.n_train", 5000),
    ("data.synth.seed", 1),
    ("data.synth.levels", [1, 2]),
    ("data.synth.heldout_fraction", 0.3),
    ("rollout.agent.enable", True),
]


@pytest.mark.parametrize(("key", "value"), ROW_SETTINGS, ids=[k for k, _ in ROW_SETTINGS])
def test_resume_refuses_a_setting_that_changes_the_kept_rows(tmp_path, key, value):
    from omegaconf import OmegaConf

    from hybrid_rl.resume import resume_problems

    cfg = _grpo(tmp_path)
    saved = OmegaConf.create(_resolved(cfg))
    now = OmegaConf.to_container(saved)
    OmegaConf.update(saved, key, value)
    _checkpoint_of(cfg, tmp_path, OmegaConf.to_container(saved))
    problems, notes = resume_problems(cfg, _resolved(cfg))
    assert len(problems) == 1 and not notes, (problems, notes)
    assert f"{key}: {value!r} -> {OmegaConf.select(OmegaConf.create(now), key)!r} (" in problems[0]
    assert "trainer.resume=never" in problems[0]


@pytest.mark.parametrize("agent", [True, False])
def test_resume_refuses_other_tools_only_where_the_agent_puts_them_in_the_prompts(tmp_path, agent):
    from omegaconf import OmegaConf

    from hybrid_rl.resume import resume_problems

    cfg = _grpo(tmp_path)
    cfg.rollout.agent.enable = agent
    saved = OmegaConf.create(_resolved(cfg))
    OmegaConf.update(saved, "rollout.agent.tool_config", "conf/tools/other.yaml")
    _checkpoint_of(cfg, tmp_path, OmegaConf.to_container(saved))
    problems, notes = resume_problems(cfg, _resolved(cfg))
    if agent:
        assert len(problems) == 1 and "rollout.agent.tool_config: 'conf/tools/other.yaml' ->" in problems[0]
    else:
        assert not problems and notes == [f"rollout.agent.tool_config: 'conf/tools/other.yaml' -> {cfg.rollout.agent.tool_config!r}"]


def test_resume_refuses_a_system_prompt_added_to_a_run_that_had_none(tmp_path):
    """The checkpoint records data.system_prompt as null: a prompt added on resume is a change (a
    null in the record is not a key the checkpoint lacks)."""
    from hybrid_rl.resume import resume_problems

    cfg = _grpo(tmp_path)
    _checkpoint_of(cfg, tmp_path, _resolved(cfg))
    cfg.data.system_prompt = "Answer briefly."
    problems, _ = resume_problems(cfg, _resolved(cfg))
    assert len(problems) == 1 and "data.system_prompt: None -> 'Answer briefly.'" in problems[0]


def test_a_fresh_start_refuses_to_move_what_the_run_reads(tmp_path):
    """model.path=<output_dir>/hf of an earlier run of the same name: moving hf/ aside would take
    the new run's own model away, so the start is refused and nothing moves."""
    from hybrid_rl.resume import set_aside_earlier_run

    out = tmp_path / "run"
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="is part of the earlier run's files"):
        set_aside_earlier_run("never", out, reads=(str(out / "hf"), "builtin:synth_math"))
    assert (out / "hf" / "config.json").is_file() and not (out / "previous").exists()
    assert set_aside_earlier_run("never", out, reads=("builtin:synth_math",)) is not None


@pytest.mark.parametrize("key", ["data.synth.n_val", "data.synth.n_val_seen", "data.synth.direct_share", "data.answer_key"])
def test_resume_reports_a_data_setting_that_keeps_the_training_rows(tmp_path, key):
    """The validation splits' sizes, the SFT-only direct share and the ground-truth column leave
    the kept training prompts and their order alone: printed, and the run goes on."""
    from omegaconf import OmegaConf

    from hybrid_rl.resume import resume_problems

    cfg = _grpo(tmp_path)
    saved = OmegaConf.create(_resolved(cfg))
    OmegaConf.update(saved, key, {"data.answer_key": "answer"}.get(key, 0.5 if key.endswith("share") else 7))
    _checkpoint_of(cfg, tmp_path, OmegaConf.to_container(saved))
    problems, notes = resume_problems(cfg, _resolved(cfg))
    assert not problems and [n for n in notes if n.startswith(f"{key}: ")], (problems, notes)


def test_the_generated_task_settings_are_refused_only_when_it_is_trained_on(tmp_path):
    from omegaconf import OmegaConf

    from hybrid_rl.resume import resume_problems

    cfg = _grpo(tmp_path)
    own = tmp_path / "train.parquet"
    cfg.data.train_files = [str(own)]
    saved = _resolved(cfg)
    saved["data"]["synth"]["seed"] = 3
    _checkpoint_of(cfg, tmp_path, saved)
    problems, notes = resume_problems(cfg, _resolved(cfg))
    assert not problems and "data.synth.seed: 3 -> 0" in notes, (problems, notes)
    assert OmegaConf.select(cfg, "data.val_files") == ["builtin:synth_math"]


def test_resume_refuses_another_chat_template_of_a_local_model(tmp_path):
    """The chat template lives in the tokenizer's files, not in config.json: a changed one renders
    every prompt to other tokens (and lengths, hence other kept rows). A checkpoint written before
    its hash was recorded still resumes."""
    from hybrid_rl.resume import model_identity, resume_problems

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    cfg = _grpo(tmp_path / "run")
    cfg.model.path = str(model)
    made_from = model_identity(cfg.model)
    _checkpoint_of(cfg, tmp_path / "run", _resolved(cfg), made_from)
    assert resume_problems(cfg, _resolved(cfg)) == ([], [])

    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    problems, _ = resume_problems(cfg, _resolved(cfg))
    assert len(problems) == 1 and "chat_template_sha256: " in problems[0] and "chat template changed" in problems[0], problems

    older = {k: v for k, v in made_from.items() if k != "chat_template_sha256"}
    _checkpoint_of(cfg, tmp_path / "run", _resolved(cfg), older)
    assert resume_problems(cfg, _resolved(cfg)) == ([], [])


# ---------------------------------------------------------------- a run that starts over


class FakeEngine:
    """What RunControl checkpoints of an engine: one weight tensor (and an optimizer entry)."""

    def __init__(self, value: float) -> None:
        self.w = torch.full((4,), value)

    def params_finite(self) -> bool:
        return True

    def state_dicts(self) -> tuple[dict, dict]:
        return {"w": self.w}, {"lr": torch.tensor(1.0)}

    def load_state_dicts(self, model_sd: dict, optim_sd: dict) -> None:
        self.w.copy_(model_sd["w"])


def fake_run(out: Path, resume: str, steps: int, run: float, ctx=None, keep_last: int = 2) -> dict | None:
    """What RLTrainer does with its run folder, in its order: RunControl, the metrics file, the
    resume (rows of later steps dropped), then per step a metrics row and a checkpoint. Returns
    the run state it resumed from."""
    from types import SimpleNamespace

    from hybrid_rl.dist import DistContext
    from hybrid_rl.trainer.logger import MetricsLogger
    from hybrid_rl.trainer.run_control import RunControl

    trainer = SimpleNamespace(resume=resume, keep_last=keep_last, save_every=1, save_every_minutes=0)
    control = RunControl(trainer, ctx or DistContext(0, 1, 0, torch.device("cpu")), out, FakeEngine(run), None)
    logger = MetricsLogger(SimpleNamespace(backends=["jsonl"], progress_bar=False, project="p"), out, {}, steps, True)
    state, step = None, 0
    if (path := control.resume_point()) is not None:
        state = control.load(path)
        step = int(state["step"])
        logger.truncate_after(step)
    while step < steps:
        step += 1
        logger.log(step, {"run": run})
        control.save(step, {"step": step, "run": run})
    logger.close()
    return state


def rows(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["run"]) for r in map(json.loads, path.read_text().splitlines())]


def test_a_fresh_start_moves_the_earlier_run_aside_and_a_later_resume_continues_it(tmp_path):
    """Run A to step 3, then B with trainer.resume=never to step 2, then C with resume=auto.
    B used to write into A's folder: A's step 3 stayed beside B's step 2, C resumed the discarded
    A at step 3 and pruned B's step 2, and metrics.jsonl read steps 1,2,3,1,2,4. Now B moves A's
    files to previous/<time>/ before it writes, C resumes B's step 2, and each step appears once."""
    out = tmp_path / "run"
    fake_run(out, "auto", 3, run=1.0)
    fake_run(out, "never", 2, run=2.0)
    state = fake_run(out, "auto", 4, run=3.0)
    assert (state["step"], state["run"]) == (2, 2.0)  # B's newest checkpoint, not A's step 3
    assert rows(out / "metrics.jsonl") == [(1, 2.0), (2, 2.0), (3, 3.0), (4, 3.0)]
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_000003", "step_000004"]
    (old,) = (out / "previous").iterdir()
    assert rows(old / "metrics.jsonl") == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert [p.name for p in list_checkpoints(old / "checkpoints")] == ["step_000002", "step_000003"]
    state = {"app": {"model": {"w": torch.zeros(4)}, "optim": {}}}
    assert load_checkpoint(old / "checkpoints" / "step_000003", state, 0)["run"] == 1.0


def test_resuming_an_older_checkpoint_of_the_run_moves_its_newer_ones_aside(tmp_path):
    """Run A to step 5 (keep_last=3: steps 3, 4, 5), then B resumes step 3 explicitly and runs to 4,
    then C with resume=auto. Left in place, A's step 5 stayed the newest beside B's step 4 and C
    continued the rewound run A. Now A's newer checkpoints move to previous/<time>/checkpoints and
    C continues B."""
    out = tmp_path / "run"
    fake_run(out, "auto", 5, run=1.0, keep_last=3)
    state = fake_run(out, str(out / "checkpoints" / "step_000003"), 4, run=2.0, keep_last=3)
    assert (state["step"], state["run"]) == (3, 1.0)
    (old,) = (out / "previous").iterdir()
    assert [p.name for p in list_checkpoints(old / "checkpoints")] == ["step_000004", "step_000005"]
    assert rows(out / "metrics.jsonl") == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0)]
    state = fake_run(out, "auto", 6, run=3.0, keep_last=3)
    assert (state["step"], state["run"]) == (4, 2.0)


def test_resume_auto_without_a_finished_checkpoint_starts_over_in_a_clean_folder(tmp_path):
    """A run killed before its first checkpoint (save_every_minutes=10 by default) left metrics
    rows; the re-run starts from step 0 and must not append its steps after them."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "run": 1.0}) + "\n")
    (out / "checkpoints" / ".step_000002.tmp").mkdir(parents=True)
    assert fake_run(out, "auto", 2, run=2.0) is None
    assert rows(out / "metrics.jsonl") == [(1, 2.0), (2, 2.0)]
    (old,) = (out / "previous").iterdir()
    assert rows(old / "metrics.jsonl") == [(1, 1.0)] and (old / "checkpoints" / ".step_000002.tmp").is_dir()


def test_only_rank_0_moves_the_earlier_run_and_every_rank_waits_for_it(tmp_path, monkeypatch, caplog):
    """An external torchrun's ranks: rank 0 moves (leaving this run's main.log and .hydra/,
    which Hydra opened already) and says so; every rank passes the barrier before it reads the
    folder, so none resumes or writes mid-move."""
    from types import SimpleNamespace

    from hybrid_rl.dist import DistContext
    from hybrid_rl.trainer import run_control

    out = tmp_path / "run"
    fake_run(out, "auto", 1, run=1.0)
    (out / "main.log").write_text("this run\n")
    (out / ".hydra").mkdir()
    (out / "notes.txt").write_text("the user's own file\n")
    waited = []
    monkeypatch.setattr(run_control, "barrier", lambda: waited.append(sorted(p.name for p in out.iterdir())))
    trainer = SimpleNamespace(resume="never", keep_last=2, save_every=1, save_every_minutes=0)
    run_control.RunControl(trainer, DistContext(1, 2, 1, torch.device("cpu")), out, FakeEngine(0.0), None)
    assert waited == [[".hydra", "checkpoints", "main.log", "metrics.jsonl", "notes.txt"]]  # rank 1 moved nothing
    with caplog.at_level("WARNING", logger="hybrid_rl"):
        run_control.RunControl(trainer, DistContext(0, 2, 0, torch.device("cpu")), out, FakeEngine(0.0), None)
    assert waited[1] == [".hydra", "main.log", "notes.txt", "previous"]
    (old,) = (out / "previous").iterdir()
    assert sorted(p.name for p in old.iterdir()) == ["checkpoints", "metrics.jsonl"]
    (line,) = [r.getMessage() for r in caplog.records if "previous" in r.getMessage()]
    assert line.startswith("trainer.resume=never: starting over; the earlier run's files in ")
    assert f"(checkpoints up to step_000001, metrics.jsonl) were moved to {old}" in line


def test_the_launching_process_moves_the_earlier_run_before_hydra_writes_and_says_so_once_main_log_exists(tmp_path):
    """``python -m hybrid_rl.main`` (one rank, or the launcher before it starts the ranks): the
    whole earlier run moves, its main.log and .hydra/ included, a user's own file stays, and the
    line waits for main() (Hydra's main.log). A resume from a checkpoint moves nothing."""
    from hybrid_rl import main

    out = tmp_path / "run"
    fake_run(out, "auto", 2, run=1.0)
    for name in ("main.log", "notes.txt", ".hydra/config.yaml"):
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text("earlier\n")
    cfg = _grpo(out)
    main.STARTUP_LINES.clear()
    main.start_clean_or_exit(cfg)  # resume=auto, and there is a checkpoint: it resumes
    assert not (out / "previous").exists() and main.STARTUP_LINES == []
    cfg.trainer.resume = "never"
    main.start_clean_or_exit(cfg)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "previous"]
    (old,) = (out / "previous").iterdir()
    assert sorted(p.name for p in old.iterdir()) == [".hydra", "checkpoints", "main.log", "metrics.jsonl"]
    assert main.STARTUP_LINES == [
        f"trainer.resume=never: starting over; the earlier run's files in {out} (checkpoints up to step_000002, metrics.jsonl) "
        f"were moved to {old}"
    ]
    main.STARTUP_LINES.clear()


def test_the_changed_settings_a_resume_goes_on_with_reach_main_log(tmp_path):
    """They were printed to stderr before Hydra had opened main.log, so the run's log never said
    that it went on with other settings. Now main() says them through the logger, whose handlers
    Hydra points at the console and main.log."""
    import logging

    from hybrid_rl import main

    cfg = _grpo(tmp_path)
    saved = _resolved(cfg)
    saved["rollout"]["temperature"] = 0.9
    _checkpoint_of(cfg, tmp_path, saved)
    main.STARTUP_LINES.clear()
    composed = main.preflight_or_exit(["+recipe=grpo_math", "model.preset=tiny", f"trainer.output_dir={tmp_path}"])
    assert composed is not None and composed.trainer.output_dir == str(tmp_path)
    handler = logging.FileHandler(tmp_path / "main.log")  # what Hydra's job logging adds to the root logger
    logging.getLogger().addHandler(handler)
    try:
        main.say_startup_lines()
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert "resuming with changed settings: rollout.temperature: 0.9 -> 1.0\n" in (tmp_path / "main.log").read_text()
