"""A reward that returns extras and sometimes raises, for the reward-reporting end-to-end test.

The score is the answer's length (a spread on a random-init model, as in length_reward.py);
``chars`` is on every answer, ``rank1_only`` on rank 1's answers only (the scoring workers
inherit the rank's environment), so the ranks hold different extra keys. The first call in each
worker process raises, so every run has a failure whose traceback must reach the log."""

import os

_calls = [0]


def score(data_source, solution_str, ground_truth, extra_info=None):
    _calls[0] += 1
    if _calls[0] == 1:
        raise ValueError("first answer this worker scored")
    out = {"score": min(len(solution_str), 400) / 400.0, "chars": len(solution_str)}
    if os.environ.get("RANK") == "1":
        out["rank1_only"] = 1.0
    return out
