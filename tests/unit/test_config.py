"""Config composition: every recipe composes, typos fail naming the key, defaults match the schema."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hybrid_rl.config import ConfigError, register_configs, validate
from hybrid_rl.config.preflight import preflight
from hybrid_rl.config.training import MOVED_KEYS
from hybrid_rl.main import one_line_error

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))
register_configs()


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe):
    from hybrid_rl.config import Config
    from hybrid_rl.config.enums import Task

    cfg = compose_cfg(f"+recipe={recipe}")
    validate(cfg, world_size=cfg.trainer.nproc_per_node)
    if recipe != "grpo_math_gpu":  # its model.path is ??? (required)
        typed = OmegaConf.to_object(cfg)
        assert isinstance(typed, Config) and isinstance(typed.trainer.task, Task)


def test_recipes_only_override():
    """A recipe is `# @package _global_` and sets keys the schema already has."""
    for name in RECIPES:
        text = (CONF / "recipe" / f"{name}.yaml").read_text()
        assert text.startswith("# @package _global_"), name


def test_group_files_agree_with_schema_defaults():
    cfg = compose_cfg()
    from hybrid_rl import config as c

    for group, cls in [
        ("model", c.ModelConfig),
        ("data", c.DataConfig),
        ("rollout", c.RolloutConfig),
        ("actor", c.ActorConfig),
        ("algorithm", c.AlgorithmConfig),
        ("critic", c.CriticConfig),
        ("preference", c.PreferenceConfig),
        ("reward", c.RewardConfig),
        ("trainer", c.TrainerConfig),
        ("logger", c.LoggerConfig),
    ]:
        want = OmegaConf.to_container(OmegaConf.structured(cls), resolve=False)
        got = OmegaConf.to_container(cfg[group], resolve=False)
        assert got == want, f"conf/{group}/*.yaml disagrees with hybrid_rl/config.py:{cls.__name__}"


def test_unknown_key_fails_naming_it():
    with pytest.raises(Exception) as e:
        compose_cfg("model.paht=/x")
    assert "paht" in one_line_error(e.value)
    assert "\n" not in one_line_error(e.value)


def test_wrong_type_fails_naming_key():
    with pytest.raises(Exception) as e:
        compose_cfg("rollout.n=many")
    msg = one_line_error(e.value)
    assert "rollout.n" in msg and "\n" not in msg


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_a_moved_key_names_its_new_place(old, tmp_path):
    """The old spelling of a key that moved into a section fails naming the new key, from the
    command line and from a recipe file alike (a bool where a section now is, too)."""
    with pytest.raises(Exception) as e:
        compose_cfg(f"{old}=1")
    assert one_line_error(e.value) == f"{old} is now {MOVED_KEYS[old]}"
    group, key = old.split(".")
    recipe = CONF / "recipe" / f"zz_moved_{key}.yaml"
    recipe.write_text(f"# @package _global_\n{group}:\n  {key}: 1\n")
    try:
        with pytest.raises(Exception) as e:
            compose_cfg(f"+recipe={recipe.stem}")
    finally:
        recipe.unlink()
    assert one_line_error(e.value) == f"{old} is now {MOVED_KEYS[old]}"


def test_a_removed_key_says_why_and_an_added_key_is_refused():
    with pytest.raises(Exception) as e:
        compose_cfg("algorithm.greedy_baseline=true")
    assert one_line_error(e.value).startswith("algorithm.greedy_baseline was removed: ")
    # `+key=value` opens Hydra's struct: the key would be dropped silently by the typed object
    cfg = compose_cfg("+recipe=grpo_math", "+actor.lrr=3", "+algorithm.tis_mode=token")
    assert preflight(cfg, 2) == ["actor.lrr is not a key of the schema", "algorithm.tis_mode is now algorithm.tis.mode"]


def test_declared_params_bind_from_the_algorithm_section():
    """Every registered estimator and loss reads keys the schema has, with the schema's defaults."""
    from dataclasses import fields

    from hybrid_rl.algorithms.registry import ADV_ESTIMATORS, POLICY_LOSSES, bind_params
    from hybrid_rl.config import AlgorithmConfig

    cfg = compose_cfg("+recipe=gfpo_math", "algorithm.gamma=0.5").algorithm
    default = AlgorithmConfig()
    for reg in (ADV_ESTIMATORS, POLICY_LOSSES):
        for name in reg:
            params = bind_params(reg, name, cfg)
            if params is None:
                continue
            for f in fields(params):
                assert getattr(params, f.name) == getattr(cfg, f.name), (name, f.name)
                assert f.default == getattr(default, f.name) or f.default_factory() == getattr(default, f.name), (name, f.name)
    assert bind_params(ADV_ESTIMATORS, "gfpo", cfg).gfpo.keep == 8  # a section arrives as its dataclass
    assert type(bind_params(ADV_ESTIMATORS, "gfpo", cfg).gfpo).__name__ == "GFPOSettings"
    assert bind_params(ADV_ESTIMATORS, "gae", cfg).gamma == 0.5


