"""The damaged-store drills as tests: a finished 6-iteration run of the tiny team, a Parquet
fragment of iteration 3 truncated, `flexmarl store repair`, a resume, `flexmarl store audit`.

Under the default retention the solver's weights v3 that sampled the fragment are gone and its
samples were trained on: the repair records them as lost, and the audit names them and nothing
else. With `train.keep_every: 1` the repair rewinds the ops that wrote it and the resume writes
the same rows again; the run's weights, rows and metrics are the undamaged run's, and the
figures the resume reports stay plausible (no zero-length window, no absurd rate). The runs go
through the real stages on the in-process ThreadExecutor (`tests/_runs.py` `train_on_threads`);
`tests/slow/test_store_repair.py` drives the CLI and flow on the real stack."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flexmarl.cli import main
from flexmarl_core.config import load_config
from flexmarl_core.driver import run
from flexmarl_core.driver.audit import audit_run
from flexmarl_core.driver.repair import skipped_check
from flexmarl_core.orchestrator.hooks import Callbacks
from flexmarl_core.sim.threads import ThreadExecutor, stage_fn
from storage import MEGStore
from tests._runs import COMMON, TINY, train_on_threads

AGENTS = ("planner", "solver", "verifier")
ITERATIONS, DAMAGED = 6, 3
COLUMNS = ["sample_id", "policy_version", "response_ids", "logprobs", "reward", "advantage", "consumed_step"]


@pytest.fixture(scope="module", params=[None, 1], ids=["default-retention", "keep-every-1"])
def finished(request, tmp_path_factory):
    """An undamaged finished run (`keep_every` as the param), and its outcome."""
    every = request.param
    over = [f"run_dir={tmp_path_factory.mktemp('drill')}/run", *COMMON, f"train.iterations={ITERATIONS}",
            *([f"train.keep_every={every}"] if every else [])]
    folder, outcome = train_on_threads(load_config(TINY, over))
    return Path(folder), outcome, every


def _damaged_copy(original: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run with its solver's fragment of iteration 3 truncated mid-file."""
    copy = tmp_path / "run"
    shutil.copytree(original, copy)
    (frag,) = (copy / "store" / "samples" / "agent=solver" / f"iteration={DAMAGED}").glob("*.parquet")
    frag.write_bytes(frag.read_bytes()[: frag.stat().st_size // 2])
    return copy, frag


def _resume(folder: Path, rebuilt: list[dict]) -> run.RunOutcome:
    cfg = load_config(folder / "config.yaml")
    ex = ThreadExecutor(stage_fn(str(folder)), {w.name: dict(w.resources) for w in cfg.cluster.workers})
    try:
        return run.train(cfg, folder, ex, resume=True, hooks=[Callbacks(iteration_done=rebuilt.append)])
    finally:
        ex.close()


def _rows(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics" / "iterations.jsonl").read_text().splitlines()]


def _samples(folder: Path) -> dict:
    store = MEGStore(str(folder / "store"))
    return {(a, it): store.read_samples(a, it).select(COLUMNS).sort_by("sample_id").to_pylist()
            for a in AGENTS for it in range(ITERATIONS)}


def test_a_damaged_fragment_of_iteration_3_is_repaired_or_recorded_lost(finished, tmp_path, capsys):
    original, undamaged, every = finished
    folder, frag = _damaged_copy(original, tmp_path)
    # The audit names the damaged file and the command that repairs it.
    assert main(["store", "audit", str(folder)]) == 1
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if frag.name in x]
    assert line.startswith("ERROR") and f"flexmarl store repair {folder}" in line, out
    # What a resume with --skip-check would leave as it is, for its summary.
    note = skipped_check(str(folder))
    assert "--skip-check" in note and "1 damaged store file" in note and frag.name in note, note

    assert main(["store", "repair", str(folder)]) == 0
    said = capsys.readouterr().out
    assert not frag.exists() and frag.name in said
    (rep,) = [json.loads(x) for x in (folder / "repairs.jsonl").read_text().splitlines()]
    cfg = load_config(folder / "config.yaml")
    inputs = MEGStore(str(folder / "store")).read_inputs(DAMAGED).column("input_id").to_pylist()
    solver_ids = sorted(f"{i}:{t}:solver:0" for i in inputs for t in range(cfg.batch.group_size))
    rows_before = _rows(folder)
    rebuilt: list[dict] = []
    resumed = _resume(folder, rebuilt)
    audit = audit_run(str(folder))
    if every is None:
        # v3 is gone (the run keeps v0 and v6) and iteration 3 is trained into every kept state:
        # history. Nothing is rewound, and the audit names exactly those samples.
        assert rep["outcome"] == "lost" and rep["ids"] == solver_ids and rep["count"] == len(solver_ids)
        assert "lost: 8 samples" in said and "store audit" in said, said
        assert rows_before == _rows(original) and rebuilt == [] and resumed.attempt_wall_s < resumed.wall_s
        (found,) = audit.problems
        assert (found.kind, found.severity) == ("lost", "warning"), found
        assert f"agent=solver/iteration={DAMAGED}" in found.path
        assert found.message.startswith(f"{len(solver_ids)} samples lost to damage, trained before it")
        assert all(i in found.message for i in solver_ids), found.message
        assert audit.verdict() == f"clean but for {len(solver_ids)} samples lost to damage, trained before it"
        return
    # keep_every 1 kept v3: the ops that wrote the fragment run again and write the same rows.
    assert rep["outcome"] == "rewritten" and "rollout[solver] it=3 mb=0" in rep["ops"], rep
    assert audit.problems == [] and audit.verdict() == "clean"
    assert _samples(folder) == _samples(original)
    for agent in AGENTS:
        for v in range(ITERATIONS + 1):
            got, want = (load_file(str(d / "weights" / agent / f"v{v}.safetensors")) for d in (folder, original))
            assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in got), (agent, v)
    # Each row written once: iteration 3's keeps its figures, marked; the others are untouched.
    rows = _rows(folder)
    first = _rows(original)
    assert [r["iteration"] for r in rows] == list(range(ITERATIONS))
    assert rows[DAMAGED].pop("rebuilt_ops") == len(rep["ops"])
    assert rows == first
    assert [r["iteration"] for r in rebuilt] == [DAMAGED]  # the terminal's line for it, once rebuilt
    # The figures stay plausible: each window is the iteration's own and the run's wall time
    # holds every one of them (the bug: e2e 1e-09 s, 1e11 tokens/s, utilisation 0, and a
    # summary of the resume's 0.2 s alone).
    for r in resumed.iterations:
        assert r["e2e_s"] > 0 and 0 < r["utilization"] <= 1 + 1e-9, r
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["e2e_s"])
    summary = resumed.summary()
    assert summary["wall_s"] >= sum(r["e2e_s"] for r in rows) and summary["attempt_wall_s"] < summary["wall_s"]
    assert summary["tokens_per_s"] == pytest.approx(undamaged.summary()["tokens_per_s"])
