"""The default task: synthetic arithmetic word problems with verifiable integer answers.

Each problem is a short story ("Ann has 7 apples. She buys 5 more. ...") whose answer is an
integer. Difficulty levels scale the numbers and the number of steps:

====  ==============================================  ===========================
level what                                            example answer range
====  ==============================================  ===========================
1     one addition or subtraction, numbers <= 10      0..20
2     one addition or subtraction, numbers <= 50      0..100
3     one multiplication, factors 2..10               4..100
4     two steps (+/-, then x or +/-), numbers <= 20    0..~360
5     one multiplication of 3-digit by 2-digit        ~1000..~99000 (tool territory)
6     two 2-digit numbers added column by column      20..198
7     a running sum of 3..64 one-digit counts         3..576 (long-tailed lengths)
====  ==============================================  ===========================

Level 6 is the procedural one: its worked solution adds the ones digits, then the tens digits,
then the carry, each a single-digit step, before it states the sum ("7 + 8 = 15. 4 + 3 = 7.
7 + 1 = 8. 47 + 38 = 85."). A held-out level-6 problem is a sum never worked in training whose
every digit step is a trained fact: answering it takes the procedure, not recall.

Level 7 (:mod:`hybrid_rl.data.longtail`) adds its operands one line each, and their count is
heavy-tailed, so its answers' lengths are too: most are a few lines, a few are hundreds of tokens.

Rows follow verl's parquet schema: ``data_source``, ``prompt`` (chat messages), ``ability``,
``reward_model`` (``{"style": "rule", "ground_truth": "12"}``) and ``extra_info`` (split,
index, level, and a worked ``solution`` used by the SFT warm start).

Questions differ only in names, items and verbs, so a split by question text alone would put the
same arithmetic in training and validation. The split is by *fact* instead: each step of a worked
solution ("7 + 8 = 15", one fact with "8 + 7 = 15") is held out or not by a seeded hash
(``heldout_fraction`` of them), and

- ``train`` (SFT, RL, and the preference pairs built from it) has no held-out fact in any step;
- ``val`` (data source ``synth_math_heldout``) has a held-out fact in at least one step: a problem
  whose arithmetic the model never saw worked in training;
- ``val_seen`` (data source ``synth_math_seen``) has new questions over training facts only: the
  in-distribution figure, which a model can raise by recalling what it was trained on.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: longtail builds on this module
    from hybrid_rl.data.longtail import StepRule

DATA_SOURCE = "synth_math"
HELDOUT_SOURCE = "synth_math_heldout"
SEEN_SOURCE = "synth_math_seen"
# Bump when the generator changes what it writes: cached splits and warm starts are keyed by it.
GENERATOR_VERSION = 5
INSTRUCTION = "Put the final answer in \\boxed{}."

NAMES = ["Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gia", "Hugo", "Ivy", "Jon", "Kim", "Leo"]
ITEMS = ["apples", "books", "coins", "cards", "pens", "shells", "stamps", "marbles", "eggs"]


@dataclass(frozen=True)
class Problem:
    """One generated problem: question text, integer answer, worked solution, level."""

    question: str
    answer: int
    solution: str
    level: int


def _add_or_sub(rng: random.Random, hi: int) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, hi), rng.randint(1, hi)
    if rng.random() < 0.5:
        verb = rng.choice(["buys", "finds", "gets"])
        q = f"{name} has {a} {item}. {name} {verb} {b} more. How many {item} does {name} have now?"
        return Problem(q, a + b, f"{a} + {b} = {a + b}.", 0)
    a, b = max(a, b), min(a, b)
    verb = rng.choice(["gives away", "loses", "sells"])
    q = f"{name} has {a} {item}. {name} {verb} {b}. How many {item} does {name} have left?"
    return Problem(q, a - b, f"{a} - {b} = {a - b}.", 0)


def _multiply(rng: random.Random, hi_a: int, hi_b: int, lo_a: int = 2, lo_b: int = 2) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(lo_a, hi_a), rng.randint(lo_b, hi_b)
    q = f"{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have?"
    return Problem(q, a * b, f"{a} * {b} = {a * b}.", 0)


def _two_step(rng: random.Random) -> Problem:
    first = _add_or_sub(rng, 20)
    name = first.question.split(" ", 1)[0]
    item = first.question.split(" ")[3].rstrip(".")
    if rng.random() < 0.5:
        k = rng.randint(2, 5)
        q = first.question.rsplit(". ", 1)[0] + f". Then {name} gets {k} times as many. How many {item} does {name} have?"
        ans = first.answer * k
        sol = f"{first.solution} {first.answer} * {k} = {ans}."
    else:
        c = rng.randint(1, 20)
        q = first.question.rsplit(". ", 1)[0] + f". Then {name} finds {c} more. How many {item} does {name} have?"
        ans = first.answer + c
        sol = f"{first.solution} {first.answer} + {c} = {ans}."
    return Problem(q, ans, sol, 0)


LEVELS = (1, 2, 3, 4, 5, 6, 7)
PROCEDURAL_LEVELS = frozenset({6})
RUNNING_SUM_LEVEL = 7  # one line per operand, long-tailed lengths (hybrid_rl.data.longtail)


def _column_sum(rng: random.Random) -> Problem:
    """Two 2-digit numbers added digit by digit: ones, tens, the carry, then the sum itself."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    ones, tens = a % 10 + b % 10, a // 10 + b // 10
    steps = [f"{a % 10} + {b % 10} = {ones}", f"{a // 10} + {b // 10} = {tens}"]
    if ones >= 10:
        steps.append(f"{tens} + 1 = {tens + 1}")
    steps.append(f"{a} + {b} = {a + b}")
    q = f"{name} has {a} {item}. {other} has {b} {item}. How many {item} do {name} and {other} have together?"
    return Problem(q, a + b, ". ".join(steps) + ".", 0)


