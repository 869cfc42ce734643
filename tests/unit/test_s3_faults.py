"""Object-store faults between flexmarl and a real S3 server: `tests._fault_proxy` in front of
moto answers requests with 503s, drops connections before or after forwarding them and delays
them, per a seeded schedule. The store's and the run location's reads and writes retry
(`storage.retry`), lose and duplicate nothing, and publish nothing half-written; a failure that
outlasts the retries is one line naming the key and the operation."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from flexmarl_core.runfiles.location import RunLocation
from storage import MEGStore, StoreError, check_store, retry
from tests._fault_proxy import FAULTS, FaultProxy
from tests._s3 import make_bucket, s3_kwargs
from tests.unit.test_store_s3 import G, make_rows

BUCKET = "flexmarl-faults"
ATTEMPTS = 8
MBS = 3


@pytest.fixture(scope="module")
def proxy(s3_server: str) -> Iterator[FaultProxy]:
    make_bucket(s3_server, BUCKET)
    p = FaultProxy(s3_server, seed=0, delay_s=0.05).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(autouse=True)
def quick_retries() -> Iterator[None]:
    """Short backoff (the schedule, not the clock, is under test), restored afterwards."""
    before = retry.policy()
    retry.configure(retry.RetryPolicy(attempts=ATTEMPTS, base_delay_s=0.005, max_delay_s=0.05))
    try:
        yield
    finally:
        retry.configure(before)


def _uri() -> str:
    return f"s3://{BUCKET}/runs/{uuid.uuid4().hex[:8]}"


def test_store_and_run_location_survive_seeded_faults(proxy: FaultProxy, monkeypatch) -> None:
    proxy.set_rates({"503": 0.06, "drop": 0.06, "lost_reply": 0.06, "delay": 0.06})
    before = dict(proxy.injected)
    run = _uri()
    store = MEGStore(f"{run}/store", **s3_kwargs(proxy.url))
    for mb in range(MBS):
        store.write_samples("solver", 0, make_rows(mb))
    for mb in range(MBS):
        ids = store.read_samples("solver", 0, mb=mb).column("sample_id").to_pylist()
        store.write_status("solver", 0, [{"sample_id": s, "policy_version": 0, "mb": mb, "reward": 0.5}
                                         for s in ids])
    expected = sorted(r["sample_id"] for mb in range(4)
                      for r in store.read_samples("solver", 0, mb=mb).to_pylist())
    assert len(expected) == MBS * 2 * G
    assert store.audit("solver", 0, expected=expected) == []
    assert all(store.ready("solver", 0, mb=mb).num_rows == 2 * G for mb in range(MBS))
    store.compact("solver", 0)
    assert store.audit("solver", 0, expected=expected) == []
    assert check_store(f"{run}/store", **s3_kwargs(proxy.url)) == []

    # The run location (weights, configs, op logs) goes through the same retries.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    host = proxy.url.removeprefix("http://")
    loc = RunLocation(f"{run}?endpoint_override={host}&scheme=http&region=us-east-1")
    blobs = {f"weights/solver/v{k}.safetensors": bytes([k]) * (1000 + k) for k in range(6)}
    for key, data in blobs.items():
        loc.write_bytes(key, data)
    assert loc.versions("weights/solver") == list(range(6))
    assert all(loc.read_bytes(key) == data for key, data in blobs.items())
    got = {k: proxy.injected[k] - before.get(k, 0) for k in FAULTS}
    assert all(n > 0 for n in got.values()), got  # every kind of fault was met and survived


def test_a_failure_past_the_retries_is_one_line_and_publishes_nothing(proxy: FaultProxy) -> None:
    proxy.set_rates({})
    store = MEGStore(f"{_uri()}/store", **s3_kwargs(proxy.url))
    retry.configure(retry.RetryPolicy(attempts=3, base_delay_s=0.005, max_delay_s=0.05))
    proxy.set_rates({"503": 1.0})
    try:
        with pytest.raises(StoreError) as info:
            store.write_samples("solver", 0, make_rows(0))
    finally:
        proxy.set_rates({})
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert "PUT failed 3 times (store.retries.attempts)" in msg, msg
    assert "/samples/agent=solver/iteration=0/mb000000-" in msg, msg
    assert store.read_samples("solver", 0).num_rows == 0  # nothing half-written to read
    assert store.dataset("samples").files == []


def test_permanent_errors_are_not_retried(proxy: FaultProxy) -> None:
    proxy.set_rates({})
    store = MEGStore(f"{_uri()}/store", **s3_kwargs(proxy.url))
    n = proxy.requests
    loc_fs = store.fs
    with pytest.raises(FileNotFoundError):
        loc_fs.open_input_file(f"{BUCKET}/no/such/key")
    assert proxy.requests - n <= 3  # one GET (pyarrow may HEAD first), never ATTEMPTS of them
