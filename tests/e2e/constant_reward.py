"""A reward that scores every answer 1.0: every group's answers score alike, so DAPO's dynamic
sampling keeps nothing and no step updates, while validation under this reward is all right."""


def score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
