# Two commands do all the set-up: `make demo` (the main job) and `make test` (the test suite).
# Both create or reuse .venv with the right stack (scripts/setup_env.sh picks CPU or CUDA).
VENV ?= .venv
PY := $(VENV)/bin/python
RECIPE ?= grpo_math
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup demo test test-all test-slurm lint soak bench clean

setup:
	bash scripts/setup_env.sh $(VENV) dev

demo: setup
	$(PY) -m hybrid_rl.main +recipe=$(RECIPE) $(ARGS)

# Everything CPU CI runs: lint, then all tests except gpu and slow (soak).
test: setup lint
	$(PY) -m pytest -m "not gpu and not slow" $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

soak: setup
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check hybrid_rl tests benchmarks

bench: setup
	$(PY) -m benchmarks.run_all

clean:
	rm -rf outputs .pytest_cache .ruff_cache
