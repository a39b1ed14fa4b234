"""Level 7 of the synthetic task, the running sum: long-tailed answer lengths on purpose.

A question lists K one-digit counts ("Ann has 5 boxes with 3, 8, 2, 7 and 1 apples in them. How
many apples does Ann have?") and the worked solution adds them one by one, one line per operand
after the first ("3 + 8 = 11. 11 + 2 = 13. 13 + 7 = 20. 20 + 1 = 21."). The answer's length is
linear in K, and K is drawn from a heavy tail, ``K = 1 + floor(2 X)`` with ``X ~ Pareto(1.3)``,
truncated at :data:`MAX_OPERANDS` (redrawn above it, so no pile-up at the bound): most answers are
a few lines, one in a hundred is dozens, which is the shape of long reasoning generations that a
synchronous rollout waits on.

Every line is an arithmetic fact ("13 + 7 = 20") as in the other levels, so the split by fact
applies unchanged. Rejecting whole problems would empty the tail (a 60-line problem with no
held-out fact is rare), so the generator takes the split's rule per step instead: each operand is
redrawn until its line's fact is allowed (:class:`StepRule`), and the count K, drawn first, keeps
its distribution in ``train`` and ``val`` alike. A ``val`` problem has one held-out line at a
random position (others may be held out too); ``val_seen`` lines are facts that training states.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from hybrid_rl.data.synth_math import ITEMS, NAMES, RUNNING_SUM_LEVEL, Problem

# Operand counts: K = 1 + floor(SCALE * X), X ~ Pareto(ALPHA), so K >= 3 and P(K >= k) ~
# (2 / (k - 1)) ** 1.3: median 4, p99 ~40 (answers: median ~40 tokens, p99 ~500); at most
# MAX_OPERANDS, so that the longest worked answer (807 tokens with the builtin tokenizer, boxed
# line and end of turn included) fits a 1,024-token budget.
PARETO_ALPHA = 1.3
PARETO_SCALE = 2.0
MAX_OPERANDS = 64
# Redraws of one operand before a problem is given up (a step no allowed digit can take).
MAX_DRAWS = 50


def always(fact: str) -> bool:
    return True


@dataclass(frozen=True)
class StepRule:
    """Which facts the lines of a generated running sum may state: ``ok`` for every line, except,
    where ``marked`` is set, one line at a random position that must satisfy ``marked`` instead."""

    ok: Callable[[str], bool] = always
    marked: Callable[[str], bool] | None = None


def operand_count(rng: random.Random) -> int:
    """K, the number of operands: heavy-tailed, redrawn above :data:`MAX_OPERANDS` (1.1% of draws)."""
    while True:
        k = 1 + int(PARETO_SCALE * rng.paretovariate(PARETO_ALPHA))
        if k <= MAX_OPERANDS:
            return k


def running_sum(rng: random.Random, rule: StepRule | None = None) -> Problem | None:
    """One running-sum problem (level 7) whose lines follow ``rule``; None when some line found no
    allowed operand in :data:`MAX_DRAWS` draws (the caller draws another problem)."""
    rule = rule or StepRule()
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    k = operand_count(rng)
    mark = rng.randrange(k - 1) if rule.marked is not None else -1
    operands = [rng.randint(1, 9)]
    total, steps = operands[0], []
    for line in range(k - 1):
        allowed = rule.marked if line == mark and rule.marked is not None else rule.ok
        for _ in range(MAX_DRAWS):
            d = rng.randint(1, 9)
            fact = f"{total} + {d} = {total + d}"
            if allowed(fact):
                break
        else:
            return None
        operands.append(d)
        steps.append(fact)
        total += d
    counts = ", ".join(map(str, operands[:-1])) + f" and {operands[-1]}"
    q = f"{name} has {k} boxes with {counts} {item} in them. How many {item} does {name} have?"
    return Problem(q, total, ". ".join(steps) + ".", RUNNING_SUM_LEVEL)
