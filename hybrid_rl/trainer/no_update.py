"""Steps that trained nothing, said out loud.

A step can end without an optimizer step for two reasons, both by design of the algorithm and
neither an error: DAPO's dynamic sampling kept no group whose G answers scored differently (a
group baseline has nothing to learn from equal scores), or every update of the step had a
non-finite loss or gradient norm and was skipped (``actor/skipped_steps``). A run where this
happens at every step still writes checkpoints and an ``hf/`` export, so without a word a
quickstart on a fresh model "finishes" having learned nothing. Each such step is announced on the
console and in main.log (``trainer/no_update``, 1.0 on the step, and ``trainer/no_update_streak``);
after ``trainer.no_update_patience`` in a row the run warns with what to change, or with
``trainer.no_update_action=stop`` the trainer checkpoints and ends with exit 2.
"""

from __future__ import annotations

import logging

log = logging.getLogger("hybrid_rl")

ADVICE = (
    "a model that answers every prompt of a group alike (all right or all wrong) gives GRPO nothing to "
    "learn from: use a model that solves some of the prompts (an SFT warm start), easier data, a larger "
    "rollout.n or rollout.temperature, or turn algorithm.filter_groups off"
)


def no_update_reason(metrics: dict[str, float], skipped_before: int, skipped_after: int) -> str:
    """Why the step that produced ``metrics`` took no optimizer step ("" when it took one).

    ``skipped_before`` / ``skipped_after``: the actor's count of skipped (non-finite) optimizer
    steps before and after the step's update."""
    if metrics.get("dapo/skipped_updates"):
        drawn = int(metrics.get("dapo/prompts_drawn", 0))
        rounds = int(metrics.get("dapo/gen_rounds", 0))
        return (
            f"dynamic sampling kept no informative group (every one of the {drawn} groups drawn in {rounds} "
            f"generation round(s) scored its answers alike; mean score {metrics.get('critic/score/mean', 0.0):.3f})"
        )
    steps = int(metrics.get("actor/optimizer_steps", 0))
    if steps and skipped_after - skipped_before >= steps:
        return f"all {steps} optimizer step(s) had a non-finite loss or gradient norm and were skipped"
    return ""


class NoUpdateWatch:
    """Counts steps in a row without an optimizer step and says so (see the module docstring)."""

    def __init__(self, patience: int, action: str, is_main: bool) -> None:
        self.patience, self.action, self.is_main = patience, str(action), is_main
        self.streak = 0

    def observe(self, step: int, reason: str) -> dict[str, float]:
        """Record step ``step`` (1-based); ``reason`` is "" when it updated. Returns its metrics."""
        if not reason:
            self.streak = 0
            return {"trainer/no_update": 0.0, "trainer/no_update_streak": 0.0}
        self.streak += 1
        if self.is_main:
            log.warning("step %d: no update, the weights are unchanged: %s", step, reason)
            if self.patience and self.streak == self.patience and self.action == "warn":
                log.warning(
                    "%d steps in a row without an update (trainer.no_update_patience=%d): %s; "
                    "trainer.no_update_action=stop ends such a run", self.streak, self.patience, ADVICE
                )  # fmt: skip
        return {"trainer/no_update": 1.0, "trainer/no_update_streak": float(self.streak)}

    @property
    def must_stop(self) -> bool:
        return bool(self.patience) and self.action == "stop" and self.streak >= self.patience

    def message(self) -> str:
        return (
            f"{self.streak} steps in a row without an update (trainer.no_update_patience={self.patience}, "
            f"trainer.no_update_action=stop); the last checkpoint holds the unchanged weights. {ADVICE}"
        )
