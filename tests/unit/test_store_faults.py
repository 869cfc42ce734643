"""MEG Store under bad input and faults: damaged and foreign files, check_store and its CLI,
concurrent writer processes, a writer killed mid-write. Real files and real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage import MEGStore, StoreError, check_store
from storage.check import main as check_main

REPO = Path(__file__).resolve().parents[2]
G = 4


def make_rows(mb: int, n_inputs: int = 2, tag: str = "q") -> list[dict]:
    return [
        {
            "input_id": f"{tag}{mb}-{k}",
            "traj": g,
            "turn": 0,
            "mb": mb,
            "policy_version": 0,
            "prompt_ids": [1, 2, k],
            "response_ids": [g, g],
            "logprobs": [-0.1, -0.2],
            "prompt_text": "p",
            "response_text": "r",
        }
        for k in range(n_inputs)
        for g in range(G)
    ]


def run_python(code: str, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env, **kw)


@pytest.fixture
def store(tmp_path: Path) -> MEGStore:
    return MEGStore(str(tmp_path / "store"))


def test_truncated_fragment_is_named(store: MEGStore, capsys: pytest.CaptureFixture) -> None:
    store.write_samples("solver", 0, make_rows(0))
    (path,) = store.write_samples("solver", 0, make_rows(1))
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])

    with pytest.raises(StoreError) as e:
        store.read_samples("solver", 0)
    assert path in str(e.value) and e.value.path == path
    with pytest.raises(StoreError, match="mb000001"):
        store.read_samples("solver", 0, mb=1)
    assert store.read_samples("solver", 0, mb=0).num_rows == 2 * G  # other mbs still readable

    problems = check_store(store.root)
    assert [(p.kind, p.path, p.severity) for p in problems] == [("unreadable", path, "error")]
    assert check_main([store.root]) == 1
    out = capsys.readouterr().out
    assert path in out and "1 error(s)" in out


def test_foreign_files_are_named(store: MEGStore) -> None:
    store.write_samples("solver", 0, make_rows(0))
    part = Path(store.root) / "samples" / "agent=solver" / "iteration=0"
    foreign = part / "data.parquet"  # e.g. dropped in by another tool
    pq.write_table(pa.table({"x": [1, 2]}), foreign)
    with pytest.raises(StoreError, match="does not match the store schema") as e:
        store.read_samples("solver", 0, mb=0)  # untagged names are read for every mb
    assert str(foreign) in str(e.value) and "missing required column 'sample_id'" in str(e.value)
    foreign.unlink()

    not_parquet = part / "mb000000-0123abcd.parquet"
    not_parquet.write_text("hello, not parquet")
    with pytest.raises(StoreError, match=str(not_parquet)):
        store.read_samples("solver", 0)
    # Same columns, wrong type.
    not_parquet.unlink()
    bad = pa.Table.from_pylist(make_rows(0)).cast(
        pa.schema(
            [
                (n, pa.string() if n == "traj" else t)
                for n, t in zip(
                    pa.Table.from_pylist(make_rows(0)).schema.names,
                    pa.Table.from_pylist(make_rows(0)).schema.types,
                    strict=True,
                )
            ]
        )
    )
    typed = part / "mb000000-00ff.parquet"
    pq.write_table(bad, typed)
    with pytest.raises(StoreError, match="column 'traj' is string, expected int32"):
        store.read_samples("solver", 0)
    typed.unlink()

    # check_store: wrong layout, foreign and stray files.
    pq.write_table(pa.table({"x": [1]}), part / "data.parquet")
    pq.write_table(pa.table({"x": [1]}), Path(store.root) / "samples" / "loose.parquet")
    (part / "notes.txt").write_text("x")
    (Path(store.root) / "samples" / "agent=a=b").mkdir()
    (Path(store.root) / "status" / "agent=solver" / "iteration=x").mkdir(parents=True)
    kinds = {(p.kind, Path(p.path).name, p.severity) for p in check_store(store.root)}
    assert kinds == {
        ("schema", "data.parquet", "error"),
        ("unexpected_name", "data.parquet", "warning"),
        ("misplaced", "loose.parquet", "error"),
        ("unexpected", "notes.txt", "warning"),
        ("bad_partition", "agent=a=b", "error"),
        ("bad_partition", "iteration=x", "error"),
    }


def test_check_cli_and_missing_store(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    store = MEGStore(str(tmp_path / "ok"))
    store.write_samples("a", 0, make_rows(0))
    store.write_inputs(0, [{"input_id": "q0-0", "text": "t"}])
    assert check_main([store.root]) == 0
    assert "0 error(s), 0 warning(s)" in capsys.readouterr().out
    assert check_main([str(tmp_path / "nope")]) == 1
    assert [p.kind for p in check_store(str(tmp_path / "nope"))] == ["missing"]
    (tmp_path / "empty").mkdir()
    assert [p.kind for p in check_store(str(tmp_path / "empty"))] == ["not_a_store"]
    with pytest.raises(StoreError, match="no MEG store"):
        MEGStore(str(tmp_path / "empty"), create=False)
    assert check_main(["--bogus"]) == 2
    # python -m storage check PATH
    proc = run_python(
        "import runpy; runpy.run_module('storage', run_name='__main__')",
        "check",
        store.root,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.wait(timeout=60) == 0 and "0 error(s)" in proc.stdout.read()


WRITER = r"""
import sys
from storage import MEGStore
root, worker, n_batches, n_workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
G = 4
def rows(w, b):
    mb = w * n_batches + b
    return [{"input_id": f"w{w}b{b}-{k}", "traj": g, "turn": 0, "mb": mb, "policy_version": 0,
             "response_ids": [w, b, k, g], "logprobs": [0.0] * 4}
            for k in range(4) for g in range(G)]
