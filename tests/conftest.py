"""Session-wide fixtures for the tests that need the real stack, and the suite's tiers.

One Prefect API (a `prefect_test_harness` server, started on first use) and one Dask cluster of
two worker processes with resource tags serve every test that asks for them: the harness takes
10-13 s to start on 2 cores, so never one server per worker or per test.

Tiers (docs/testing.md) are folders: `tests/unit/` (no Prefect API, no Dask cluster),
`tests/stack/` (the real Prefect API and Dask cluster, shared by the session) and `tests/slow/`
(what only shows at scale: learning, long runs, the chaos bench, engine starts and compiles).
Each test is marked with its folder's tier, so `-m` still selects them; a test in `tests/unit/`
that asks for `prefect_api` or `dask_cluster` is an error at collection, naming the test, and so
is a test file outside the three folders. `make test` runs unit and stack; `make test-all` (CI)
adds slow.

Tests that need the public datasets read them from the folder named by `FLEXMARL_DATA`
(`$FLEXMARL_DATA/gsm8k/...`) and skip, naming the variable, when it is unset or lacks them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: the environment variable naming the public datasets' folder (the one the gsm8k workload reads)
DATA_ENV = "FLEXMARL_DATA"

# Built tokenizers/models are cached across test sessions (the Makefile sets the same folder).
os.environ.setdefault("FLEXMARL_CACHE", str(REPO / ".cache" / "flexmarl"))
# Never touch the user's ~/.prefect: the harness uses its own temporary database.
os.environ.setdefault("PREFECT_HOME", str(REPO / ".prefect" / "tests"))
Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect makes only the last level
# No telemetry from tests (the Makefile sets the same): the SDK's usage events, checked when
# prefect is first imported, and the API server's telemetry service, which otherwise tries the
# network at startup and logs `Failed to send telemetry` where there is none. Set before any
# import of prefect; the harness server and the Dask workers inherit them.
os.environ.setdefault("DO_NOT_TRACK", "1")
# `cluster.workers: auto` lays configs out as on a 2-core machine (configs/default.yaml: w0 and
# w1, as the golden run and the shared test cluster have them), whatever machine runs the tests;
# tests/unit/test_layout.py checks the layout for other core counts.
os.environ.setdefault("FLEXMARL_CORES", "2")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
#: The caller's own glibc trim setting, read before any Dask nanny could export its own.
CALLER_MALLOC_TRIM = os.environ.get("MALLOC_TRIM_THRESHOLD_")


#: fixtures that start the real stack: a test in tests/unit/ may use none of them
STACK_FIXTURES = frozenset({"prefect_api", "dask_cluster", "cluster_certs"})
#: the tier folders under tests/, lightest first
TIERS = ("unit", "stack", "slow")


def _tier(item: pytest.Item) -> str:
    rel = Path(str(item.path)).resolve().relative_to(REPO / "tests")
    if len(rel.parts) < 2 or rel.parts[0] not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: test files live in a tier folder, tests/{{{','.join(TIERS)}}}/ "
                                "(docs/testing.md says which)")
    return rel.parts[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = _tier(item)
        uses = STACK_FIXTURES & set(getattr(item, "fixturenames", ()))
        if tier == "unit" and uses:
            raise pytest.UsageError(f"{item.nodeid} uses {sorted(uses)}: it starts the real stack, so it "
                                    "belongs in tests/stack/ (or tests/slow/), not tests/unit/")
        item.add_marker(getattr(pytest.mark, tier))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Collecting imported torch, transformers and Prefect into the suite's own process: its
    full collections skip what they made from here on, as a flexmarl process's do
    (`flexmarl_core/runtime/startup.py`)."""
    from flexmarl_core.runtime.startup import freeze_imports

    freeze_imports()


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    # Under load on 2 cores the default 20-30 s startup timeout is too short (seen timing out).
    with prefect_test_harness(server_startup_timeout=120):
        url = PREFECT_API_URL.value()
        # Worker processes started after this read the API from their environment (lean mode).
        os.environ["PREFECT_API_URL"] = url
        try:
            yield url
        finally:
            os.environ.pop("PREFECT_API_URL", None)


