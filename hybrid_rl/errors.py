"""The errors a run reports in one line and exits 2 for, at the bottom of the package.

Every layer raises these, so they live below all of them (an error defined in the trainer and
raised by the engine made the engine import the trainer). ``hybrid_rl.main`` catches
:class:`HybridRLError` and prints ``error (rank R): <message>``; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations


class HybridRLError(Exception):
    """An expected failure whose message names the field, file, row or rank at fault."""


class ConfigError(HybridRLError, ValueError):
    """A configuration that cannot run; the message names the field(s)."""


class ModelPathError(ConfigError):
    """model.path is missing, corrupt, or not a usable HF folder."""


class DataError(HybridRLError, ValueError):
    """A data file, column or row that cannot be used; the message names file, row and field."""


class StaleWeightsError(HybridRLError, RuntimeError):
    """A rollout produced by older weights than the trainer allows."""


class RewardFailure(HybridRLError, RuntimeError):
    """Reward functions failed on every sample for too many consecutive steps."""


class RankFailure(HybridRLError, RuntimeError):
    """A phase failed on some rank; raised on every rank so none is left waiting."""


class NumericalError(HybridRLError, RuntimeError):
    """Training cannot continue: repeated non-finite losses/gradients, or non-finite weights."""


class NoUpdateError(HybridRLError, RuntimeError):
    """Too many steps in a row without an optimizer step (``trainer.no_update_action=stop``)."""


class SandboxUnavailable(HybridRLError, RuntimeError):
    """No working isolation mechanism is installed."""


class AMXPermissionError(HybridRLError, RuntimeError):
    """The CPU has AMX but the kernel refused this process the AMX tile state."""
