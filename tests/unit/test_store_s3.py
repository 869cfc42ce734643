"""MEG Store on an S3-compatible server: moto in server mode on loopback, reached through
``pyarrow.fs.S3FileSystem`` over real HTTP (no mocks in the store's process)."""

from __future__ import annotations

import uuid

import pyarrow.fs as pafs
import pytest

from storage import MEGStore, StoreError, check_store
from tests._s3 import make_bucket, s3_kwargs

BUCKET = "flexmarl-test"
G = 4


def make_rows(mb: int, n_inputs: int = 2) -> list[dict]:
    return [
        {
            "input_id": f"q{mb}-{k}",
            "traj": g,
            "turn": 0,
            "mb": mb,
            "policy_version": 0,
            "prompt_ids": [1, 2, k],
            "response_ids": [g, g, g],
            "logprobs": [-0.1, -0.2, -0.3],
            "prompt_text": "p",
            "response_text": f"r{g}",
        }
        for k in range(n_inputs)
        for g in range(G)
    ]


@pytest.fixture(scope="module")
def s3(s3_server: str) -> dict:
    """S3FileSystem kwargs for the session's moto server, with this module's bucket."""
    make_bucket(s3_server, BUCKET)
    return s3_kwargs(s3_server)


@pytest.fixture
def uri() -> str:
    return f"s3://{BUCKET}/runs/{uuid.uuid4().hex[:8]}/store"


def test_s3_round_trip_status_and_compaction(s3: dict, uri: str) -> None:
    store = MEGStore(uri, **s3)
    paths = store.write_samples("7", 0, make_rows(0) + make_rows(1))
    assert all(p.startswith(f"{uri}/samples/agent=7/iteration=0/mb00000") for p in paths)
    assert store.agents() == ["7"] and store.iterations("7") == [0]
    t = store.read_samples("7", 0)
    assert t.num_rows == 4 * G and set(t.column("agent").to_pylist()) == {"7"}
    assert t.column("response_ids").to_pylist()[:G] == [[g] * 3 for g in range(G)]
    assert store.read_samples("7", 0, mb=1).num_rows == 2 * G

    ids = store.read_samples("7", 0, mb=1).column("sample_id").to_pylist()
    store.write_status(
        "7", 0, [{"sample_id": s, "policy_version": 0, "mb": 1, "reward": 1.0} for s in ids]
    )
    assert store.ready("7", 0, mb=1).num_rows == 2 * G
    assert store.ready("7", 0, mb=0).num_rows == 0
    store.write_inputs(0, [{"input_id": "q0-0", "text": "1+1", "answer": "2"}])
    assert store.read_inputs(0).column("answer").to_pylist() == ["2"]

    before = store.read_samples("7", 0).drop_columns(["created_at"])
    assert store.compact("7", 0) is not None
    assert len(store.dataset("samples").files) == 1 and store.dataset("status").files == []
    assert store.read_samples("7", 0).drop_columns(["created_at"]).equals(before)
    assert check_store(uri, **s3) == []


def test_s3_idempotent_retry(s3: dict, uri: str) -> None:
    store = MEGStore(uri, **s3)
    rows = make_rows(0)
    assert store.write_samples("solver", 2, rows) == store.write_samples("solver", 2, rows)
    assert len(store.dataset("samples").files) == 1
    store.write_samples("solver", 2, rows[:3])  # regrouped retry: readers dedupe
    assert store.dataset("samples").count_rows() == len(rows) + 3
    assert store.read_samples("solver", 2).num_rows == len(rows)
    assert store.audit("solver", 2, expected=len(rows))[0].kind == "duplicate"
    store.compact("solver", 2)
    assert store.audit("solver", 2, expected=len(rows)) == []


def test_s3_damaged_object_is_named(s3: dict, uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MEGStore(uri, **s3)
    (path,) = store.write_samples("solver", 0, make_rows(0))
    key = path.removeprefix("s3://")
    fs = pafs.S3FileSystem(**s3)
    with fs.open_input_stream(key) as f:
        data = f.read()
    with fs.open_output_stream(key) as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(StoreError) as e:
        store.read_samples("solver", 0)
    assert path in str(e.value)
    problems = check_store(uri, **s3)
    assert [(p.kind, p.path) for p in problems] == [("unreadable", path)]

    # Opened from the URI alone: endpoint in the query string, credentials in the env.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    plain = f"{uri}?endpoint_override={s3['endpoint_override']}&scheme=http&region=us-east-1"
    assert [p.kind for p in check_store(plain)] == ["unreadable"]
    with pytest.raises(StoreError, match="no MEG store"):
        MEGStore(f"s3://{BUCKET}/nothing-here", create=False, **s3)
