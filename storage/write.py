"""Writing the MEG Store: rows validated against the schema, split by micro-batch, and named
by their content so that a retried write replaces its own fragment.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .api import Rows
from .commit import Committer
from .fold import KEY, row_keys
from .schema import (
    INPUT_FILE_SCHEMA,
    SAMPLE_FILE_SCHEMA,
    STATUS_FIELDS,
    STATUS_FILE_SCHEMA,
    derive_sample_ids,
    validate_agent,
    validate_iteration,
)

__all__ = ["Rows", "Writer"]

class Writer(Committer):
    """Writing samples, status changes and inputs."""

    def write_samples(self, agent: str, iteration: int, rows: Rows) -> list[str]:
        """Write an agent's samples; returns the fragment paths (one per micro-batch).

        Each row needs ``input_id``, ``traj``, ``turn``, ``mb`` and ``policy_version``;
        ``sample_id`` is derived as ``{input_id}:{traj}:{agent}:{turn}`` when absent and
        checked when present. Other columns are optional (see ``SAMPLE_FILE_SCHEMA``); user
        fields go into ``extra`` (a dict is JSON-encoded). Idempotent: writing the same
        (sample_id, policy_version) set again replaces the earlier fragment.
        """
        agent = validate_agent(agent)
        iteration = validate_iteration(iteration)
        table = _to_table(
            rows,
            SAMPLE_FILE_SCHEMA,
            {"agent": agent, "iteration": iteration},
            "samples",
            derived=("sample_id",),
        )
        table = _check_samples(table, agent)
        _reject_duplicates(table, "samples")
        return self._write_by_mb("samples", self._samples_dir(agent, iteration), table, "")

    def _write_by_mb(self, kind: str, directory: str, table: pa.Table, extra: str) -> list[str]:
        if table.num_rows == 0:
            return []
        mbs = table.column("mb").unique().to_pylist()
        paths = []
        for mb in sorted(mbs, key=lambda m: (m is None, m)):
            part = (
                table
                if len(mbs) == 1
                else table.filter(
                    pc.is_null(table.column("mb"))
                    if mb is None
                    else pc.equal(table.column("mb"), mb)
                )
            )
            tag = "all" if mb is None else f"mb{mb:06d}"
            name = f"{tag}-{_content_key(kind, part, KEY, extra)}.parquet"
            paths.append(self._commit(part, directory, name))
        return [self.display(p) for p in paths]

    def write_status(self, agent: str, iteration: int, rows: Rows) -> list[str]:
        """Append status changes; returns the fragment paths (one per micro-batch).

        Each row names a sample (``sample_id``, ``policy_version``; give ``mb`` too so that
        micro-batch reads find it cheaply) and sets one or more of ``reward``, ``advantage``, ``value``,
        ``consumed_step``. Readers fold the latest non-null value of each field. Idempotent:
        the same samples and fields written again replace the earlier fragment.
        """
        agent = validate_agent(agent)
        iteration = validate_iteration(iteration)
        table = _to_table(
            rows, STATUS_FILE_SCHEMA, {"agent": agent, "iteration": iteration}, "status"
        )
        set_fields = [f for f in STATUS_FIELDS if table.column(f).null_count < table.num_rows]
        if table.num_rows and not set_fields:
            raise ValueError(f"status rows set none of the status fields {list(STATUS_FIELDS)}")
        for c in KEY:
            if table.column(c).null_count:
                raise ValueError(f"status rows need a non-null {c!r}")
        _reject_duplicates(table, "status")
        return self._write_by_mb(
            "status", self._status_dir(agent, iteration), table, ",".join(set_fields)
        )

    def mark_consumed(self, agent: str, iteration: int, samples: Rows, step: int,
                      advantages: Sequence[float] | None = None) -> list[str]:
        """Record that optimizer step ``step`` trained on ``samples`` (rows or a table), with
        the advantage each was trained with when given (one per sample, in order)."""
        table = samples if isinstance(samples, pa.Table) else pa.Table.from_pylist(list(samples))
        if table.num_rows == 0:  # an agent no trajectory of the micro-batch called: nothing trained
            return []
        cols = ["sample_id", "policy_version"] + (["mb"] if "mb" in table.column_names else [])
        table = table.select(cols)
        if advantages is not None:
            table = table.append_column("advantage", pa.array(list(advantages), pa.float32()))
        table = table.append_column(
            "consumed_step", pa.repeat(pa.scalar(step, pa.int64()), table.num_rows)
        )
        return self.write_status(agent, iteration, table)

    def write_inputs(self, iteration: int, rows: Rows) -> str:
        """Write the dataset inputs of one iteration; returns the fragment path.

        Rows: ``input_id`` (required), ``text``, ``answer``, ``split``, ``meta`` (a dict is
        JSON-encoded). Idempotent by the set of ``input_id``s.
        """
        iteration = validate_iteration(iteration)
        table = _to_table(rows, INPUT_FILE_SCHEMA, {"iteration": iteration}, "inputs")
        if table.column("input_id").null_count:
            raise ValueError("inputs rows need a non-null 'input_id'")
        name = f"part-{_content_key('inputs', table, ['input_id'])}.parquet"
        return self.display(self._commit(table, self._inputs_dir(iteration), name))


def _content_key(kind: str, table: pa.Table, key_cols: Sequence[str], extra: str = "") -> str:
    """Deterministic fragment key: the same rows (by key) written again get the same name."""
    cols = [table.column(c).to_pylist() for c in key_cols]
    keys = sorted("\x1f".join(map(str, k)) for k in zip(*cols, strict=True))
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{kind}\x1e{extra}\x1e".encode())
    h.update("\x1e".join(keys).encode())
    return h.hexdigest()


def _to_table(
    rows: Rows,
    schema: pa.Schema,
    partition: Mapping[str, Any],
    kind: str,
    derived: Sequence[str] = (),
) -> pa.Table:
    """Rows (dicts or a table) -> a table of exactly ``schema``, ``created_at`` set to now.

    Partition columns may appear in the rows only with the value of the write call.
    """
    allowed = [n for n in schema.names if n != "created_at"]
    json_cols = [c for c in ("extra", "meta") if c in allowed]
    if isinstance(rows, pa.Table):
        cols = rows.column_names
    else:
        rows = list(rows)
        cols = sorted({k for r in rows for k in r})
    unknown = [c for c in cols if c not in allowed and c not in partition and c != "created_at"]
    if unknown:
        raise ValueError(
            f"unknown {kind} column(s) {unknown}; valid: {allowed}"
            + (f" (put user fields in {json_cols[0]!r} as a dict)" if json_cols else "")
        )
    for c in partition:
        if c in cols:
            values = (
                set(rows.column(c).unique().to_pylist())
                if isinstance(rows, pa.Table)
                else {r.get(c, partition[c]) for r in rows}
            )
            if values - {partition[c]}:
                raise ValueError(
                    f"rows have {c}={sorted(values, key=str)} but were written with "
                    f"{c}={partition[c]!r}"
                )
    # Files carry no field metadata (the docs live in the schema constants): it bloats every
    # footer that readers parse.
    target = pa.schema([schema.field(c).remove_metadata() for c in allowed])
    try:
        if isinstance(rows, pa.Table):
            n = rows.num_rows
            arrays = []
            for f in target:
                if f.name in cols:
                    arrays.append(_cast(rows.column(f.name), f))
                else:
                    arrays.append(pa.nulls(n, f.type))
            table = pa.Table.from_arrays(arrays, schema=target)
        else:
            if json_cols and any(isinstance(r.get(c), dict) for r in rows for c in json_cols):
                rows = [
                    {
                        **r,
                        **{
                            c: json.dumps(r[c], sort_keys=True)
                            for c in json_cols
                            if isinstance(r.get(c), dict)
                        },
                    }
                    for r in rows
                ]
            table = pa.Table.from_pylist(rows, schema=target)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise ValueError(f"cannot convert {kind} rows to the store schema: {e}") from e
    for f in target:
        if not f.nullable and f.name not in derived and table.column(f.name).null_count:
            raise ValueError(f"{kind} column {f.name!r} is required but has null/missing values")
    created_at = schema.field("created_at").remove_metadata()
    created = pa.repeat(pa.scalar(datetime.now(UTC), created_at.type), table.num_rows)
    table = table.add_column(schema.get_field_index("created_at"), created_at, created)
    return table


def _cast(column: pa.ChunkedArray, field: pa.Field) -> pa.ChunkedArray:
    if column.type.equals(field.type):
        return column
    try:
        return column.cast(field.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise ValueError(
            f"column {field.name!r} has type {column.type}, expected {field.type}: {e}"
        ) from e


def _reject_duplicates(table: pa.Table, kind: str) -> None:
    """One write may not name a (sample_id, policy_version) twice: which row would win?

    The usual cause is a wrong traj/turn (G trajectories all with traj=0), which would
    otherwise be silently deduplicated down to one sample.
    """
    keys = row_keys(table)
    if len(pc.unique(keys)) != len(keys):
        counts = pc.value_counts(keys)
        dup = counts.filter(pc.greater(counts.field("counts"), 1))[0]["values"].as_py()
        raise ValueError(
            f"{kind} rows name (sample_id, policy_version) {tuple(dup.split(chr(31)))} more "
            "than once in one write; check traj/turn (every trajectory and turn needs its own)"
        )


def _check_samples(table: pa.Table, agent: str) -> pa.Table:
    """Fill in missing sample_ids, reject wrong ones and mismatched logprobs."""
    expected = derive_sample_ids(table, agent)
    sid = table.column("sample_id")
    i = table.schema.get_field_index("sample_id")
    if sid.null_count == table.num_rows:
        table = table.set_column(i, table.schema.field(i), expected)
        sid = table.column(i)
    elif sid.null_count:
        raise ValueError("give sample_id for every row or for none (it is then derived)")
    else:
        ok = pc.equal(sid, expected)
        if not pc.all(ok).as_py():
            j = pc.index(ok, False).as_py()
            raise ValueError(
                f"sample_id {sid[j].as_py()!r} does not match '{{input_id}}:{{traj}}:"
                f"{{agent}}:{{turn}}' = {expected[j].as_py()!r} (agent {agent!r})"
            )
    resp, lp = table.column("response_ids"), table.column("logprobs")
    if lp.null_count < table.num_rows and resp.null_count < table.num_rows:
        diff = pc.not_equal(pc.list_value_length(resp), pc.list_value_length(lp))
        if pc.any(diff).as_py():
            j = pc.index(diff, True).as_py()
            raise ValueError(
                f"sample {sid[j].as_py()!r}: {len(lp[j])} logprobs for "
                f"{len(resp[j])} response tokens"
            )
    return table
