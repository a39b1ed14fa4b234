"""A reward that fails on rank 1 only (the scoring workers inherit the rank's environment)."""

import os


def score(data_source, solution_str, ground_truth, extra_info=None):
    if os.environ.get("RANK") == "1":
        raise ValueError("reward backend down on rank 1")
    return 0.5
