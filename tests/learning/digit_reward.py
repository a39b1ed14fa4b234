"""A reward a random-init model can move in a few steps: the share of response characters that
are digits. Near 0 for a random tiny model, continuous, so every group has variance."""


def score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str.replace(" ", "")
    return sum(c.isdigit() for c in text) / max(len(text), 1)