TEST_WORKERS = [
    {"name": "w0", "resources": {"rollout": 1, "train": 1}},
    {"name": "w1", "resources": {"rollout": 1, "train": 1}},
]


#: Dask's own TLS settings, by role and file (`flexmarl cluster certs` names)
TLS_ENV = {"DASK_DISTRIBUTED__COMM__TLS__CA_FILE": "ca.pem",
           **{f"DASK_DISTRIBUTED__COMM__TLS__{role.upper()}__{part.upper()}": f"{role}{suffix}.pem"
              for role in ("scheduler", "worker", "client") for part, suffix in (("cert", ""), ("key", "-key"))}}


@pytest.fixture(scope="session")
def cluster_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and per-role certificates for the session's TLS clusters, set as Dask's own TLS
    settings in this process and (through the environment) every process the tests start: an
    in-process flow, `flexmarl train` and `dask scheduler`/`dask worker` find them as a user's
    machines would in their dask.yaml."""
    import dask

    from flexmarl_core.cluster.security import make_certs

    folder = tmp_path_factory.mktemp("certs")
    make_certs(folder)
    for var, name in TLS_ENV.items():
        os.environ[var] = str(folder / name)
    dask.config.refresh()
    return folder


@pytest.fixture(scope="session")
def dask_cluster(prefect_api: str, cluster_certs: Path) -> Iterator[str]:
    """tls:// address of a local cluster of two tagged worker processes, shared by the session;
    its workers report to the session's Prefect API cheaply once a run has set them up for it
    (tasks/lean.py), as a run's own cluster does."""
    from flexmarl_core.cluster import start_cluster
    from flexmarl_core.config import ClusterConfig

    security = {"ca_file": str(cluster_certs / "ca.pem"), "cert_file": str(cluster_certs / "worker.pem"),
                "key_file": str(cluster_certs / "worker-key.pem")}
    cluster, client = start_cluster(
        ClusterConfig.model_validate({"workers": TEST_WORKERS, "security": security}), dashboard=False)
    try:
        yield cluster.scheduler_address
    finally:
        client.close()
        cluster.close()


@pytest.fixture(scope="session")
def baseline_run(prefect_api: str, dask_cluster: str, tmp_path_factory: pytest.TempPathFactory):
    """The undisturbed tiny-team run the fault tests compare with (`tests._runs`), shared by
    the session: its config and flow run id."""
    from flexmarl_core.config import load_config
    from tests._runs import COMMON, TINY, flow

    overrides = [f"run_dir={tmp_path_factory.mktemp('baseline')}/run", f"cluster.address={dask_cluster}", *COMMON]
    state = flow(overrides)
    assert state.is_completed(), state.message
    return load_config(TINY, overrides), state.state_details.flow_run_id


@pytest.fixture(scope="session")
def baseline(baseline_run):
    return baseline_run[0]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """moto's S3 server on loopback, shared by the session: its endpoint (no buckets: each test
    module makes its own with `tests._s3.make_bucket`)."""
    from tests._s3 import require_moto, start_moto

    require_moto()

    server, endpoint = start_moto()
    try:
        yield endpoint
    finally:
        server.stop()


def dataset_folder(name: str, *files: str) -> Path:
    """`$FLEXMARL_DATA/<name>`, or skip the test saying what is missing and how to provide it."""
    root = os.environ.get(DATA_ENV)
    if not root:
        pytest.skip(f"{DATA_ENV} is not set: point it at the folder holding {name}/ to run this")
    folder = Path(root) / name
    missing = [f for f in files if not (folder / f).is_file()]
    if not folder.is_dir() or missing:
        pytest.skip(f"{DATA_ENV}={root}: no {name}/ folder with {list(files)} there")
    return folder


@pytest.fixture
def gsm8k_dir() -> Path:
    """The real GSM8K folder (train.jsonl, test.jsonl) under $FLEXMARL_DATA."""
    return dataset_folder("gsm8k", "train.jsonl", "test.jsonl")
