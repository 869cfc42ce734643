# flexmarl: `make run` trains the default team on the embedded default stack (local Dask
# cluster, local Prefect API, tiny models on CPU); `make test` runs the whole test suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/default.yaml
# One Prefect home per checkout, so runs, tests and a local server never share ~/.prefect.
export PREFECT_HOME ?= $(CURDIR)/.prefect
export FLEXMARL_CACHE ?= $(CURDIR)/.cache/flexmarl
STAMP := $(VENV)/.setup-stamp

.PHONY: setup run test lint bench-quick clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

run: setup
	$(BIN)/flexmarl train $(CONFIG)

test: setup
	$(BIN)/pytest -q

lint: setup
	$(BIN)/ruff check .

bench-quick: setup
	mkdir -p runs/bench
	$(BIN)/python bench/store.py --quick --json runs/bench/store.json

clean:
	rm -rf runs .prefect .cache
