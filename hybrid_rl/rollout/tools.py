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
import re
from collections.abc import Callable
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
        r = await asyncio.to_thread(self.sandbox.run, code)
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


def safe_eval(expression: str) -> float | int:
    """Evaluate + - * / // % ** on numbers only (no names, calls or attributes); exponents <= 64."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    return ev(ast.parse(expression, mode="eval"))


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


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Tool calls in Qwen/Hermes format; malformed JSON becomes a call with ``error`` set."""
    calls = []
    for raw in _HERMES.findall(text):
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
        except (json.JSONDecodeError, ValueError) as e:
            calls.append(ToolCall("", {}, error=f"invalid tool call: {e}"))
    return calls


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes}


def get_parser(name: str) -> Callable[[str], list[ToolCall]]:
    if name not in PARSERS:
        raise KeyError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]
