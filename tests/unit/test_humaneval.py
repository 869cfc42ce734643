"""HumanEval through the sandbox: the canonical solutions pass 164/164, empty bodies 0/164,
and a user's own completions file is graded task by task (from the CLI too)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from flexmarl.cli import main
from flexmarl_core.workloads.humaneval import HumanEvalError, grade_humaneval, load_humaneval
from tests.conftest import dataset_folder


@pytest.fixture(scope="module")
def humaneval() -> Path:
    return dataset_folder("humaneval", "HumanEval.jsonl.gz") / "HumanEval.jsonl.gz"


def test_canonical_solutions_pass_all_and_empty_bodies_none(humaneval):
    canonical = grade_humaneval(humaneval, "canonical")
    assert (canonical.passed, canonical.total) == (164, 164), {
        k: (v.reason, v.detail) for k, v in canonical.verdicts.items() if v.reason != "passed"}
    empty = grade_humaneval(humaneval, "empty")
    assert (empty.passed, empty.total) == (0, 164)
    assert set(empty.reasons()) <= {"failed", "load_error"}


def test_own_completions_file_from_the_cli(humaneval, tmp_path, capsys):
    tasks = load_humaneval(humaneval)[:3]
    small = tmp_path / "three.jsonl"
    small.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    comps = tmp_path / "mine.jsonl"
    rows = [{"task_id": tasks[0]["task_id"], "completion": tasks[0]["canonical_solution"]},
            {"task_id": tasks[1]["task_id"], "completion": "    return None\n"},
            {"task_id": tasks[2]["task_id"], "completion": "    import os\n    os._exit(0)\n"}]
    comps.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "verdicts.json"
    assert main(["humaneval", str(small), "--completions", str(comps), "--json", str(out)]) == 0
    assert "1/3 passed" in capsys.readouterr().out
    tasks_out = json.loads(out.read_text())["tasks"]
    assert [tasks_out[t["task_id"]]["reason"] for t in tasks] == ["passed", "failed", "exited"]


def test_bad_files_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as fh:
        fh.write('{"task_id": "x", "prompt": "def f():\\n"}\n')
    with pytest.raises(HumanEvalError, match=r"line 1: missing .*entry_point"):
        load_humaneval(bad)
    assert main(["humaneval", str(tmp_path / "nope.jsonl"), "--canonical"]) == 2
    assert "no such HumanEval file" in capsys.readouterr().err
