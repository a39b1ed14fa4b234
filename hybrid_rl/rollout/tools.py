"""Tools the model can call during a rollout, their config file, and tool-call parsers.

A tool has a ``name``, an OpenAI-style JSON ``schema`` (what the chat template shows the model)
and ``async execute(arguments) -> ToolResult``. Tools are listed in a YAML file like verl's
tool config::

    tools:
      - class_name: hybrid_rl.rollout.tools.PythonTool
        config: {timeout_s: 5, memory_mb: 256}
      - class_name: hybrid_rl.rollout.tools.CalculatorTool

The default parser reads Qwen/Hermes calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import json
import operator
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml


@dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str = ""  # set when the call could not be parsed


@dataclass
class ToolResult:
    text: str
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Tool(Protocol):
    name: str
    schema: dict

    async def execute(self, arguments: dict) -> ToolResult: ...


class PythonTool:
    """Runs ``arguments["code"]`` in the bubblewrap sandbox; returns stdout (and stderr), truncated."""

    name = "python"

    def __init__(
        self,
        timeout_s: float = 5.0,
        memory_mb: int = 256,
        output_chars: int = 512,
        backend: str = "bwrap",
        max_concurrency: int = 8,
    ) -> None:
        from hybrid_rl.rewards.sandbox import Sandbox, SandboxLimits

        limits = SandboxLimits(
            cpu_seconds=max(1, int(timeout_s)), wall_seconds=timeout_s, memory_mb=memory_mb, output_bytes=output_chars
        )
        self.sandbox = Sandbox(limits, backend=backend, max_concurrency=max_concurrency)
        # Its own pool: asyncio.to_thread's default one has min(32, cores + 4) threads, which
        # capped a 2-core machine at 6 concurrent calls whatever max_concurrency said.
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="python-tool")
        self.output_chars = output_chars
        self.schema = {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Run a Python 3 program and return what it prints.",
                "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
            },
        }

    async def execute(self, arguments: dict) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResult("error: python needs a non-empty 'code' string")
        r = await asyncio.get_running_loop().run_in_executor(self.pool, self.sandbox.run, code)
        if r.timed_out:
            return ToolResult("error: timed out", metrics={"tool/python_timeout": 1.0})
        text = (
            r.stdout
            if r.returncode == 0
            else (r.stdout + r.stderr.strip().splitlines()[-1:][0] if r.stderr.strip() else r.stdout)
        )
        return ToolResult(text.strip()[: self.output_chars], metrics={"tool/python_ok": float(r.returncode == 0)})


_OPS: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_BITS = 4096  # integers beyond ~1,200 digits are refused before they are computed


def _check_size(op: ast.operator, left: Any, right: Any) -> None:
    """Refuse, *before* computing it, an integer result wider than MAX_RESULT_BITS: a big-integer
    power or product holds the GIL (``((9**64)**64)**64`` froze the whole process)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return
    if isinstance(op, ast.Pow) and right > 0 and abs(left) > 1 and left.bit_length() * right > MAX_RESULT_BITS:
        raise ValueError("result too large")
    if isinstance(op, ast.Mult) and left.bit_length() + right.bit_length() > MAX_RESULT_BITS:
        raise ValueError("result too large")


def safe_eval(expression: str) -> float | int:
    """Evaluate + - * / // % ** on numbers only (no names, calls or attributes); exponents <= 64,
    integer results <= MAX_RESULT_BITS bits, expressions <= MAX_EXPRESSION_CHARS characters."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            _check_size(node.op, left, right)
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        return ev(ast.parse(expression, mode="eval"))
    except (RecursionError, MemoryError) as e:
        raise ValueError("expression too deeply nested") from e


class CalculatorTool:
    """Evaluates an arithmetic expression safely (``arguments["expression"]``)."""

    name = "calculator"

    def __init__(self) -> None:
        self.schema = {
            "type": "function",
            "function": {
                "name": self.name,
                "description": "Evaluate an arithmetic expression with + - * / // % **.",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
            },
        }

    async def execute(self, arguments: dict) -> ToolResult:
        expr = arguments.get("expression")
        if not isinstance(expr, str):
            return ToolResult("error: calculator needs an 'expression' string")
        try:
            value = safe_eval(expr)
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, TypeError) as e:
            return ToolResult(f"error: {e}")
        except Exception as e:  # never let a model's expression take the rollout down
            return ToolResult(f"error: {type(e).__name__}")
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return ToolResult(str(value))


def load_tools(path: str | Path) -> list[Tool]:
    """Instantiate the tools listed in a YAML tool config; errors name the file and the entry."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"tool config {str(p)!r} does not exist (rollout.agent.tool_config)")
    spec = yaml.safe_load(p.read_text()) or {}
    tools: list[Tool] = []
    for i, entry in enumerate(spec.get("tools", [])):
        cls_path = entry.get("class_name") if isinstance(entry, dict) else None
        if not cls_path or "." not in cls_path:
            raise ValueError(f"{p}: tools[{i}] needs class_name: package.module.Class")
        module, _, cls_name = cls_path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{p}: tools[{i}]: cannot import {cls_path} ({e})") from e
        tools.append(cls(**(entry.get("config") or {})))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"{p}: duplicate tool names {names}")
    return tools


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 16384
MAX_JSON_DEPTH = 64


def _hermes_blocks(text: str) -> list[str]:
    """The stripped contents of ``<tool_call>...</tool_call>`` blocks, found with ``str.find``:
    linear in the text (the regex ``<tool_call>\\s*(.*?)\\s*</tool_call>`` backtracked: 7 s for an
    unclosed tag followed by 2,000 spaces, 82 s for 4,000, on the rollout's thread)."""
    blocks, pos = [], 0
    while (start := text.find(_OPEN, pos)) >= 0:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            break
        blocks.append(text[start + len(_OPEN) : end].strip())
        pos = end + len(_CLOSE)
    return blocks


def _json_depth(raw: str) -> int:
    """Deepest bracket nesting outside strings (linear; bounds json.loads' recursion)."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in raw:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_hermes(text: str) -> list[ToolCall]:
    """Tool calls in Qwen/Hermes format; malformed JSON becomes a call with ``error`` set. Never
    raises, linear in the text: calls longer than MAX_CALL_CHARS or nested deeper than
    MAX_JSON_DEPTH are errors (1,000 nested brackets raised RecursionError before)."""
    calls = []
    for raw in _hermes_blocks(text):
        if len(raw) > MAX_CALL_CHARS or _json_depth(raw) > MAX_JSON_DEPTH:
            calls.append(
                ToolCall(
                    "",
                    {},
                    error=f"invalid tool call: longer than {MAX_CALL_CHARS} characters or nested deeper than {MAX_JSON_DEPTH}",
                )
            )
            continue
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ValueError('expected {"name": ..., "arguments": {...}}')
            args = obj.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(args, dict):
                raise ValueError("arguments must be an object")
            calls.append(ToolCall(obj["name"], args))
        except (json.JSONDecodeError, ValueError, RecursionError) as e:
            calls.append(ToolCall("", {}, error=f"invalid tool call: {type(e).__name__}: {e}"[:300]))
    return calls


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes}


def get_parser(name: str) -> Callable[[str], list[ToolCall]]:
    if name not in PARSERS:
        raise KeyError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]
