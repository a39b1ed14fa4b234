"""Fault injection for the reliability tests: ``HYBRID_RL_FAULT=point@step[@rank]`` SIGKILLs the
process when it reaches ``point`` (generate | update | save | switch) at ``step``;
``skip_sync@step`` instead makes the weight sync after that step's update a no-op (the
stale-weight guard must then stop the next update).

Used to kill a real run at chosen places (mid-rollout, mid-update, mid-save) and check that the
resumed run continues exactly. Unset, it costs one dict lookup per phase.
"""

from __future__ import annotations

import os
import signal
import sys


def maybe_fail(point: str, step: int, rank: int = 0) -> None:
    spec = os.environ.get("HYBRID_RL_FAULT")
    if not spec:
        return
    parts = spec.split("@")
    if parts[0] != point or int(parts[1]) != step or (len(parts) > 2 and int(parts[2]) != rank):
        return
    print(f"[fault injection] SIGKILL at {point} step {step} rank {rank}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def fault_active(point: str, step: int) -> bool:
    """Whether ``HYBRID_RL_FAULT`` names ``point@step`` (for faults that skip work, not kill)."""
    parts = os.environ.get("HYBRID_RL_FAULT", "").split("@")
    return parts[0] == point and len(parts) > 1 and int(parts[1]) == step
