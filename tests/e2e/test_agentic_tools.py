"""A multi-turn rollout whose model really calls the tool, on the real stack: vLLM generates, the
sandbox runs the model-written code, and the loss mask leaves the tool's output out.

A random-init model never writes a well-formed call, so the recipe test's agentic case passes
with no tool call at all. Here a short SFT on the tool-use trajectories (``sft_math_tool``: call
``python`` with the product, read its output, answer) gives a model that calls the tool, and two
GRPO steps of ``agentic_math_tool`` run from it.
"""

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
LENGTH_REWARD = ROOT / "tests" / "e2e" / "length_reward.py"


def python_prints(expr: str) -> str:
    """What ``print(expr)`` writes in Python or, where it raises, the error's name: the sandbox tool
    returns a failed run's last traceback line, which begins with it. A sampled call can be
    malformed (``print(* * 965)``), and then the tool's output must say so."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(f"print({expr})", {"__builtins__": {"print": print}})  # digits, spaces, brackets and + - * only
    except Exception as e:  # SyntaxError or TypeError: what a malformed call raises
        return type(e).__name__
    return out.getvalue().strip()


def main(out: Path, recipe: str, *overrides: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "hybrid_rl.main",
        f"+recipe={recipe}",
        "+overlay=ci_tiny",
        "trainer.nproc_per_node=1",
        f"trainer.output_dir={out}",
        *overrides,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-6000:]


def test_agentic_rollout_runs_the_models_code_and_masks_the_tool_output(tmp_path):
    # measured: 40 steps of 32 trajectories, then 99% of the samples call the tool (bf16, 2 cores)
    main(tmp_path / "sft", "sft_math_tool", "trainer.total_steps=40", "data.train_batch_size=32", "actor.micro_batch_size=32",
         "actor.lr=3e-3", "actor.warmup_steps=5", "data.val_size=4")  # fmt: skip
    main(tmp_path / "rl", "agentic_math_tool", f"model.path={tmp_path / 'sft' / 'hf'}", "trainer.total_steps=2", "data.train_batch_size=8",
         "rollout.max_response_length=48", "rollout.temperature=0.7", "logger.generations=100000", "logger.generations_every=1",
         # the tiny model's products are wrong (score 0 everywhere); a length reward gives its groups some variance to train on
         f"reward.functions=[{{name: custom, weight: 1.0, path: {LENGTH_REWARD}, function: score}}]")  # fmt: skip
    rows = [
        r for r in map(json.loads, (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()) if "agent/tool_call_rate" in r
    ]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["agent/tool_call_rate"] >= 0.5 and r["agent/tool_tokens"] > 0 for r in rows), rows
    assert all(r["actor/grad_norm"] > 0 for r in rows), rows
    samples = [json.loads(x) for x in (tmp_path / "rl" / "generations" / "train_step_0001.jsonl").read_text().splitlines()]
    ran = 0
    for s in samples:
        call, _, rest = s["response"].partition("</tool_call>")
        if "<tool_call>" not in call or s["trained_tokens"] == 0:  # no call, or masked whole (truncated)
            continue
        # the tokens the loss leaves out are the tool's turn alone, not the model's call or answer
        assert s["trained_tokens"] < s["response_tokens"], s
        assert "<tool_call>" not in s["untrained"] and "boxed" not in s["untrained"], s
        arithmetic = re.fullmatch(
            r'\s*\{"name": "python", "arguments": \{"code": "print\(([0-9 ()+*-]+)\)"\}\}', call.split("<tool_call>", 1)[1]
        )
        # what Python prints for it (or the error it raises), the sandbox printed; no powers (** can run for minutes)
        if arithmetic and "**" not in arithmetic.group(1) and not re.search(r"\b0[0-9]", arithmetic.group(1)):
            value = python_prints(arithmetic.group(1))
            assert value in s["untrained"] and value in rest, (arithmetic.group(1), value, s)
            ran += 1
    assert ran >= len(samples) // 4, f"{ran} of {len(samples)} samples ran a print() call"