store = MEGStore(root)
for b in range(n_batches):
    batch = rows(worker, b)
    store.write_samples("solver", 0, batch)
    store.write_status("solver", 0, [
        {"sample_id": f"{r['input_id']}:{r['traj']}:solver:0", "policy_version": 0,
         "mb": r["mb"], "reward": float(worker)} for r in batch])
    # Retries racing with the original writer: this worker's own batch and a neighbour's.
    store.write_samples("solver", 0, batch)
    store.write_samples("solver", 0, rows((worker + 1) % n_workers, b))
    store.read_samples("solver", 0, mb=batch[0]["mb"])
print("ok")
"""


def test_concurrent_writer_processes(store: MEGStore) -> None:
    n_workers, n_batches = 4, 6
    procs = [
        run_python(
            WRITER,
            store.root,
            str(w),
            str(n_batches),
            str(n_workers),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(n_workers)
    ]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    expected = {
        f"w{w}b{b}-{k}:{g}:solver:0"
        for w in range(n_workers)
        for b in range(n_batches)
        for k in range(4)
        for g in range(G)
    }
    raw = store.dataset("samples").to_table()
    # Every row stored exactly once, even raw: racing retries replaced the same fragment.
    assert raw.num_rows == len(expected)
    assert set(raw.column("sample_id").to_pylist()) == expected
    t = store.read_samples("solver", 0)
    assert t.num_rows == len(expected)
    ready = store.ready("solver", 0)
    assert ready.num_rows == len(expected)
    for r in ready.select(["sample_id", "reward"]).to_pylist():
        assert r["reward"] == float(r["sample_id"][1])  # the writer's own reward
    assert store.audit("solver", 0, expected=expected) == []
    assert check_store(store.root, stale_after_s=0) == []


KILLED = r"""
import os, sys, time
import pyarrow as pa
from storage import MEGStore
root, n = sys.argv[1], int(sys.argv[2])
rename = os.replace


def held_rename(src, dst, *a, **kw):
    # The fragment's temp file is whole on disk: say so, then hold here until killed (the
    # test kills the writer at this point, not at a moment it hopes a slow write is still in).
    if "_staging" in os.fspath(src):
        print("renaming", flush=True)
        while True:
            time.sleep(1)
    return rename(src, dst, *a, **kw)


os.replace = held_rename
table = pa.table({
    "input_id": [f"big{i // 4}" for i in range(n)],
    "traj": pa.array([i % 4 for i in range(n)], pa.int32()),
    "turn": pa.array([0] * n, pa.int32()),
    "mb": pa.array([1] * n, pa.int32()),
    "policy_version": pa.array([0] * n, pa.int64()),
    "response_text": [f"text {i}" for i in range(n)],
})
store = MEGStore(root)
print("writing", flush=True)
store.write_samples("solver", 0, table)
print("done", flush=True)
"""


def test_writer_killed_mid_write_leaves_nothing_visible(store: MEGStore) -> None:
    """A writer killed with its fragment written to the staging folder but not yet renamed
    into place (held there) leaves nothing a reader sees, only a stale temp file."""
    committed = store.write_samples("solver", 0, make_rows(0))
    staging = Path(store.root) / "_staging"
    proc = run_python(KILLED, store.root, "40", stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert proc.stdout.readline().strip() == "renaming"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    leftovers = [p for p in staging.rglob("*") if p.is_file()]
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0  # the unrenamed fragment

    # Readers see exactly the committed data, nothing of the killed write.
    part = Path(store.root) / "samples" / "agent=solver" / "iteration=0"
    assert sorted(str(p) for p in part.iterdir()) == committed
    assert store.read_samples("solver", 0).num_rows == 2 * G
    assert store.read_samples("solver", 0, mb=1).num_rows == 0
    problems = check_store(store.root, stale_after_s=0)
    assert [(p.kind, p.severity) for p in problems] == [("stale_staging", "warning")]
    assert check_store(store.root) == []  # not stale yet under the default threshold
    assert check_main([store.root, "--stale-after", "0"]) == 0  # warnings only
    assert check_main([store.root, "--stale-after", "0", "--strict"]) == 1
    assert store.clean_staging(older_than_s=3600) == []  # too young: maybe a live writer
    assert store.clean_staging(older_than_s=0) == [str(leftovers[0])]
    assert check_store(store.root, stale_after_s=0) == []