def make_problem(rng: random.Random, level: int, rule: StepRule | None = None) -> Problem | None:
    """One problem of the given difficulty level (1..7); ``rule`` says which facts a level-7 line
    may state (None: that level found no such problem this draw)."""
    if level == 1:
        p = _add_or_sub(rng, 10)
    elif level == 2:
        p = _add_or_sub(rng, 50)
    elif level == 3:
        p = _multiply(rng, 10, 10)
    elif level == 4:
        p = _two_step(rng)
    elif level == 5:
        p = _multiply(rng, 999, 99, lo_a=100, lo_b=11)
    elif level == 6:
        p = _column_sum(rng)
    elif level == RUNNING_SUM_LEVEL:
        from hybrid_rl.data.longtail import running_sum

        return running_sum(rng, rule)
    else:
        raise ValueError(f"synth_math level must be 1..7, got {level}")
    return Problem(p.question, p.answer, p.solution, level)


def facts(p: Problem) -> list[str]:
    """The arithmetic facts a problem's worked solution states, one per step: ``["7 + 8 = 15"]``."""
    return [step.strip() for step in p.solution.rstrip(".").split(". ")]


def fact_key(fact: str) -> str:
    """What a fact asks, whatever the order of a sum's or product's operands: "8 + 7 = 15" and
    "7 + 8 = 15" are one fact (a model that learned one order answers the other)."""
    a, op, b, _, c = fact.split(" ")
    if op in "+*":
        a, b = sorted((a, b), key=int)
    return f"{a} {op} {b} = {c}"


def is_held_out(fact: str, seed: int, fraction: float) -> bool:
    """Whether ``fact`` (in either order, :func:`fact_key`) belongs to the held-out share: a seeded
    hash, so the same fact is held out at every level, in every split and on every machine."""
    digest = hashlib.sha256(f"{seed}:{fact_key(fact)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def format_solution(p: Problem) -> str:
    """The assistant's worked answer that SFT imitates: the steps, then a boxed result."""
    return f"{p.solution} {boxed_answer(p)}"


def boxed_answer(p: Problem) -> str:
    """The answer alone, as a model that answers without working or tools writes it."""
    return f"The answer is \\boxed{{{p.answer}}}."


def tool_turns(p: Problem, direct: bool = False) -> list[list[str]]:
    """A worked tool-use trajectory: compute with the python tool, then answer with its output;
    ``direct``: answer at once without the tool (right, as SFT data is; for a level-5 product the
    model must then multiply 3 by 2 digits in its head, which the tiny model cannot)."""
    if direct:
        return [["assistant", boxed_answer(p)]]
    steps = [step.split(" = ")[0] for step in p.solution.rstrip(".").split(". ")]
    if p.level in PROCEDURAL_LEVELS:
        steps = steps[-1:]  # the digit steps are the working; the tool computes the sum at once
    expr = steps[0]
    for step in steps[1:]:  # "a - b" then "x * k" -> "(a - b) * k"; a running sum needs no nesting (Python refuses 200 levels)
        expr = f"{expr} {step.split(' ', 1)[1]}" if p.level == RUNNING_SUM_LEVEL else f"({expr}) {step.split(' ', 1)[1]}"
    code = f"print({expr})"
    call = '<tool_call>{"name": "python", "arguments": {"code": "' + code + '"}}</tool_call>'
    return [["assistant", call], ["tool", str(p.answer)], ["assistant", boxed_answer(p)]]


def to_row(p: Problem, split: str, index: int, direct: bool = False, source: str = DATA_SOURCE) -> dict:
    """A verl-schema row for one problem (``direct``: its ``tool_turns`` answer without the tool)."""
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": f"{p.question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(p.answer)},
        "extra_info": {
            "split": split,
            "index": index,
            "level": p.level,
            "solution": format_solution(p),
            "question": p.question,
            "facts": facts(p),
            "tool_turns": tool_turns(p, direct),
        },
    }


SPLIT_SOURCES = {"train": DATA_SOURCE, "val": HELDOUT_SOURCE, "val_seen": SEEN_SOURCE}


