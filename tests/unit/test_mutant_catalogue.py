"""The mutation catalogue (benchmarks/mutants.py) still fits the code: every break applies exactly
once and compiles, and every test it names exists. A refactor that moves a mutated line otherwise
leaves `make mutants` broken until someone runs it (it is too long for the suite)."""

import pytest

from benchmarks.mutants import CATALOGUE, check

pytestmark = pytest.mark.unit


def test_every_mutant_applies_once_and_names_existing_tests():
    assert check(CATALOGUE) == []
