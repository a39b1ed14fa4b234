"""`make compare --keep`: carrying an earlier result's runs over for the recipes not re-run."""

import argparse
import json

import pytest

from benchmarks.compare_algorithms import carried_runs

pytestmark = pytest.mark.unit


def old_result(tmp_path, steps=100):
    run = {"recipe": "x", "val_after": 0.3, "seed": 1}
    payload = {
        "settings": {"steps": steps, "seeds": "1,2", "pass_k": 4},
        "machine": {"time": "2026-12-02T17:35:00"},
        "runs": {"grpo_math": [dict(run, recipe="grpo_math")], "ppo_math": [dict(run, recipe="ppo_math")]},
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(payload))
    return str(path)


def args(**kw):
    return argparse.Namespace(**{"steps": 100, "seeds": "1,2", "pass_k": 4, "recipes": "grpo_math", **kw})


def test_carries_only_the_recipes_not_rerun_and_marks_them(tmp_path):
    kept, source = carried_runs(old_result(tmp_path), args())
    assert list(kept) == ["ppo_math"]
    assert kept["ppo_math"][0]["carried_from"] == "2026-12-02T17:35:00" == source["time"]


def test_a_run_carried_twice_keeps_the_time_it_was_measured(tmp_path):
    path = old_result(tmp_path)
    d = json.loads(open(path).read())
    d["runs"]["ppo_math"][0]["carried_from"] = "2026-12-01T00:00:00"
    open(path, "w").write(json.dumps(d))
    kept, _ = carried_runs(path, args())
    assert kept["ppo_math"][0]["carried_from"] == "2026-12-01T00:00:00"


@pytest.mark.parametrize("field,value", [("steps", 250), ("seeds", "1"), ("pass_k", 0)])
def test_refuses_a_result_measured_with_other_settings(tmp_path, field, value):
    with pytest.raises(SystemExit, match=f"settings.{field}"):
        carried_runs(old_result(tmp_path), args(**{field: value}))


@pytest.mark.parametrize("text", [None, "{not json", '{"settings": {}}'])
def test_a_missing_or_foreign_file_is_named(tmp_path, text):
    path = tmp_path / "old.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit, match="old.json: not a readable compare_algorithms.json"):
        carried_runs(str(path), args())
