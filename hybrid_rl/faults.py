"""Fault injection for the reliability tests: ``HYBRID_RL_FAULT=point@step[@rank]`` SIGKILLs the
process when it reaches ``point`` (generate | update | save | switch) at ``step``.

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
