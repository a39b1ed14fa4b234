"""The names registered in the project's registries, read without importing them.

The estimators, losses and ensemble reductions are registered by decorators in modules that
import torch (about 3 s on 2 cores), and the launcher has a budget of a few seconds to name every
problem of a config. So, where a registry has not been imported yet, its names are read from the
source: each ``@register_adv_est("name", needs=(...))``, ``@register_policy_loss("name")`` and
``@ENSEMBLE_REDUCERS.register("name")`` under ``hybrid_rl/algorithms`` and ``hybrid_rl/rewards``,
and the keys of ``BACKENDS`` in ``hybrid_rl/rollout/backends.py``. Once a registry is imported
(a test or a plugin registered more), the live one is used. ``tests/unit/test_preflight.py``
checks that both give the same names.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

PKG = Path(__file__).resolve().parents[1]
# decorator call -> registry kind
DECORATORS = {"register_adv_est": "adv_estimator", "register_policy_loss": "policy_loss", "ENSEMBLE_REDUCERS.register": "ensemble_reduce"}


@dataclass
class Registered:
    """Name -> declared needs, per registry kind (``adv_estimator``, ``policy_loss``, ``ensemble_reduce``, ``backend``)."""

    kinds: dict[str, dict[str, frozenset[str]]] = field(default_factory=dict)
    # name -> its declared params: the class (live registry) or its name in hybrid_rl.algorithms.params (scanned)
    params: dict[str, dict[str, type | str | None]] = field(default_factory=dict)

    def names(self, kind: str) -> list[str]:
        return sorted(self.kinds.get(kind, {}))

    def needs(self, kind: str, name: str) -> frozenset[str]:
        return self.kinds.get(kind, {}).get(name, frozenset())

    def param_fields(self, kind: str, name: str) -> frozenset[str]:
        """The ``algorithm`` keys ``name`` reads through its declared params (none if it declared none)."""
        from dataclasses import fields

        from hybrid_rl.algorithms import params  # dataclasses only: no torch

        cls = self.params.get(kind, {}).get(name)
        if isinstance(cls, str):
            cls = getattr(params, cls)
        return frozenset(f.name for f in fields(cls)) if cls else frozenset()


def _call_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_call_name(node.value)}.{node.attr}"
    return ""


def _params_name(call: ast.Call) -> str | None:
    return next((_call_name(kw.value) for kw in call.keywords if kw.arg == "params"), None)


def _literal_needs(call: ast.Call) -> frozenset[str]:
    for kw in call.keywords:
        if kw.arg == "needs":
            return frozenset(ast.literal_eval(kw.value))
    return frozenset(ast.literal_eval(call.args[1])) if len(call.args) > 1 else frozenset()


@cache
def scanned() -> Registered:
    """The registrations written in the package's source (see the module docstring)."""
    out = Registered({kind: {} for kind in (*DECORATORS.values(), "backend")}, {kind: {} for kind in DECORATORS.values()})
    for path in sorted([*(PKG / "algorithms").glob("*.py"), *(PKG / "rewards").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and _call_name(node.func) in DECORATORS and node.args:
                name = ast.literal_eval(node.args[0])
                out.kinds[DECORATORS[_call_name(node.func)]][name] = _literal_needs(node)
                out.params[DECORATORS[_call_name(node.func)]][name] = _params_name(node)
    for node in ast.walk(ast.parse((PKG / "rollout" / "backends.py").read_text())):
        if isinstance(node, ast.AnnAssign) and _call_name(node.target) == "BACKENDS" and isinstance(node.value, ast.Dict):
            out.kinds["backend"] = {ast.literal_eval(k): frozenset() for k in node.value.keys if k is not None}
    return out


def registered() -> Registered:
    """The live registries where they are imported already, else :func:`scanned`."""
    out = Registered({k: dict(v) for k, v in scanned().kinds.items()}, {k: dict(v) for k, v in scanned().params.items()})
    if "hybrid_rl.algorithms.registry" in sys.modules:
        from hybrid_rl.algorithms.registry import ADV_ESTIMATORS, POLICY_LOSSES

        out.kinds["adv_estimator"] = dict(ADV_ESTIMATORS.needs)
        out.kinds["policy_loss"] = {n: frozenset() for n in POLICY_LOSSES}
        for kind, reg in (("adv_estimator", ADV_ESTIMATORS), ("policy_loss", POLICY_LOSSES)):
            out.params[kind] = dict(reg.params)
    if "hybrid_rl.rewards.ensemble" in sys.modules:
        from hybrid_rl.rewards.ensemble import ENSEMBLE_REDUCERS

        out.kinds["ensemble_reduce"] = {n: frozenset() for n in ENSEMBLE_REDUCERS}
    if "hybrid_rl.rollout.backends" in sys.modules:
        from hybrid_rl.rollout.backends import BACKENDS

        out.kinds["backend"] = {n: frozenset() for n in BACKENDS}
    return out
