"""A bad config fails in the launching process before anything starts: one line naming every
problem, exit 2. Each case is a row of the README's fault table; each runs the real command."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_rl.config.registered import registered, scanned

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
# What a run prints once it starts building anything: the launcher, a warm start, an engine.
STARTED = ("starting 2 ranks", "building builtin:", "vllm", "Loading", "precision:")


def run_main(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybrid_rl.main", *overrides], capture_output=True, text=True, check=False, cwd=ROOT, timeout=60
    )


def refused(*overrides: str) -> str:
    """The one line a refused command prints; asserts exit 2 and that nothing started."""
    p = run_main(*overrides)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(lines) == 1 and lines[0].startswith("config error: "), lines
    assert not any(word in lines[0] for word in STARTED[:2])
    return lines[0]


def fake_model(tmp_path: Path, chat_template: bool = True, max_positions: int = 4096) -> Path:
    """A model folder as far as the checks read it: config.json, tokenizer_config.json, a weights file."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": max_positions}))
    tok = {"chat_template": "{{ messages }}"} if chat_template else {}
    (d / "tokenizer_config.json").write_text(json.dumps(tok))
    (d / "model.safetensors").write_bytes(b"not read by the checks")
    return d


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["+recipe=grpo_math", "algorithm.adv_estimator=foo"], "algorithm.adv_estimator='foo' is unknown; known: drgrpo, gae"),
        (["+recipe=grpo_math", "rollout.temperature=0"], "rollout.temperature=0.0 must be > 0"),
        (["+recipe=grpo_math", "model.path=/models/nope"], "model.path='/models/nope' does not exist"),
        (["+recipe=grpo_math", "reward.functions=[{name: custom, path: /nope/r.py, function: score}]"],
         "reward.functions[0].path: reward function file '/nope/r.py' does not exist"),
        (["+recipe=grpo_math_gpu"], "model.path is required (marked ??? in conf/recipe/grpo_math_gpu.yaml)"),
        (["+recipe=grpo_math", "model.sft_recipe=nope"], "model.sft_recipe='nope': no recipe conf/recipe/nope.yaml"),
        (["+recipe=grpo_math", "data.train_files=[/nope/train.parquet]"], "data.train_files: '/nope/train.parquet' does not exist"),
        (["+recipe=grpo_math", "data.truncation=chop"], "expected one of [skip, left, right, error]"),
        (["+recipe=grpo_math", "trainer.profile_steps=[300]"], "trainer.profile_steps=[300] must be steps 1..trainer.total_steps=250"),
        (["+recipe=grpo_math", "algorithm.policy_loss=reinforce", "actor.epochs=2"], "algorithm.policy_loss=reinforce has no importance ratio"),
        (["+recipe=grpo_math", "data.train_size=16"], "data.train_size=16 keeps fewer rows than one batch (data.train_batch_size=32)"),
        (["+recipe=grpo_math", "data.synth.levels=[1,8]"], "data.synth.levels=[1, 8]: each level must be one of 1, 2, 3, 4, 5, 6, 7"),
        # the checks of the other tasks
        (["+recipe=sft_math", "trainer.nproc_per_node=2", "data.train_batch_size=3"], "data.train_batch_size=3 does not divide over 2 ranks"),
        (["+recipe=dpo_math", "preference.beta=0"], "preference.beta=0.0 must be > 0"),
        (["+recipe=dpo_math", "actor.max_tokens_per_micro=512"], "actor.max_tokens_per_micro must be 0 for dpo/rm"),
        (["+recipe=rm_math", "preference.rm_loss=listwise", "preference.list_size=1"], "preference.list_size=1 must be >= 2"),
        # the warm start's own config is checked before it would run
        (["+recipe=grpo_math", "trainer.nproc_per_node=3", "data.train_batch_size=3", "actor.mini_batch_size=24"],
         "warm start sft_math_short: data.train_batch_size=64 does not divide over 3 ranks"),
    ],
)  # fmt: skip
def test_fault_table_row_fails_in_one_line(overrides, needle):
    assert needle in refused(*overrides)


def test_every_problem_is_named_at_once():
    line = refused("+recipe=grpo_math", "algorithm.adv_estimator=foo", "rollout.temperature=0", "model.path=/models/nope")
    for needle in ("algorithm.adv_estimator='foo'", "rollout.temperature=0.0", "model.path='/models/nope'"):
        assert needle in line


def test_required_key_set_on_the_command_line_is_accepted(tmp_path):
    """grpo_math_gpu with model.path: no 'required' error (the fake folder is checked instead)."""
    model = fake_model(tmp_path, max_positions=1024)
    line = refused("+recipe=grpo_math_gpu", f"model.path={model}")
    assert "is required" not in line and "1536 exceeds the model's max_position_embeddings=1024" in line


def test_a_model_without_chat_template_is_named(tmp_path):
    model = fake_model(tmp_path, chat_template=False)
    assert f"model.path='{model}': the tokenizer has no chat template" in refused("+recipe=grpo_math", f"model.path={model}")


def test_a_custom_reward_whose_signature_does_not_fit_is_named(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def score(solution_str):\n    return 1.0\n\ndef other(a, b, c, d):\n    return 0.0\n")
    line = refused("+recipe=grpo_math", f"reward.functions=[{{name: custom, path: {f}, function: score}}]")
    assert "reward.functions[0].function: score(solution_str)" in line and "cannot be called" in line
    line = refused("+recipe=grpo_math", f"reward.functions=[{{name: custom, path: {f}, function: nope}}]")
    assert "has no function 'nope'" in line and "other, score" in line


def test_a_good_config_passes_the_preflight():
    """The checks do not refuse what the recipes ship (all composed and checked in-process)."""
    from hydra import compose, initialize_config_dir

    from hybrid_rl.config import register_configs
    from hybrid_rl.config.preflight import preflight, required_problems

    register_configs()
    for recipe in sorted(p.stem for p in (ROOT / "conf" / "recipe").glob("*.yaml")):
        if recipe == "grpo_math_gpu":
            continue
        overrides = [f"+recipe={recipe}"]
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
            assert required_problems("config", overrides) + preflight(cfg, cfg.trainer.nproc_per_node) == [], recipe


def test_registry_names_read_from_source_match_the_live_registries():
    from hybrid_rl.algorithms.registry import ADV_ESTIMATORS, POLICY_LOSSES
    from hybrid_rl.rewards.ensemble import ENSEMBLE_REDUCERS
    from hybrid_rl.rollout.backends import BACKENDS

    source = scanned()
    assert source.kinds["adv_estimator"] == ADV_ESTIMATORS.needs
    assert set(source.kinds["policy_loss"]) == set(POLICY_LOSSES)
    assert set(source.kinds["ensemble_reduce"]) == set(ENSEMBLE_REDUCERS)
    assert set(source.kinds["backend"]) == set(BACKENDS)
    assert registered().names("adv_estimator") == sorted(ADV_ESTIMATORS)
    assert {n: c.__name__ if c else None for n, c in ADV_ESTIMATORS.params.items()} == source.params["adv_estimator"]
    assert {n: c.__name__ if c else None for n, c in POLICY_LOSSES.params.items()} == source.params["policy_loss"]


def test_the_preflight_does_not_import_torch():
    """The launcher's budget is a few seconds; torch alone takes ~3 s to import on 2 cores."""
    code = (
        "import sys; from hybrid_rl.config.preflight import preflight; from hybrid_rl.main import preflight_or_exit; "
        "print('torch' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, timeout=60)
    assert p.stdout.strip() == "False", p.stderr
