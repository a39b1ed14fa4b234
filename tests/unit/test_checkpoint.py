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
