"""Row keys, deduplication and status folding of the MEG Store: pure Arrow, no I/O.

A row is identified by (sample_id, policy_version) (inputs: by input_id); among copies of a
row the latest ``created_at`` wins, and each status field takes its latest non-null value.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from .schema import STATUS_FIELDS, STATUS_FILE_SCHEMA

__all__ = ["KEY", "fold_status", "latest", "newest_write", "row_keys", "status_log"]

KEY = ["sample_id", "policy_version"]


def row_keys(table: pa.Table) -> pa.Array:
    """One string per row identifying (sample_id, policy_version), for set operations."""
    if "policy_version" not in table.column_names:  # inputs: keyed by input_id alone
        return _array(table.column("input_id"))
    return _array(
        pc.binary_join_element_wise(
            table.column("sample_id"), pc.cast(table.column("policy_version"), pa.string()), "\x1f"
        )
    )


def _array(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def _newest_first(table: pa.Table) -> pa.Array:
    """Row order by created_at descending; among equal times the row stored last first."""
    pos = pa.array(range(table.num_rows), pa.int64())
    return pc.sort_indices(
        pa.table({"t": table.column("created_at"), "p": pos}),
        sort_keys=[("t", "descending"), ("p", "descending")],
    )


# Deduplication and folding use hash lookups (unique / index_in: index_in returns the *first*
# match in value_set, so on a newest-first order it finds the latest row) instead of
# Table.group_by, whose Acero plan costs ~0.3-1 ms per call on the micro-batch read path.


def latest(table: pa.Table) -> pa.Table:
    """Keep one row per key (see ``row_keys``): the latest ``created_at`` wins."""
    if table.num_rows <= 1:
        return table
    keys = row_keys(table)
    distinct = pc.unique(keys)
    if len(distinct) == table.num_rows:
        return table  # common case: no duplicates; keep the order and skip the sort
    order = _newest_first(table)
    first = pc.index_in(distinct, value_set=keys.take(order))
    return table.take(order.take(first))


def fold_status(samples: pa.Table, log: pa.Table) -> pa.Table:
    """Set each status field of each sample to its latest non-null value in ``log``."""
    if log.num_rows == 0 or samples.num_rows == 0:
        return samples
    order = _newest_first(log)
    log = log.take(order)
    log_keys = row_keys(log)
    sample_keys = row_keys(samples)
    for f in STATUS_FIELDS:
        if f not in samples.column_names:
            continue
        col = log.column(f)
        if col.null_count == len(col):
            value = pa.nulls(samples.num_rows, col.type)
        else:
            valid = pc.is_valid(col)
            idx = pc.index_in(sample_keys, value_set=log_keys.filter(valid))
            value = col.filter(valid).take(idx)
        i = samples.schema.get_field_index(f)
        samples = samples.set_column(i, samples.schema.field(i), value)
    return samples


def newest_write(table: pa.Table, log: pa.Table) -> pa.Array:
    """Per row of ``table``: the latest created_at among its entries in ``log`` (or null)."""
    order = _newest_first(log)
    idx = pc.index_in(row_keys(table), value_set=row_keys(log).take(order))
    return log.column("created_at").take(order).take(idx)


def status_log(samples: pa.Table, status: pa.Table) -> pa.Table:
    """Status entries from the status files plus those carried by sample rows themselves.

    Sample rows carry status after compaction (or when rollout wrote a reward directly);
    folding both lets a late retry of a sample (status columns null) never hide a reward.
    """
    parts = [status] if status.num_rows else []
    carried = [f for f in STATUS_FIELDS if samples.column(f).null_count < samples.num_rows]
    if carried:
        parts.append(
            pa.Table.from_arrays(
                [
                    samples.column(c)
                    if c in samples.column_names
                    else pa.nulls(samples.num_rows, STATUS_FILE_SCHEMA.field(c).type)
                    for c in STATUS_FILE_SCHEMA.names
                ],
                schema=STATUS_FILE_SCHEMA,
            )
        )
    if not parts:
        return STATUS_FILE_SCHEMA.empty_table()
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts)