def test_cli_typo_is_one_line_and_exit_2():
    p = subprocess.run(
        [sys.executable, "-m", "hybrid_rl.main", "+recipe=grpo_math", "trainer.totl_steps=3"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "totl_steps" in lines[0], p.stderr


@pytest.mark.parametrize("flags", [["--cfg", "job"], ["-c", "job", "--package", "rollout"], ["--info", "config"]])
def test_hydra_flags_and_their_values_pass_through(flags):
    """The README's ``--cfg job`` form: Hydra's own flags (with values) are not overrides."""
    p = subprocess.run(
        [sys.executable, "-m", "hybrid_rl.main", "+recipe=grpo_math", *flags],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert ("temperature:" in p.stdout) or ("Config search path" in p.stdout)


def test_unknown_recipe_lists_available():
    p = subprocess.run(
        [sys.executable, "-m", "hybrid_rl.main", "+recipe=grpo_mth"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode == 2
    assert "grpo_mth" in p.stderr and "grpo_math" in p.stderr and "sft_math" in p.stderr


@pytest.mark.parametrize(
    ("overrides", "world", "needle"),
    [
        (["rollout.n=1"], 1, "rollout.n=1"),
        (["data.train_batch_size=3"], 2, "data.train_batch_size=3"),
        (["actor.mini_batch_size=7"], 1, "actor.mini_batch_size=7"),
        (["algorithm.adv_estimator=grpoo"], 1, "known:"),
        (["algorithm.loss_agg_mode=mean"], 1, "loss_agg_mode"),
        (["rollout.temperature=0"], 1, "rollout.temperature=0"),
        (["rollout.top_p=0"], 1, "rollout.top_p=0"),
        (["algorithm.adv_estimator=drgrpo", "rollout.n=1"], 1, "rollout.n=1 with algorithm.adv_estimator=drgrpo"),
        (["algorithm.adv_estimator=gfpo", "rollout.n=1"], 1, "rollout.n=1 with algorithm.adv_estimator=gfpo"),
        (["model.dtype=bfloat16"], 1, "model.dtype=bfloat16 was removed"),
        (["critic.loss_agg_mode=mean"], 1, "critic.loss_agg_mode"),
        (["reward.reward_model.ensemble=[/a]"], 1, "reward.reward_model.ensemble needs reward.reward_model.path"),
        (["+recipe=rlhf_ppo", "reward.reward_model.ensemble_reduce=max"], 1, "reward.reward_model.ensemble_reduce='max'"),
        # settings that would be silently moot: a critic nobody reads, a sleep level vLLM treats as "pause",
        # LoRA over a base that sleep level 2 wipes, a reward pool that can never time out
        (["critic.enable=true"], 1, "critic.enable=true with algorithm.adv_estimator=grpo, which reads no values"),
        (["rollout.sleep_level=0"], 1, "rollout.sleep_level=0 must be 1"),
        (["rollout.sleep_level=2", "actor.lora.rank=8"], 1, "rollout.sleep_level=2 with actor.lora.rank=8"),
        (["reward.timeout_s=0"], 1, "reward.timeout_s=0.0 must be > 0"),
        (["reward.num_workers=0"], 1, "reward.num_workers=0 must be >= 1"),
        (["+recipe=sft_math", "trainer.resume=must"], 1, "trainer.resume='must' with trainer.task=sft"),
    ],
)
def test_contradictory_settings_are_named(overrides, world, needle):
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("=", "=")):
        validate(cfg, world)


@pytest.mark.parametrize(
    ("override", "allowed"),
    [
        ("data.truncation=chop", "[skip, left, right, error]"),
        ("rollout.dtype=fp8", "[auto, float32, bfloat16, float16]"),
        ("trainer.task=ppo", "[rl, sft, dpo, rm, eval]"),
        ("algorithm.tis.mode=seq", "[none, token, sequence]"),
        ("actor.lr_schedule=linear", "[constant, cosine]"),
        ("logger.backends=[console,tb]", "[console, tensorboard, jsonl, wandb, mlflow]"),
    ],
)
def test_closed_sets_are_enums_refused_at_compose_time(override, allowed):
    with pytest.raises(Exception) as e:
        compose_cfg(override)
    msg = one_line_error(e.value)
    assert allowed in msg and override.split("=")[0] in msg and "\n" not in msg


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "grpo_math_gpu"])
def test_the_ci_overlay_stacks_on_every_recipe(recipe):
    """``+overlay=ci_tiny`` is the one place for the tiny-run settings the tests share."""
    # recipes whose own constraints need more room than the overlay's 4 x 16 tokens
    extra = {"dapo_math": ["rollout.max_response_length=24"], "gfpo_math": ["rollout.n=8", "algorithm.gfpo.keep=4"]}
    cfg = compose_cfg(f"+recipe={recipe}", "+overlay=ci_tiny", *extra.get(recipe, []))
    validate(cfg, world_size=1)
    assert cfg.model.path == "builtin:tiny" and cfg.trainer.export_hf is False and cfg.logger.progress_bar is False


@pytest.mark.parametrize(
    "flags, device, want",
    [
        ({"avx512f", "avx512_bf16"}, "cpu", "bfloat16"),
        ({"amx_tile", "amx_bf16", "avx512f"}, "cpu", "bfloat16"),
        ({"avx512f", "avx2"}, "cpu", "float32"),  # bf16 would be emulated: slower than fp32
        (set(), "cpu", "float32"),
    ],
)
def test_auto_precision_follows_the_hardware(flags, device, want):
    """actor.param_dtype=auto and rollout.dtype=auto (the defaults) become bf16 only where the CPU
    has native bf16 math; explicit values are kept; the summary names the reason."""
    from unittest import mock

    from hybrid_rl import env
    from hybrid_rl.config import resolve_precision

    assert env.auto_dtype(device, frozenset(flags)) == want
    with mock.patch.object(env, "cpu_flags", return_value=frozenset(flags)):
        cfg = compose_cfg("+recipe=grpo_math")
        assert (cfg.actor.param_dtype, cfg.rollout.dtype) == ("auto", "auto")
        summary = resolve_precision(cfg, device)
        assert cfg.rollout.dtype == want
        assert cfg.actor.param_dtype == (None if want == "float32" else want)
        assert ("avx512_bf16" in summary or "amx_bf16" in summary) == (want == "bfloat16")
        validate(cfg)
        pinned = compose_cfg("+recipe=grpo_math", "actor.param_dtype=null", "rollout.dtype=float32")
        resolve_precision(pinned, device)
        assert (pinned.actor.param_dtype, pinned.rollout.dtype) == (None, "float32")


def test_auto_compute_dtype_reaches_the_engine_builders():
    from unittest import mock

    import torch

    from hybrid_rl import env
    from hybrid_rl.engine.fsdp import to_dtype

    with mock.patch.object(env, "cpu_flags", return_value=frozenset({"avx512_bf16"})):
        assert to_dtype("auto", "cpu") is torch.bfloat16
    with mock.patch.object(env, "cpu_flags", return_value=frozenset({"avx2"})):
        assert to_dtype("auto", torch.device("cpu")) is None  # fp32: no mixed-precision cast
    assert to_dtype(None) is None and to_dtype("float32") is torch.float32
