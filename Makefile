# Every target bootstraps .venv itself, so a bare machine with Python 3.11+ and make is enough.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench chaos clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/agentd demo

lint: $(STAMP)
	$(BIN)/ruff check worker supervisor tests bench
	$(BIN)/ruff format --check worker supervisor tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck unit

bench: $(STAMP)
	$(BIN)/python -m bench --full

# The full fault campaign (about 30-50 minutes on 2 cores): every crash point, every I/O
# error, every torn byte, thousands of fuzz cases, then 500 kill -9 trials.
chaos: $(STAMP)
	$(BIN)/python -m tests.faults --full
	$(BIN)/python -m tests.chaos.kill9 --trials 500

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
