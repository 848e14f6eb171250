# Two commands for users: `make demo` and `make test`; `make lint` for contributors. All install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install system-deps demo lint test test-full test-install test-oldest bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel

# torch first, as its own install: the CPU build on this project's machines (a file on their disk), which
# the torch extra's range then finds in place. Not a pin of nbdist's: a user's torch of any supported
# version stays (README, "Add nbdist to your Jupyter"). TORCH= skips it.
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(if $(TORCH),$(BIN)/pip install --quiet "$(TORCH)")
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

# The quickstart needs the package, Keras' default backend (TensorFlow), torch for its 2 workers'
# collectives, the dashboard and a kernel to run the notebook: no Spark, MLflow or test tools.
$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(if $(TORCH),$(BIN)/pip install --quiet "$(TORCH)")
	$(BIN)/pip install --quiet -e ".[tensorflow,torch,widgets,notebook]"
	touch $@

# Java for Spark, Podman for containers, Chromium for the browser test.
system-deps:
	bash scripts/install_system_deps.sh

demo: $(VENV)/.installed-demo
	$(BIN)/python scripts/run_notebook.py notebooks/01_quickstart.ipynb

# The code's style (ruff) and its layering (import-linter contracts in pyproject.toml); fails on either.
lint: install
	$(BIN)/ruff check nbdist tests benchmarks scripts
	$(BIN)/lint-imports

test: lint system-deps
	$(BIN)/python -m pytest -q -rs --durations=30
	$(MAKE) test-install
	$(MAKE) test-oldest

# CI's suite plus the further cases it leaves out (marker full), the issue's 20 soak trials of each kind and
# 10,000 hostile frames against a live run.
test-full: lint system-deps
	NBDIST_SOAK_TRIALS=20 NBDIST_FUZZ_FRAMES=10000 NBDIST_BENCH_ROWS=P1,P8 $(BIN)/python -m pytest -q -rs --durations=30 --full
	$(MAKE) test-install
	$(MAKE) test-oldest

# The install tiers (CONTRIBUTING.md): fresh venvs with one extra each, from nbdist's wheel built once.
test-install: install
	bash scripts/install_tiers.sh $(BIN)/python

# The Keras contract, JAX's cases and the Spark tests that reach PySpark's API, again on pyproject's floors.
test-oldest: install system-deps
	bash scripts/oldest_tier.sh $(BIN)/python

bench: install
	PYTHONPATH=. $(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