def generate_rows(
    n: int,
    split: str,
    seed: int,
    levels: list[int],
    exclude: set[str] | None = None,
    direct_share: float = 0.0,
    keep: Callable[[Problem], bool] | None = None,
    rule: StepRule | None = None,
) -> list[dict]:
    """``n`` unique problems drawn uniformly over ``levels``; questions in ``exclude`` skipped,
    and with ``keep`` only the problems it accepts (``rule``: which facts level-7 lines may state).

    The stream for a split is seeded by ``(seed, split)`` so train and validation are fixed and
    independent of each other's size. A share ``direct_share`` of the rows, drawn from a stream of
    its own (the problems do not change with it), get ``tool_turns`` that answer without the tool.
    """
    if not levels:
        raise ValueError("synth_math needs at least one level")
    rng = random.Random(f"{seed}:{split}")
    style = random.Random(f"{seed}:{split}:direct")
    seen: set[str] = set(exclude or ())
    rows: list[dict] = []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 200 * n + 1000:
            raise ValueError(
                f"synth_math could only make {len(rows)} unique {split} problems of {n} "
                f"for levels {levels}: ask for fewer, add levels or change heldout_fraction"
            )
        p = make_problem(rng, levels[len(rows) % len(levels)], rule)
        if p is None or p.question in seen or (keep is not None and not keep(p)):
            continue
        seen.add(p.question)
        source = SPLIT_SOURCES.get(split, DATA_SOURCE)
        rows.append(to_row(p, split, len(rows), direct=style.random() < direct_share, source=source))
    return rows


def make_splits(
    n_train: int,
    n_val: int,
    n_val_seen: int,
    seed: int,
    levels: list[int],
    direct_share: float = 0.0,
    heldout_fraction: float = 0.2,
) -> dict[str, list[dict]]:
    """The three splits (see the module docstring): ``train``, ``val`` (held-out facts) and
    ``val_seen`` (new questions whose every fact some training problem states)."""

    def held(p: Problem) -> bool:
        return any(is_held_out(f, seed, heldout_fraction) for f in facts(p))

    def held_for_val(p: Problem) -> bool:
        if p.level not in PROCEDURAL_LEVELS:
            return held(p)
        *working, result = facts(p)  # the sum is new; every digit step is a trained fact
        return is_held_out(result, seed, heldout_fraction) and not any(is_held_out(f, seed, heldout_fraction) for f in working)

    from hybrid_rl.data.longtail import StepRule

    def held_fact(f: str) -> bool:
        return is_held_out(f, seed, heldout_fraction)

    # Level 7 draws each line under the same condition (keep then only confirms it), see longtail.
    val_rule, train_rule = StepRule(marked=held_fact), StepRule(ok=lambda f: not held_fact(f))
    val = generate_rows(n_val, "val", seed, levels, direct_share=direct_share, keep=held_for_val, rule=val_rule)
    train = generate_rows(n_train, "train", seed, levels, direct_share=direct_share, keep=lambda p: not held(p), rule=train_rule)
    trained = {f for r in train for f in r["extra_info"]["facts"]}
    asked = {r["extra_info"]["question"] for r in train}
    val_seen = generate_rows(
        n_val_seen, "val_seen", seed, levels, exclude=asked, direct_share=direct_share,
        keep=lambda p: set(facts(p)) <= trained, rule=StepRule(ok=trained.__contains__),
    )  # fmt: skip
    return {"train": train, "val": val, "val_seen": val_seen}


def write_splits(
    out_dir: str | Path,
    n_train: int,
    n_val: int,
    seed: int,
    levels: list[int],
    direct_share: float = 0.0,
    heldout_fraction: float = 0.2,
    n_val_seen: int = 256,
) -> dict[str, Path]:
    """Write ``train.parquet``, ``val.parquet`` and ``val_seen.parquet`` under ``out_dir``; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in make_splits(n_train, n_val, n_val_seen, seed, levels, direct_share, heldout_fraction).items():
        path = out / f"{split}.parquet"
        # A name of this process's own: ranks that find an empty cache at once each write their
        # copy (the same rows) and the atomic rename makes the last one win.
        tmp = path.with_suffix(f".parquet.{os.getpid()}.tmp")
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        tmp.replace(path)
        paths[split] = path
    return paths


def corpus(seed: int = 0, n: int = 4000) -> Iterator[str]:
    """Text for training the tiny model's tokenizer: questions and worked answers."""
    rng = random.Random(f"{seed}:corpus")
    for i in range(n):
        p = make_problem(rng, 1 + i % 5)
        yield f"{p.question} {INSTRUCTION}"
        yield format_solution(p)


def main() -> None:
    """CLI: ``python -m hybrid_rl.data.synth_math --out DIR [--train N --val N --seed S]``."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--train", type=int, default=20000)
    ap.add_argument("--val", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--levels", default="1,2,3,4")
    args = ap.parse_args()
    paths = write_splits(args.out, args.train, args.val, args.seed, [int(x) for x in args.levels.split(",")])
    for split, path in paths.items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
