# Two commands do all the set-up: `make demo` (the main job) and `make test` (the test suite).
# Both create or reuse .venv with the right stack (scripts/setup_env.sh picks CPU or CUDA).
VENV ?= .venv
PY := $(VENV)/bin/python
RECIPE ?= grpo_math
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup demo test test-all test-slurm lint docs soak gpu-check gpu-wheels bench compare mutants rlhf-mitigations clean

setup:
	bash scripts/setup_env.sh $(VENV) dev

demo: setup
	$(PY) -m hybrid_rl.main +recipe=$(RECIPE) $(ARGS)

# Everything CPU CI runs: lint, the docs site (strict: a broken link or missing page fails), then
# all tests except gpu and slow (soak).
test: setup lint docs
	$(PY) -m pytest -m "not gpu and not slow" $(PYTEST_ARGS)

# The reference pages are generated from the code (a test fails when they are stale), then the
# site is built strictly into site/ (git-ignored).
docs: setup
	$(PY) scripts/gen_docs.py --check
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet -d site

test-all: setup
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

test-slurm: setup
	$(PY) -m pytest -m slurm $(PYTEST_ARGS)

# The soak test (~10 min): 110 GRPO steps / 220 switches and 1,000 sandboxed runs; prints its figures.
soak: setup
	$(PY) -m pytest -m slow -s $(PYTEST_ARGS)

# The GPU check (benchmarks/gpu_check.sh): runs with the machine's own python3 where there is no
# .venv (a bare node with torch + transformers only; `make gpu-wheels` here builds what it lacks).
gpu-check:
	bash benchmarks/gpu_check.sh

gpu-wheels:
	bash scripts/gpu_wheels.sh

lint: setup
	$(PY) -m ruff check hybrid_rl tests benchmarks

# All benchmarks (~20 min on 2 cores): JSON + PNG under benchmarks/results/, summary.json.
bench: setup
	$(PY) -m benchmarks.run_all

# Every RL algorithm recipe, same budget from the same SFT model, 2 seeds each, the recipes' 250 steps
# (~10 min per run that fills its batch with up to 3 generation rounds, ~5-12 min for the others on
# 2 cores, ~3.5 h for all eleven). Shorter: ARGS are not passed; run python -m benchmarks.compare_algorithms --steps 100 --recipes grpo_math,ppo_math.
compare: setup
	$(PY) -m benchmarks.compare_algorithms

# Mutation run (long: roughly 30-40 min on 2 cores, so not in `make test`): each named one-line
# break in benchmarks/mutants.py must make its tests fail; results/mutants.json and .png,
# docs/reference/mutants.md. Exits 1 when a mutant survives (a missing test). ARGS are not passed; for
# a few: python -m benchmarks.mutants --only NAME[,NAME] (--list prints the catalogue).
mutants: setup
	$(PY) -m benchmarks.mutants

# RLHF-PPO over-optimisation and its mitigations (~35 min): results/rlhf_mitigations.json and .png.
rlhf-mitigations: setup
	$(PY) -m benchmarks.rlhf_mitigations

clean:
	rm -rf outputs .pytest_cache .ruff_cache
