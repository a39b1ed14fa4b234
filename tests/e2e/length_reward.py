"""A deterministic reward for fault tests on a random-init model: longer answers score higher.

Unsaturated at the tests' lengths (a random-init model writes ~3 characters per token, so 24
tokens are ~70 characters): every group whose answers differ in length has a signal. A cap at 40
characters scored nearly every answer 1.0, so DAPO's group filter could drop a whole step."""


def score(data_source, solution_str, ground_truth, extra_info=None):
    return min(len(solution_str), 400) / 400.0
