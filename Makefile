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
# editable_mode=compat puts the repo on sys.path: Dask inserts each worker's scratch folder,
# which holds a `storage/` spill dir, in front of sys.path, and setuptools' default editable
# finder runs after that, so `import storage` would find the empty spill dir instead.

.PHONY: setup run test lint bench-quick clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip
	$(BIN)/pip install --quiet -e '.[dev]' --config-settings editable_mode=compat
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
