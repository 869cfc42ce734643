"""A resumed run compacts what a killed attempt left half compacted."""

import shutil
from pathlib import Path

from test_store import make_rows

from flexmarl_core.driver.compaction import Compaction
from storage import MEGStore


def test_catch_up_finishes_a_compaction_cut_between_commit_and_delete(tmp_path: Path) -> None:
    store = MEGStore(str(tmp_path / "store"))
    for mb in range(3):
        store.write_samples("solver", 0, make_rows(mb))
    ids = store.read_samples("solver", 0).column("sample_id").to_pylist()
    part = tmp_path / "store" / "samples" / "agent=solver" / "iteration=0"
    saved = tmp_path / "saved"
    shutil.copytree(part, saved)
    store.compact("solver", 0)
    for f in saved.iterdir():  # the kill: the compacted fragment is in, the old ones not yet gone
        shutil.copy(f, part / f.name)
    assert [p.kind for p in store.audit("solver", 0, expected=ids)] == ["duplicate"]

    compaction = Compaction(store)
    compaction.catch_up([0])
    compaction.close()
    assert store.audit("solver", 0, expected=ids) == []
    assert len(list(part.iterdir())) == 1
    assert compaction.partitions == 1


def test_catch_up_walks_back_only_to_the_last_compacted_iteration(tmp_path: Path) -> None:
    store = MEGStore(str(tmp_path / "store"))
    for it in range(4):
        for mb in range(2):
            store.write_samples("solver", it, make_rows(mb))
    for it in (1, 2):  # the earlier attempt compacted 1 and 2, not 3 (and 0 failed, say)
        store.compact("solver", it)
    compaction = Compaction(store)
    compaction.catch_up(range(4))
    compaction.close()
    files = {it: len(list((tmp_path / "store" / "samples" / "agent=solver" / f"iteration={it}").iterdir()))
             for it in range(4)}
    assert files == {0: 2, 1: 1, 2: 1, 3: 1}
    assert compaction.partitions == 1
