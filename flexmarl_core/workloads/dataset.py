"""Problems from files: `kind: dataset` (JSONL or Parquet with a field mapping) and GSM8K.

`workload.fields` maps problem fields to the file's columns::

    fields: {input: question, answer: answer, id: qid, split: split, demo.planner: plan}

`input` and `answer` are required. `id` gives stable input ids (default: ``r{line}``);
`split` pins rows to train / held-out (``test``, ``eval``, ``validation`` mean held-out;
default: a hash of the input text, `params.heldout_fraction`); with `params.heldout_path`
(a separate held-out file) every row of the main file is train; ``demo.<agent>`` columns are
that agent's demonstrations (default: the answer). Every other column lands in
`Problem.meta`. A row that cannot be used stops loading with the file and the line (JSONL)
or row (Parquet) in the message.

Relative paths resolve against the run's base folder (the working directory unless
`make_workload(base_dir=...)`); ``$VARS`` and ``~`` expand.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from flexmarl_core.workloads.api import Problem, WorkloadError
from flexmarl_core.workloads.base import AnswerPoolWorkload, normalize_split

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
PARQUET_SUFFIXES = (".parquet", ".pq")
FIELD_KEYS = ("input", "answer", "id", "split")
DEMO_PREFIX = "demo."
#: env var naming a data folder; `kind: gsm8k` without `path` reads $FLEXMARL_DATA/gsm8k
DATA_ENV = "FLEXMARL_DATA"


def resolve_path(path: str, base_dir: str | os.PathLike[str] | None) -> Path:
    p = Path(os.path.expanduser(os.path.expandvars(path)))
    return p if p.is_absolute() else Path(base_dir if base_dir is not None else Path.cwd()) / p


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (where, row) for each record; `where` is ``file:line N`` or ``file:row N``."""
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        opener = gzip.open if name.endswith(".gz") else open
        try:
            with opener(path, "rt", encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, start=1):
                    if not line.strip():
                        continue
                    where = f"{path}: line {lineno}"
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise WorkloadError(
                            f"{where}: not valid JSON: {exc.msg} (column {exc.colno})"
                        ) from None
                    if not isinstance(row, dict):
                        raise WorkloadError(
                            f"{where}: expected a JSON object, got {type(row).__name__}"
                        )
                    yield where, row
        except (OSError, UnicodeDecodeError) as exc:
            raise WorkloadError(f"{path}: cannot read: {exc}") from None
    elif name.endswith(PARQUET_SUFFIXES):
        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise WorkloadError(f"{path}: cannot read as Parquet: {exc}") from None
        for i, row in enumerate(table.to_pylist()):
            yield f"{path}: row {i}", row
    else:
        raise WorkloadError(
            f"{path}: unknown file type; expected one of {list(JSONL_SUFFIXES + PARQUET_SUFFIXES)}"
        )


def check_fields(fields: Mapping[str, str], agents: list[str]) -> None:
    for key in fields:
        if key.startswith(DEMO_PREFIX):
            agent = key[len(DEMO_PREFIX) :]
            if agent not in agents:
                raise WorkloadError(
                    f"workload.fields.{key}: unknown agent {agent!r}; agents: {agents}"
                )
        elif key not in FIELD_KEYS:
            raise WorkloadError(
                f"workload.fields has unknown key {key!r}; valid: {list(FIELD_KEYS)} and "
                f"'{DEMO_PREFIX}<agent>'"
            )
    missing = [k for k in ("input", "answer") if k not in fields]
    if missing:
        raise WorkloadError(f"workload.fields must map {missing} to a column")


def _cell(row: Mapping[str, Any], fields: Mapping[str, str], key: str, where: str) -> str:
    col = fields[key]
    if col not in row:
        raise WorkloadError(
            f"{where}: no column {col!r} (workload.fields.{key}); the row has {sorted(row)}"
        )
    value = row[col]
    if value is None or isinstance(value, dict | list) or str(value).strip() == "":
        raise WorkloadError(
            f"{where}: column {col!r} (workload.fields.{key}) must be a non-empty string or "
            f"number, got {value!r}"
        )
    return str(value)


