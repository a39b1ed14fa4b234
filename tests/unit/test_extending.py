"""One worked example of each extension point, with the files it touches (README "Extending"):

| add | files |
|---|---|
| an advantage estimator | a module in hybrid_rl/algorithms/ (function + @register_adv_est), its test, a recipe |
| a reward function | rewards/functions.py (function + BUILTIN entry) and its test; or none: reward.functions[].name=custom |
| a tool | its class in any importable module, and a line in the tool YAML |
| a rollout backend | its module, one BACKENDS line (or register_backend), its test |
"""

import asyncio
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from hybrid_rl.algorithms.advantages import AdvantageInputs
from hybrid_rl.algorithms.registry import ADV_ESTIMATORS, register_adv_est

pytestmark = pytest.mark.unit


def test_an_advantage_estimator_is_one_registered_function():
    if "sign_of_group_gap" not in ADV_ESTIMATORS:

        @register_adv_est("sign_of_group_gap", needs=("group",))
        def sign_of_group_gap(inp: AdvantageInputs, cfg):
            """A toy estimator: +1 above the group mean, -1 below."""
            scores = (inp.token_rewards * inp.response_mask).sum(-1)
            mean = torch.zeros_like(scores).index_reduce_(0, inp.group_ids, scores, "mean", include_self=False)
            adv = torch.sign(scores - mean[inp.group_ids])[:, None] * inp.response_mask
            return adv, adv

    from hybrid_rl.config import ConfigError, validate
    from tests.unit.test_config import compose_cfg

    validate(compose_cfg("algorithm.adv_estimator=sign_of_group_gap"), 1)  # the config accepts it
    with pytest.raises(ConfigError, match="group baseline needs n >= 2"):  # and reads its declared needs
        validate(compose_cfg("algorithm.adv_estimator=sign_of_group_gap", "rollout.n=1"), 1)
    mask = torch.ones(4, 2)
    rewards = torch.zeros(4, 2)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 3.0, 5.0])
    adv, _ = ADV_ESTIMATORS["sign_of_group_gap"](AdvantageInputs(rewards, mask, torch.tensor([0, 0, 1, 1])), None)
    assert adv[:, 0].tolist() == [1.0, -1.0, -1.0, 1.0]
    ADV_ESTIMATORS.unregister("sign_of_group_gap")


def test_a_reward_function_is_one_function(tmp_path):
    from hybrid_rl.rewards.functions import resolve

    f = tmp_path / "my_reward.py"
    f.write_text(
        "def brevity(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0 / (1 + len(solution_str))\n"
    )
    fn = resolve("custom", str(f), "brevity")
    assert fn("x", "abc", None) == 0.25


def test_a_tool_is_one_class_and_a_yaml_line(tmp_path, monkeypatch):
    from hybrid_rl.rollout.tools import ToolResult, load_tools

    mod = tmp_path / "echo_tool.py"
    mod.write_text(
        textwrap.dedent("""
        from hybrid_rl.rollout.tools import ToolResult

        class Echo:
            name = "echo"
            schema = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}

            async def execute(self, arguments):
                return ToolResult(str(arguments.get("text", "")))
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "tools.yaml").write_text("tools:\n  - class_name: echo_tool.Echo\n")
    (tool,) = load_tools(tmp_path / "tools.yaml")
    assert asyncio.run(tool.execute({"text": "hi"})) == ToolResult("hi")
    sys.modules.pop("echo_tool", None)


def test_a_rollout_backend_is_a_module_and_a_name():
    from hybrid_rl.rollout import backends
    from hybrid_rl.trainer.build import build_rollout_engine

    class Recording:
        def __init__(self, model_path, rollout_cfg, dtype, seed, device, max_model_len, trust_remote_code):
            self.args = (model_path, dtype, seed, max_model_len)

    sys.modules["my_backend"] = SimpleNamespace(Recording=Recording)
    try:
        backends.register_backend("recording", "my_backend:Recording")
        cfg = SimpleNamespace(
            rollout=SimpleNamespace(backend="recording", dtype="float32"), model=SimpleNamespace(trust_remote_code=False),
            actor=SimpleNamespace(lora=SimpleNamespace(rank=0)),
        )
        engine = build_rollout_engine("/m", cfg, SimpleNamespace(rank=1, device="cpu"), 256, seed=10)
        assert isinstance(engine, Recording) and engine.args == ("/m", "float32", 11, 256)
        with pytest.raises(KeyError, match="known: .*vllm"):
            backends.build_backend("sglang")
    finally:
        backends.BACKENDS.pop("recording", None)
        sys.modules.pop("my_backend", None)
