"""Evaluating a checkpoint: its run's settings by default, the command line's where given, and a
folder of its own for every evaluation."""

import json

from omegaconf import OmegaConf

from hybrid_rl.config import register_configs
from hybrid_rl.config.compose import compose_recipe
from hybrid_rl.trainer.eval_setup import eval_folder, inherit_run_settings

register_configs()


def eval_cfg():
    return compose_recipe("eval_math", "tiny")


def checkpoint(tmp_path, **data):
    recorded = OmegaConf.to_container(compose_recipe("grpo_math", "tiny"), resolve=True, enum_to_str=True)
    recorded["data"].update(data)
    recorded["rollout"]["max_response_length"] = 48
    recorded["reward"]["functions"] = [{"name": "custom", "weight": 1.0, "path": "r.py", "function": "score"}]
    ckpt = tmp_path / "my_run" / "checkpoints" / "step_000100"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"config": recorded}))
    return ckpt


def test_a_checkpoint_brings_its_runs_files_lengths_and_reward(tmp_path):
    ckpt = checkpoint(tmp_path, val_files=["/data/test.parquet"], max_prompt_length=300, system_prompt="Be brief.")
    cfg = eval_cfg()
    taken = inherit_run_settings(cfg, ckpt, given={"model.path", "recipe"})
    assert list(cfg.data.val_files) == ["/data/test.parquet"] and cfg.data.max_prompt_length == 300
    assert cfg.data.system_prompt == "Be brief." and cfg.rollout.max_response_length == 48
    assert cfg.reward.functions[0].function == "score"
    assert any(t.startswith("data.val_files=") for t in taken) and any(t.startswith("reward.functions=") for t in taken)


def test_the_command_line_wins(tmp_path):
    ckpt = checkpoint(tmp_path, val_files=["/data/test.parquet"], max_prompt_length=300)
    cfg = eval_cfg()
    inherit_run_settings(cfg, ckpt, given={"data.val_files", "reward.functions", "data.synth.seed"})
    assert list(cfg.data.val_files) == list(eval_cfg().data.val_files)
    assert cfg.reward.functions[0].name == "math" and cfg.data.max_prompt_length == 300


def test_a_model_folder_inherits_nothing(tmp_path):
    cfg = eval_cfg()
    assert inherit_run_settings(cfg, tmp_path, given=set()) == []


def test_every_eval_gets_its_own_folder_unless_one_is_given(tmp_path):
    ckpt = checkpoint(tmp_path)
    first = eval_folder(str(tmp_path / "evals"), str(ckpt), set())
    assert first.parent == tmp_path / "evals" and first.name.startswith("my_run-step_000100-")
    first.mkdir(parents=True)
    second = eval_folder(str(tmp_path / "evals"), str(ckpt), set())
    assert second != first
    assert eval_folder(str(tmp_path / "mine"), str(ckpt), {"trainer.output_dir"}) == tmp_path / "mine"
    assert eval_folder(str(tmp_path / "evals"), "/models/Qwen2.5-0.5B", set()).name.startswith("Qwen2.5-0.5B-")


def test_prepare_eval_takes_the_runs_settings_and_a_new_folder(tmp_path):
    """What the eval task calls: the checkpoint's settings into the config, a folder of its own."""
    from hybrid_rl.trainer.eval_setup import prepare_eval

    ckpt = checkpoint(tmp_path, val_files=["/data/test.parquet"])
    cfg = eval_cfg()
    cfg.trainer.output_dir = str(tmp_path / "evals")
    out = prepare_eval(cfg, str(ckpt), is_main=True)
    assert list(cfg.data.val_files) == ["/data/test.parquet"] and cfg.rollout.max_response_length == 48
    assert out.parent == tmp_path / "evals" and out.name.startswith("my_run-step_000100-")