class DatasetWorkload(AnswerPoolWorkload):
    """`kind: dataset`: question/answer rows from a JSONL or Parquet file."""

    def __init__(
        self,
        agents: list[str],
        output_agent: str,
        path: Path,
        *,
        fields: Mapping[str, str],
        heldout_path: Path | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(agents, output_agent, **kwargs)
        check_fields(fields, agents)
        if heldout_path is not None and "split" in fields:
            raise WorkloadError(
                f"workload.fields.split ({fields['split']!r}) and params.heldout_path "
                f"({heldout_path}) both choose the held-out set; keep one: with heldout_path "
                "every row of workload.path is train"
            )
        self.path = path
        self.heldout_path = heldout_path
        self.fields = dict(fields)

    @property
    def source(self) -> str:
        return f"dataset {self.path}"

    @property
    def heldout_origin(self) -> str:
        pinned = [str(path) for path, split, _ in self._files() if split == "heldout"]
        if pinned:
            return " and ".join(pinned)
        return f"the rows of {self.path} whose {self.fields.get('split')!r} column says held-out"

    def _files(self) -> list[tuple[Path, str | None, str]]:
        """(file, forced split, default id prefix) to read."""
        if self.heldout_path is None:
            return [(self.path, None, "r")]
        # A held-out file of its own makes the main file all train: no hash split of it.
        return [(self.path, "train", "r"), (self.heldout_path, "heldout", "h")]

    def load(self) -> list[Problem]:
        out = []
        for path, forced_split, prefix in self._files():
            if not path.is_file():
                raise WorkloadError(f"{path}: no such file (workload.path / params.heldout_path)")
            for i, (where, row) in enumerate(read_rows(path)):
                out.append(
                    self.row_to_problem(
                        row, where=where, default_id=f"{prefix}{i}", split=forced_split
                    )
                )
        return out

    def row_to_problem(
        self, row: Mapping[str, Any], *, where: str, default_id: str, split: str | None
    ) -> Problem:
        f = self.fields
        text = _cell(row, f, "input", where)
        answer = self.parse_answer(_cell(row, f, "answer", where), where=where)
        input_id = _cell(row, f, "id", where) if "id" in f else default_id
        used = {f[k] for k in f}
        meta: dict[str, Any] = {k: v for k, v in row.items() if k not in used}
        demos = {
            k[len(DEMO_PREFIX) :]: _cell(row, f, k, where) for k in f if k.startswith(DEMO_PREFIX)
        }
        if demos:
            meta["demo"] = demos
        if split is not None:
            meta["split"] = split
        elif "split" in f:
            meta["split"] = normalize_split(_cell(row, f, "split", where), where=where)
        meta["where"] = where
        try:
            return Problem(input_id, text, answer, meta)
        except WorkloadError as exc:
            raise WorkloadError(f"{where}: {exc}") from None

    def parse_answer(self, raw: str, *, where: str) -> str:
        """Hook for formats whose answer column needs parsing (GSM8K's '#### 42')."""
        return raw


_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.S)
_CALC = re.compile(r"<<[^>]*>>")


def gsm8k_answer(solution: str) -> tuple[str, str] | None:
    """Split a GSM8K solution into (final answer, rationale); None without a '####' line.

    The answer drops thousands commas ('1,234' -> '1234'); the rationale drops the
    calculator annotations ('<<48/2=24>>').
    """
    m = _GSM8K_FINAL.search(solution)
    if not m:
        return None
    answer = m.group(1).replace(",", "").strip()
    rationale = _CALC.sub("", solution[: m.start()]).strip()
    return answer, rationale


class GSM8KWorkload(DatasetWorkload):
    """`kind: gsm8k`: grade-school math word problems, numeric answers.

    `path` is the GSM8K folder (train.jsonl -> train, test.jsonl -> held-out) or one JSONL
    file (split by hash); without `path`, ``$FLEXMARL_DATA/gsm8k``. The output agent is graded
    on the last number it writes; other agents' demonstrations are the worked rationale.
    Meant for real models: too long for the tiny CPU presets.
    """

    def _files(self) -> list[tuple[Path, str | None, str]]:
        if self.path.is_dir():
            return [
                (self.path / "train.jsonl", "train", "gt"),
                (self.path / "test.jsonl", "heldout", "gh"),
            ]
        return [(self.path, None, "g")]

    @property
    def source(self) -> str:
        return f"GSM8K at {self.path}"

    def parse_answer(self, raw: str, *, where: str) -> str:
        parsed = gsm8k_answer(raw)
        if parsed is None:
            raise WorkloadError(f"{where}: GSM8K answer has no '#### <number>' line: {raw[-80:]!r}")
        return parsed[0]

    def row_to_problem(
        self, row: Mapping[str, Any], *, where: str, default_id: str, split: str | None
    ) -> Problem:
        p = super().row_to_problem(row, where=where, default_id=default_id, split=split)
        rationale = gsm8k_answer(str(row[self.fields["answer"]]))
        demos = (
            {a: rationale[1] for a in self.agents if a != self.output_agent} if rationale else {}
        )
        demos.update(p.meta.get("demo", {}))
        return Problem(p.input_id, p.text, p.answer, {**p.meta, "demo": demos})


def gsm8k_path(path: str | None, base_dir: str | os.PathLike[str] | None) -> Path:
    if path is not None:
        return resolve_path(path, base_dir)
    root = os.environ.get(DATA_ENV)
    if not root:
        raise WorkloadError(
            f"kind=gsm8k needs workload.path (the GSM8K folder with train.jsonl and test.jsonl, "
            f"or one JSONL file) or the {DATA_ENV} environment variable (then {DATA_ENV}/gsm8k)"
        )
    return Path(root) / "gsm8k"
