"""The two registries: advantage estimators and policy losses.

Everything algorithm-specific is a pure tensor function registered here under a name that a
recipe selects (``algorithm.adv_estimator=grpo``, ``algorithm.policy_loss=gspo``); the trainer
never branches on algorithm names. Looking up an unknown name lists the known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable)


# What an advantage estimator can declare it needs when it registers; config validation and the
# trainer read these instead of lists of names.
#   group:           rollout.n >= 2 (a group baseline; with n = 1 every advantage is 0)
#   critic:          critic.enable (values V(s_t))
#   greedy_baseline: the greedy answer's reward per prompt (the rollout then also generates it)
NEEDS = frozenset({"group", "critic", "greedy_baseline"})


class Registry(dict[str, Callable]):
    """A name -> function map whose lookup error lists the registered names."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.needs: dict[str, frozenset[str]] = {}
        self.params: dict[str, type | None] = {}

    def register(self, name: str, needs: tuple[str, ...] = (), params: type | None = None) -> Callable[[F], F]:
        """Register ``fn`` under ``name``; ``params`` is the dataclass of the parameters it reads
        (:mod:`hybrid_rl.algorithms.params`), bound from the ``algorithm`` config by :func:`bind_params`."""
        unknown = set(needs) - NEEDS
        if unknown:
            raise ValueError(f"{self.kind} {name!r}: unknown needs {sorted(unknown)}; known: {sorted(NEEDS)}")

        def deco(fn: F) -> F:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self[name] = fn
            self.needs[name] = frozenset(needs)
            self.params[name] = params
            return fn

        return deco

    def unregister(self, name: str) -> None:
        """Remove ``name`` with its declarations (a plugin unloaded, a test cleaning up)."""
        del self[name]
        self.needs.pop(name, None)
        self.params.pop(name, None)

    def __missing__(self, name: str) -> Callable:
        raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self))}")


def bind_params(registry: Registry, name: str, section: Any) -> Any:
    """The parameters ``registry[name]`` declared, read from ``section`` (the ``algorithm``
    config: a dataclass or OmegaConf node), or None when it declared none. Each field takes the
    section's attribute of the same name, a plain value or a whole sub-section."""
    cls = registry.params.get(name) if name in registry else registry[name]  # unknown: the error lists the names
    if cls is None:
        return None
    return cls(**{f.name: _plain(getattr(section, f.name)) for f in fields(cls)})


def _plain(value: Any) -> Any:
    """A sub-section as its dataclass (OmegaConf's structured node becomes the object it types)."""
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_object(value) if isinstance(value, DictConfig) else value


ADV_ESTIMATORS = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
register_adv_est = ADV_ESTIMATORS.register
register_policy_loss = POLICY_LOSSES.register


def _load_builtin() -> None:
    """Import every module of this package: their decorators fill the registries. A new
    estimator or loss is a new file here (or a function added to one), nothing else."""
    import importlib
    import pkgutil

    import hybrid_rl.algorithms as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.name != "registry":
            importlib.import_module(f"hybrid_rl.algorithms.{info.name}")


_load_builtin()
