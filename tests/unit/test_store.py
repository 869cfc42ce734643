"""MEG Store on local disk: schema, round trip, idempotency, status, micro-batches, compaction,
DuckDB. Fault handling is in test_store_faults.py, S3 in test_store_s3.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest

from storage import (
    SAMPLE_FILE_SCHEMA,
    SAMPLE_PARTITION_SCHEMA,
    SAMPLE_READ_SCHEMA,
    MEGStore,
    check_store,
    partitioning,
)

G = 4


def make_rows(mb: int, n_inputs: int = 2, version: int = 0, turn: int = 0) -> list[dict]:
    """Rollout rows of one micro-batch: n_inputs inputs x G trajectories."""
    rows = []
    for k in range(n_inputs):
        for g in range(G):
            n = 3 + g
            rows.append(
                {
                    "input_id": f"q{mb}-{k}",
                    "traj": g,
                    "turn": turn,
                    "mb": mb,
                    "policy_version": version,
                    "parents": [],
                    "prompt_ids": [1, 2, 3, k],
                    "response_ids": list(range(n)),
                    "logprobs": [-0.5] * n,
                    "prompt_text": f"question {mb}-{k}",
                    "response_text": f"answer {g}",
                    "extra": {"k": k},
                }
            )
    return rows


def sid(row: dict, agent: str) -> str:
    return f"{row['input_id']}:{row['traj']}:{agent}:{row['turn']}"


@pytest.fixture
def store(tmp_path: Path) -> MEGStore:
    return MEGStore(str(tmp_path / "store"))


def test_schema_groups_and_partition_types(store: MEGStore, tmp_path: Path) -> None:
    groups = {f.name: f.metadata[b"group"].decode() for f in SAMPLE_FILE_SCHEMA}
    assert groups["sample_id"] == "meta" and groups["response_ids"] == "data"
    assert groups["consumed_step"] == "status"
    assert SAMPLE_PARTITION_SCHEMA.field("agent").type == pa.string()

    store.write_samples("7", 0, make_rows(0))
    t = store.read_samples("7", 0)
    assert t.schema.equals(SAMPLE_READ_SCHEMA)
    assert t.column("agent").type == pa.string() and set(t.column("agent").to_pylist()) == {"7"}
    assert t.column("iteration").type == pa.int64()
    # The raw dataset view types the partition explicitly too.
    raw = store.dataset("samples").to_table()
    assert raw.schema.field("agent").type == pa.string()
    assert raw.column("agent").to_pylist()[0] == "7"
    direct = ds.dataset(
        str(tmp_path / "store" / "samples"), format="parquet", partitioning=partitioning("samples")
    ).to_table()
    assert direct.column("agent").to_pylist()[0] == "7"
    assert store.agents() == ["7"] and store.iterations("7") == [0]


def test_round_trip(store: MEGStore) -> None:
    rows = make_rows(0) + make_rows(1)
    paths = store.write_samples("solver", 3, rows)
    assert len(paths) == 2 and all("mb00000" in p for p in paths)  # one fragment per mb
    t = store.read_samples("solver", 3)
    assert t.num_rows == len(rows)
    got = {r["sample_id"]: r for r in t.to_pylist()}
    for row in rows:
        r = got[sid(row, "solver")]
        assert r["response_ids"] == row["response_ids"]
        assert r["logprobs"] == row["logprobs"]
        assert r["prompt_text"] == row["prompt_text"]
        assert r["extra"] == '{"k": ' + str(row["extra"]["k"]) + "}"
        assert r["reward"] is None and r["consumed_step"] is None
        assert r["iteration"] == 3 and r["agent"] == "solver"
    # Sorted by (mb, input_id, traj, turn): GRPO groups are contiguous.
    keys = [(r["mb"], r["input_id"], r["traj"]) for r in t.to_pylist()]
    assert keys == sorted(keys)
    # Column projection keeps the requested order.
    assert store.read_samples("solver", 3, columns=["reward", "sample_id"]).column_names == [
        "reward",
        "sample_id",
    ]
    # A table written as Arrow works the same way as dicts.
    store.write_samples(
        "critic",
        3,
        pa.Table.from_pylist([{k: v for k, v in r.items() if k != "extra"} for r in make_rows(0)]),
    )
    assert store.read_samples("critic", 3).num_rows == 2 * G


def test_idempotent_retry(store: MEGStore) -> None:
    rows = make_rows(0)
    p1 = store.write_samples("solver", 0, rows)
    p2 = store.write_samples("solver", 0, rows)  # a retried task
    assert p1 == p2
    assert len(store.dataset("samples").files) == 1
    # A retry that regroups the rows lands in another fragment; readers still dedupe.
    store.write_samples("solver", 0, rows[:3])
    assert store.dataset("samples").count_rows() == len(rows) + 3
    t = store.read_samples("solver", 0)
    assert t.num_rows == len(rows)
    assert pc.count_distinct(t.column("sample_id")).as_py() == len(rows)
    assert any(p.kind == "duplicate" for p in store.audit("solver", 0))
    # Same sample_id under a new policy version is a different sample.
    store.write_samples("solver", 0, make_rows(0, version=1))
    assert store.read_samples("solver", 0).num_rows == 2 * len(rows)
    inputs = [{"input_id": "q0-0", "text": "1+1", "answer": "2", "meta": {"src": "t"}}]
    assert store.write_inputs(0, inputs) == store.write_inputs(0, inputs)
    got = store.read_inputs(0)
    assert got.num_rows == 1 and got.column("meta")[0].as_py() == '{"src": "t"}'


def test_status_ready_and_micro_batch(store: MEGStore) -> None:
    for mb in range(3):
        store.write_samples("solver", 0, make_rows(mb))
    assert store.ready("solver", 0).num_rows == 0  # no rewards yet
    mb1 = store.read_samples("solver", 0, mb=1)
    assert mb1.num_rows == 2 * G and set(mb1.column("mb").to_pylist()) == {1}

    ids = mb1.column("sample_id").to_pylist()
    status = [
        {"sample_id": s, "policy_version": 0, "mb": 1, "reward": float(i)}
        for i, s in enumerate(ids)
    ]
    store.write_status("solver", 0, status[:5])
    store.write_status("solver", 0, status[:5])  # retried reward task: same fragment
    assert len(store.dataset("status").files) == 1
    ready = store.ready("solver", 0, mb=1)
    assert sorted(ready.column("sample_id").to_pylist()) == sorted(ids[:5])
    assert store.ready("solver", 0, mb=2).num_rows == 0
    assert store.ready("solver", 0).num_rows == 5  # whole iteration

    # Latest non-null value per field wins; an advantage write keeps the reward.
    store.write_status(
        "solver", 0, [{"sample_id": ids[0], "policy_version": 0, "mb": 1, "reward": 9.0}]
    )
    store.write_status(
        "solver", 0, [{"sample_id": ids[0], "policy_version": 0, "mb": 1, "advantage": 0.5}]
    )
    row = [
        r for r in store.read_samples("solver", 0, mb=1).to_pylist() if r["sample_id"] == ids[0]
    ][0]
    assert row["reward"] == 9.0 and row["advantage"] == 0.5
    assert store.ready("solver", 0, need=("reward", "advantage")).num_rows == 1

    # Status rows without mb are found by micro-batch reads too.
    store.write_status("solver", 0, [{"sample_id": ids[7], "policy_version": 0, "reward": 1.0}])
    assert store.ready("solver", 0, mb=1).num_rows == 6

    store.mark_consumed("solver", 0, store.ready("solver", 0, mb=1), step=4)
    assert store.ready("solver", 0, mb=1).num_rows == 0
    consumed = store.ready("solver", 0, mb=1, unconsumed=False)
    assert consumed.num_rows == 6 and set(consumed.column("consumed_step").to_pylist()) == {4}
    assert store.ready("solver", 0, mb=1, unconsumed=False, columns=["sample_id"]).column_names == [
        "sample_id"
    ]
    # On-policy filter.
    assert store.ready("solver", 0, unconsumed=False, policy_version=1).num_rows == 0
    with pytest.raises(ValueError, match="unknown ready field"):
        store.ready("solver", 0, need=("score",))


def test_compaction_preserves_rows(store: MEGStore) -> None:
    for mb in range(4):
        store.write_samples("solver", 1, make_rows(mb))
    store.write_samples("solver", 1, make_rows(2)[:3])  # a raw duplicate
    ids = store.read_samples("solver", 1).column("sample_id").to_pylist()
    store.write_status(
        "solver",
        1,
        [
            {"sample_id": s, "policy_version": 0, "mb": int(s.split("-")[0][1:]), "reward": 1.0}
            for s in ids[::2]
        ],
    )
    store.mark_consumed("solver", 1, store.read_samples("solver", 1, mb=0), step=1)
    store.write_status(
        "solver",
        1,
        [{"sample_id": "ghost:0:solver:0", "policy_version": 0, "mb": 0, "reward": 3.0}],
    )
    before = store.read_samples("solver", 1)

    path = store.compact("solver", 1)
    assert path is not None and "/all-" in path
    assert [Path(f).name for f in store.dataset("samples").files] == [Path(path).name]
    # Only the orphan status row survives, in its own fragment.
    assert store.dataset("status").count_rows() == 1
    after = store.read_samples("solver", 1)
    assert after.drop_columns(["created_at"]).equals(before.drop_columns(["created_at"]))
    mb2 = store.read_samples("solver", 1, mb=2).drop_columns(["created_at"])
    assert mb2.num_rows == 2 * G
    assert mb2.equals(
        before.filter(pc.equal(before.column("mb"), 2))
        .drop_columns(["created_at"])
        .combine_chunks()
    )
    assert store.compact("solver", 1) is None  # already compact
    assert store.audit("solver", 1, expected=ids) == [
        p for p in store.audit("solver", 1) if p.kind == "orphan_status"
    ]

    # A late retry of a rollout write (status columns null) must not hide folded rewards.
    store.write_samples("solver", 1, make_rows(0))
    late = store.read_samples("solver", 1, mb=0)
    assert late.column("consumed_step").to_pylist() == [1] * (2 * G)
    assert (
        late.column("reward").to_pylist()
        == before.filter(pc.equal(before.column("mb"), 0)).column("reward").to_pylist()
    )


def test_readers_during_compaction_never_lose_or_double_count(store: MEGStore) -> None:
    n_mb = 12
    for mb in range(n_mb):
        store.write_samples("solver", 0, make_rows(mb))
        store.write_status(
            "solver",
            0,
            [
                {"sample_id": sid(r, "solver"), "policy_version": 0, "mb": mb, "reward": 1.0}
                for r in make_rows(mb)
            ],
        )
    expected = n_mb * 2 * G
    full: list[tuple[int, int]] = []  # (rows, rows without reward) per whole-partition read
    one_mb: list[int] = []  # rows ready in micro-batch 5, per read
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            t = store.read_samples("solver", 0)
            full.append((t.num_rows, t.column("reward").null_count))
            one_mb.append(store.ready("solver", 0, mb=5).num_rows)

    th = threading.Thread(target=reader)
    th.start()
    try:
        for i in range(3):
            store.compact("solver", 0)
            store.write_samples("solver", 0, make_rows(i))  # a late retry lands meanwhile
    finally:
        stop.set()
        th.join()
    assert full and set(full) == {(expected, 0)}
    assert set(one_mb) == {2 * G}


def test_validation_errors(store: MEGStore) -> None:
    for bad in ["a/b", "a=b", "", "_hidden", ".x", "x" * 200, 7]:
        with pytest.raises(ValueError, match="invalid agent name"):
            store.write_samples(bad, 0, make_rows(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="invalid agent name 'a/b'"):
        store.read_samples("a/b")
    with pytest.raises(ValueError, match="invalid iteration"):
        store.write_samples("a", -1, make_rows(0))
    with pytest.raises(ValueError, match=r"unknown samples column\(s\) \['score'\]"):
        store.write_samples("a", 0, [{**make_rows(0)[0], "score": 1}])
    with pytest.raises(ValueError, match="does not match"):
        store.write_samples("a", 0, [{**make_rows(0)[0], "sample_id": "wrong"}])
    with pytest.raises(ValueError, match="required"):
        store.write_samples("a", 0, [{k: v for k, v in make_rows(0)[0].items() if k != "mb"}])
    with pytest.raises(ValueError, match="logprobs"):
        store.write_samples("a", 0, [{**make_rows(0)[0], "logprobs": [0.0]}])
    with pytest.raises(ValueError, match="agent"):
        store.write_samples("a", 0, [{**make_rows(0)[0], "agent": "b"}])
    with pytest.raises(ValueError, match="more than once in one write; check traj/turn"):
        store.write_samples("a", 0, [{**r, "traj": 0} for r in make_rows(0)])
    with pytest.raises(ValueError, match="none of the status fields"):
        store.write_status("a", 0, [{"sample_id": "x", "policy_version": 0}])
    with pytest.raises(ValueError, match="unknown column"):
        store.read_samples("a", 0, columns=["nope"])
    assert store.agents() == [] and store.dataset("samples").files == []  # nothing written


def test_duckdb_reads_the_store(store: MEGStore) -> None:
    duckdb = pytest.importorskip("duckdb")
    store.write_samples("7", 0, make_rows(0) + make_rows(1))
    store.write_samples("planner", 0, make_rows(0))
    store.write_samples("planner", 1, make_rows(0))
    glob = f"{store.root}/samples/**/*.parquet"
    rows = duckdb.sql(
        f"SELECT agent, count(*) AS n FROM read_parquet('{glob}', hive_partitioning=true, "
        "hive_types={'agent': VARCHAR, 'iteration': BIGINT}) GROUP BY agent ORDER BY agent"
    ).fetchall()
    assert rows == [("7", 4 * G), ("planner", 4 * G)]
    per_it = duckdb.sql(
        f"SELECT iteration, count(*) FROM read_parquet('{glob}', hive_partitioning=true, "
        "hive_types={'agent': VARCHAR, 'iteration': BIGINT}) WHERE agent = 'planner' "
        "GROUP BY iteration ORDER BY iteration"
    ).fetchall()
    assert per_it == [(0, 2 * G), (1, 2 * G)]
    # Token lists come through as lists.
    toks = duckdb.sql(f"SELECT response_ids FROM read_parquet('{glob}') LIMIT 1").fetchall()[0]
    assert isinstance(toks[0], list)
    assert check_store(store.root) == []


def test_streamed_fsynced_and_pickled_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    import storage.commit

    # Big fragments stream into the staging file instead of going through memory.
    monkeypatch.setattr(storage.commit, "_STREAM_BYTES", 0)
    store = MEGStore(f"file://{tmp_path}/s", fsync=True)
    store.write_samples("a", 0, make_rows(0) + make_rows(1))
    clone = pickle.loads(pickle.dumps(store))  # stores travel to Dask workers
    assert clone.read_samples("a", 0).num_rows == 4 * G
    assert list((tmp_path / "s" / "_staging").iterdir()) == []


def test_storage_imports_nothing_heavy() -> None:
    import subprocess
    import sys

    code = (
        "import sys, storage; heavy = {'torch', 'prefect', 'dask', 'flexmarl_core', 'duckdb'}; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        check=True,
    )
    assert out.stdout.strip() == "[]"
