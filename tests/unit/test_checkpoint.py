"""Checkpoint visibility: only finished checkpoints (with a manifest) are ever resumed from."""

import json

import pytest

from hybrid_rl.trainer.checkpoint import MANIFEST, latest_checkpoint, list_checkpoints

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
