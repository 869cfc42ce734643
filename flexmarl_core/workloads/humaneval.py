"""HumanEval grading through the sandbox: any HumanEval-format file, any model's completions.

    report = grade_humaneval("/data/humaneval/HumanEval.jsonl.gz", "canonical")
    report.passed, report.total        # 164, 164

A task's program is its `prompt` + the completion, run in the sandbox; its `test` (a `check`
function) runs in this process against the sandboxed `entry_point`, with the prompt as
prelude (some checks call the prompt's helpers, e.g. `poly`). Completions are a JSONL file of
`{"task_id", "completion"}` rows (the human-eval format), or "canonical" / "empty".
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexmarl_core.sandbox import Limits, Verdict, run_tests

#: env var naming the data folder; without a path, `$FLEXMARL_DATA/humaneval/HumanEval.jsonl.gz`
DATA_ENV = "FLEXMARL_DATA"
DEFAULT_NAME = "HumanEval.jsonl.gz"
FIELDS = ("task_id", "prompt", "entry_point", "test")
LIMITS = Limits(cpu_s=5, wall_s=15, memory_mb=512)


class HumanEvalError(ValueError):
    """A HumanEval or completions file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class HumanEvalReport:
    verdicts: dict[str, Verdict]

    @property
    def passed(self) -> int:
        return sum(v.reason == "passed" for v in self.verdicts.values())

    @property
    def total(self) -> int:
        return len(self.verdicts)

    def reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for v in self.verdicts.values():
            out[v.reason] = out.get(v.reason, 0) + 1
        return dict(sorted(out.items()))


def humaneval_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The file to read: `path` (a file, or a folder holding HumanEval.jsonl.gz), else
    `$FLEXMARL_DATA/humaneval/HumanEval.jsonl.gz`."""
    if path is None:
        root = os.environ.get(DATA_ENV)
        if not root:
            raise HumanEvalError(f"no HumanEval file given and {DATA_ENV} is not set")
        path = Path(root) / "humaneval"
    p = Path(path)
    if p.is_dir():
        p = p / DEFAULT_NAME
    if not p.is_file():
        raise HumanEvalError(f"{p}: no such HumanEval file")
    return p


def _jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    opener = gzip.open if path.name.endswith(".gz") else open
    rows = []
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for n, line in enumerate(fh, start=1):
                if line.strip():
                    where = f"{path}: line {n}"
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise HumanEvalError(f"{where}: not valid JSON ({exc.msg})") from None
                    if not isinstance(row, dict):
                        raise HumanEvalError(f"{where}: a row must be a JSON object")
                    rows.append((where, row))
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise HumanEvalError(f"{path}: cannot read: {exc}") from None
    return rows


def load_humaneval(path: str | os.PathLike[str] | None = None) -> list[dict[str, str]]:
    """The tasks of a HumanEval-format JSONL(.gz) file, checked field by field."""
    p = humaneval_path(path)
    tasks = []
    for where, row in _jsonl(p):
        missing = [f for f in FIELDS if not isinstance(row.get(f), str)]
        if missing:
            raise HumanEvalError(f"{where}: missing or non-string field(s) {missing}")
        tasks.append(row)
    if not tasks:
        raise HumanEvalError(f"{p}: no tasks")
    return tasks


def load_completions(path: str | os.PathLike[str]) -> dict[str, str]:
    """`{"task_id", "completion"}` rows -> task_id -> completion (one per task)."""
    out: dict[str, str] = {}
    for where, row in _jsonl(Path(path)):
        if not isinstance(row.get("task_id"), str) or not isinstance(row.get("completion"), str):
            raise HumanEvalError(f"{where}: a row needs string fields task_id and completion")
        if row["task_id"] in out:
            raise HumanEvalError(f"{where}: a second completion for {row['task_id']}")
        out[row["task_id"]] = row["completion"]
    return out


def grade_task(task: Mapping[str, str], completion: str, limits: Limits = LIMITS) -> Verdict:
    return run_tests(
        task["prompt"] + completion, [task["test"] + "\ncheck(candidate)\n"], limits,
        entry=task["entry_point"], prelude=task["prompt"],
    )


def grade_humaneval(
    path: str | os.PathLike[str] | None,
    completions: Mapping[str, str] | str,
    *,
    limits: Limits = LIMITS,
    workers: int | None = None,
) -> HumanEvalReport:
    """Grade every task of `path`. `completions`: task_id -> completion, a JSONL file of them,
    "canonical" (the file's own solutions) or "empty" (no body: the prompt alone). A task
    without a completion fails. `workers` programs run at once (default: the cores)."""
    tasks = load_humaneval(path)
    if completions == "canonical":
        missing = [t["task_id"] for t in tasks if not isinstance(t.get("canonical_solution"), str)]
        if missing:
            raise HumanEvalError(f"no canonical_solution for {missing[:3]}")
        chosen = {t["task_id"]: t["canonical_solution"] for t in tasks}
    elif completions == "empty":
        chosen = {t["task_id"]: "" for t in tasks}
    elif isinstance(completions, str):
        chosen = load_completions(completions)
    else:
        chosen = dict(completions)
    unknown = sorted(set(chosen) - {t["task_id"] for t in tasks})
    if unknown:
        raise HumanEvalError(f"completions for unknown task(s) {unknown[:3]} (not in the file)")

    def one(task: dict[str, str]) -> tuple[str, Verdict]:
        if task["task_id"] not in chosen:
            return task["task_id"], Verdict(0, 1, "load_error", "no completion for this task")
        return task["task_id"], grade_task(task, chosen[task["task_id"]], limits)

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return HumanEvalReport(dict(pool.map(one, tasks)))
