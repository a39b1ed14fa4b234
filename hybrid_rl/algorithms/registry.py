"""The two registries: advantage estimators and policy losses.

Everything algorithm-specific is a pure tensor function registered here under a name that a
recipe selects (``algorithm.adv_estimator=grpo``, ``algorithm.policy_loss=gspo``); the trainer
never branches on algorithm names. Looking up an unknown name lists the known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class Registry(dict[str, Callable]):
    """A name -> function map whose lookup error lists the registered names."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self[name] = fn
            return fn

        return deco

    def __missing__(self, name: str) -> Callable:
        raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self))}")


ADV_ESTIMATORS = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
register_adv_est = ADV_ESTIMATORS.register
register_policy_loss = POLICY_LOSSES.register


def _load_builtin() -> None:
    # Importing the modules fills the registries.
    from hybrid_rl.algorithms import advantages, losses  # noqa: F401


_load_builtin()
