"""A deterministic reward for fault tests on a random-init model: longer answers score higher."""


def score(data_source, solution_str, ground_truth, extra_info=None):
    return min(len(solution_str), 40) / 40.0
