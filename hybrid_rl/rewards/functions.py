"""Rule-based reward functions (pure: text in, number out) and the loader for user functions.

Every function has verl's ``compute_score`` signature::

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None) -> float | dict

A dict must carry ``"score"``; its other numeric entries are logged as ``reward/<key>``.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

RewardFn = Callable[..., Any]

_BOXED = re.compile(r"\\boxed\{")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i = starts[-1]
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def normalise_ground_truth(ground_truth: Any) -> str:
    """GSM8K-style answers keep the number after ``####``; anything else is used as is."""
    gt = str(ground_truth)
    return gt.rsplit("####", maxsplit=1)[-1].strip() if "####" in gt else gt.strip()


_INTEGER = re.compile(r"[-+]?\d+")
# An integer as a final answer may be written with thousands separators or a zero fraction.
_INTEGER_LITERAL = re.compile(r"([-+]?)(\d{1,3}(?:,\d{3})+|\d+)(?:\.0*)?")
# Wrappers that do not change a number: \text{...} units, math-mode delimiters, LaTeX spaces, %.
_DECORATION = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}|\$|\\[,!;: ]|~|\\%|%|\s")
_LAST_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def integer_answer(text: str) -> int | None:
    """``text`` as an integer if it *is* one (``1,234``, ``-7``, ``12.0``, ``$12$``, ``12 \\text{ apples}``),
    else None: an expression such as ``41 + 35`` or ``12 \\times 3`` is not an answer."""
    bare = _DECORATION.sub("", text).rstrip(".")
    m = _INTEGER_LITERAL.fullmatch(bare)
    return int(m.group(1) + m.group(2).replace(",", "")) if m else None


def math_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 if the response's final answer equals the ground truth, else 0.0.

    The final answer is the last ``\\boxed{}`` when present. An **integer** ground truth (the
    synthetic task, GSM8K) needs an integer literal there (:func:`integer_answer`), compared
    exactly; without a box, the last number in the text. This is strict on purpose: math-verify
    evaluates what it parses, so ``\\boxed{41 + 35}`` "equals" 76, and GRPO on the synthetic task
    found that within 40 steps: it stopped computing and boxed the question's expression (held-out
    "accuracy" 0.32 -> 0.75 with responses 22 -> 9 tokens, docs/grpo-math-runs.md). Any other ground
    truth (fractions, LaTeX expressions: MATH-style answers) is compared by ``math-verify``, which
    parses boxed answers, fractions and expressions and compares them symbolically
    (``\\frac{1}{2}`` equals ``0.5``); without a box it uses its own extraction.
    """
    gt = normalise_ground_truth(ground_truth)
    boxed = last_boxed(solution_str)
    if _INTEGER.fullmatch(digits := gt.replace(",", "")):
        if boxed is not None:
            answer = integer_answer(boxed)
        else:
            numbers = _LAST_NUMBER.findall(solution_str)
            answer = integer_answer(numbers[-1]) if numbers else None
        return 1.0 if answer == int(digits) else 0.0
    from math_verify import parse, verify

    gold = parse(gt)
    if not gold:
        gold = parse(f"${gt}$")
    answer = parse(f"\\boxed{{{boxed}}}" if boxed is not None else solution_str)
    return 1.0 if gold and answer and verify(gold, answer) else 0.0


def format_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 if the response gives exactly one ``\\boxed{...}`` answer, else 0.0."""
    return 1.0 if len(_BOXED.findall(solution_str)) == 1 and last_boxed(solution_str) is not None else 0.0


_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block of ``text`` (```python ... ```), else the whole text."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else text


@cache
def _sandbox():
    from hybrid_rl.rewards.sandbox import Sandbox, SandboxLimits

    return Sandbox(SandboxLimits(cpu_seconds=2, wall_seconds=4.0, memory_mb=256), max_concurrency=4)


def code_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """Fraction of test cases the response's program passes, each run in the sandbox.

    ``ground_truth``: a list (or its JSON) of ``{"input": stdin, "output": expected stdout}``;
    outputs are compared after stripping surrounding whitespace.
    """
    tests = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if isinstance(tests, dict):
        tests = tests.get("tests", [])
    if not tests:
        raise ValueError("code_reward needs a non-empty list of {input, output} test cases")
    code = extract_code(solution_str)
    sb = _sandbox()
    passed = sum(sb.run(code, stdin=str(t.get("input", ""))).stdout.strip() == str(t["output"]).strip() for t in tests)
    return passed / len(tests)


BUILTIN: dict[str, RewardFn] = {"math": math_reward, "format": format_reward, "code": code_reward}


def load_custom(path: str, function: str) -> RewardFn:
    """Load ``function`` from the Python file ``path``; errors name the file and the function."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"reward function file {path!r} does not exist (reward.functions[].path)")
    spec = importlib.util.spec_from_file_location(f"hybrid_rl_user_reward_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import reward function file {path!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, function, None)
    if not callable(fn):
        names = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        raise AttributeError(f"{path!r} has no function {function!r}; it defines: {', '.join(names) or 'nothing callable'}")
    return fn


@cache
def resolve(name: str, path: str | None = None, function: str | None = None) -> RewardFn:
    """A reward function by built-in name, or ``custom`` with a file path and function name."""
    if name == "custom":
        if not path or not function:
            raise ValueError("reward function 'custom' needs path and function")
        return load_custom(path, function)
    if name not in BUILTIN:
        raise KeyError(f"unknown reward function {name!r}; known: {', '.join(sorted(BUILTIN))}, custom")
    return BUILTIN[name]
