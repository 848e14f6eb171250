# Two commands for users: `make demo` and `make test`; `make lint` for contributors. All install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install system-deps demo lint test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[test,widgets,spark]"
	touch $@

install: $(VENV)/.installed

# The quickstart needs the package, the dashboard and a kernel to run the notebook: no Spark, MLflow
# or test tools.
$(VENV)/.installed-demo: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[widgets,notebook]"
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

bench: install
	PYTHONPATH=. $(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
