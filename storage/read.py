"""Reading the MEG Store: fragments checked against their schema, partitions deduplicated and
with status folded in (see :mod:`storage.fold`), and the raw ``pyarrow.dataset`` view.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .errors import StoreError
from .fold import fold_status, latest, status_log
from .fs import StoreFiles
from .schema import (
    INPUT_FILE_SCHEMA,
    INPUT_PARTITION_SCHEMA,
    INPUT_READ_SCHEMA,
    SAMPLE_FILE_SCHEMA,
    SAMPLE_PARTITION_SCHEMA,
    SAMPLE_READ_SCHEMA,
    STATUS_FIELDS,
    STATUS_FILE_SCHEMA,
    partitioning,
    validate_agent,
    validate_iteration,
)

__all__ = ["SORT_KEYS", "Reader"]

_MAX_READ_ATTEMPTS = 8
#: Rows of a partition come in this order (after ``iteration``, for several iterations).
SORT_KEYS = ["mb", "input_id", "traj", "turn", "policy_version"]


class _Vanished(Exception):
    """A listed fragment was deleted before it could be read (compaction ran meanwhile)."""


_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _reader_pool() -> ThreadPoolExecutor:
    """Threads for reading many fragments at once (pyarrow releases the GIL; on S3 each read
    is a round trip). Recreated after a fork, whose child inherits no threads."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            workers = min(16, 2 * (os.cpu_count() or 1))
            _pool = (os.getpid(), ThreadPoolExecutor(workers, thread_name_prefix="meg-read"))
        return _pool[1]


class Reader(StoreFiles):
    """Reading samples, inputs and single fragments."""

    def read_fragment(
        self, path: str, schema: pa.Schema, columns: Sequence[str] | None = None
    ) -> pa.Table:
        """Read one fragment (a path inside ``fs``), checked against ``schema``.

        ``columns=[]`` reads only the footer. Raises StoreError naming the file when it is
        unreadable or of a foreign schema; a file deleted meanwhile raises an internal error
        that the partition readers catch to list again.
        """
        shown = self.display(path)
        try:
            with self.fs.open_input_file(path) as f:
                pf = pq.ParquetFile(f)
                file_schema = pf.schema_arrow
                if not file_schema.equals(schema):
                    _check_schema(file_schema, schema, shown)
                present = set(file_schema.names)
                wanted = list(columns) if columns is not None else schema.names
                if columns is None and file_schema.names == wanted:
                    table = pf.read(use_threads=False)  # skips pyarrow's column-name lookup
                else:
                    table = pf.read(columns=[c for c in wanted if c in present], use_threads=False)
        except FileNotFoundError as e:
            raise _Vanished(path) from e
        except StoreError:
            raise
        except (pa.ArrowException, OSError) as e:
            raise StoreError(f"cannot read store fragment {shown}: {e}", shown) from e
        if table.num_columns != len(wanted) or table.column_names != wanted:
            # Older file without a (nullable) column that was added later: fill with nulls.
            n = table.num_rows
            table = pa.Table.from_arrays(
                [
                    table.column(c) if c in present else pa.nulls(n, schema.field(c).type)
                    for c in wanted
                ],
                schema=pa.schema([schema.field(c) for c in wanted]),
            )
        return table

    def _read_all(
        self, paths: Sequence[str], schema: pa.Schema, columns: Sequence[str] | None = None
    ) -> pa.Table:
        if not paths:
            cols = list(columns) if columns is not None else schema.names
            return pa.schema([schema.field(c) for c in cols]).empty_table()
        if len(paths) < 4:  # the micro-batch path: threads would cost more than they save
            tables = [self.read_fragment(p, schema, columns) for p in paths]
        else:
            tables = list(
                _reader_pool().map(lambda p: self.read_fragment(p, schema, columns), paths)
            )
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)

    def _read_partition_raw(
        self, agent: str, iteration: int, mb: int | None, columns: Sequence[str] | None
    ) -> tuple[pa.Table, pa.Table]:
        """Raw sample rows and status rows of one partition (optionally one micro-batch).

        Lists the status directory *before* the samples directory: compaction writes its
        output before deleting anything, and deletes sample fragments before status ones, so a
        status file missing from our listing is already folded into a compacted sample file
        that our (later) samples listing sees. A listed file that vanishes before we read it
        (compaction finished meanwhile) makes us list again.
        """
        for _ in range(_MAX_READ_ATTEMPTS):
            try:
                status_paths = self._fragments(self._status_dir(agent, iteration), mb)
                sample_paths = self._fragments(self._samples_dir(agent, iteration), mb)
                status = self._read_all(status_paths, STATUS_FILE_SCHEMA)
                samples = self._read_all(sample_paths, SAMPLE_FILE_SCHEMA, columns)
                return samples, status
            except _Vanished:
                continue
        raise StoreError(
            f"partition {self.display(self._samples_dir(agent, iteration))} kept changing "
            f"while being read ({_MAX_READ_ATTEMPTS} attempts); is compaction looping?",
            self.display(self._samples_dir(agent, iteration)),
        )

    def read_samples(
        self,
        agent: str,
        iteration: int | None = None,
        mb: int | None = None,
        columns: Sequence[str] | None = None,
    ) -> pa.Table:
        """Samples of ``agent``: deduplicated by (sample_id, policy_version), status folded in.

        ``iteration=None`` reads every iteration; ``mb`` restricts to one micro-batch (and
        opens only that micro-batch's fragments). Rows come sorted by
        (iteration, mb, input_id, traj, turn, policy_version); the schema is
        ``SAMPLE_READ_SCHEMA`` (or its ``columns`` subset, in that order).
        """
        agent = validate_agent(agent)
        if columns is not None:
            unknown = [c for c in columns if c not in SAMPLE_READ_SCHEMA.names]
            if unknown:
                raise ValueError(f"unknown column(s) {unknown}; valid: {SAMPLE_READ_SCHEMA.names}")
        its = self.iterations(agent) if iteration is None else [validate_iteration(iteration)]
        out_schema = (
            SAMPLE_READ_SCHEMA
            if columns is None
            else pa.schema([SAMPLE_READ_SCHEMA.field(c) for c in columns])
        )
        parts = [self._read_partition(agent, it, mb, columns) for it in its]
        parts = [p for p in parts if p.num_rows]
        if not parts:
            return out_schema.empty_table()
        return parts[0] if len(parts) == 1 else pa.concat_tables(parts)

    def _read_partition(
        self, agent: str, iteration: int, mb: int | None, columns: Sequence[str] | None
    ) -> pa.Table:
        want_status = columns is None or any(c in STATUS_FIELDS for c in columns)
        if columns is None:
            file_cols = None
        else:
            need = set(columns) | set(SORT_KEYS) | {"sample_id", "created_at"}
            if want_status:
                need |= set(STATUS_FIELDS)
            file_cols = [c for c in SAMPLE_FILE_SCHEMA.names if c in need]
        samples, status = self._read_partition_raw(agent, iteration, mb, file_cols)
        if samples.num_rows == 0:
            return pa.schema(
                [SAMPLE_READ_SCHEMA.field(c) for c in (columns or SAMPLE_READ_SCHEMA.names)]
            ).empty_table()
        if mb is not None:
            # Untagged fragments (compaction output) hold every micro-batch.
            col = samples.column("mb")
            if pc.min(col).as_py() != mb or pc.max(col).as_py() != mb:
                samples = samples.filter(pc.equal(col, mb))
        if want_status:
            log = status_log(samples, status)
            samples = latest(samples)
            samples = fold_status(samples, log)
        else:
            samples = latest(samples)
        n = samples.num_rows
        samples = samples.take(
            pc.sort_indices(samples, sort_keys=[(c, "ascending") for c in SORT_KEYS])
        )
        samples = samples.append_column(
            SAMPLE_PARTITION_SCHEMA.field("agent"), pa.repeat(pa.scalar(agent, pa.string()), n)
        )
        samples = samples.append_column(
            SAMPLE_PARTITION_SCHEMA.field("iteration"),
            pa.repeat(pa.scalar(iteration, pa.int64()), n),
        )
        names = list(columns) if columns is not None else SAMPLE_READ_SCHEMA.names
        return samples.select(names)

    def ready(
        self,
        agent: str,
        iteration: int,
        need: Iterable[str] = ("reward",),
        unconsumed: bool = True,
        mb: int | None = None,
        policy_version: int | None = None,
        columns: Sequence[str] | None = None,
    ) -> pa.Table:
        """Samples ready for training: every field in ``need`` set, not consumed yet.

        ``need`` names status fields (``reward``, ``advantage``); ``unconsumed`` drops rows
        with a ``consumed_step``; ``policy_version`` keeps only rows made by those weights
        (the on-policy check); ``mb`` reads one micro-batch.
        """
        need = list(need)
        valid = [f for f in STATUS_FIELDS if f != "consumed_step"]
        bad = [f for f in need if f not in valid]
        if bad:
            raise ValueError(f"unknown ready field(s) {bad}; valid: {valid}")
        cols = None
        if columns is not None:
            extra = [*need, "consumed_step", "policy_version"]
            cols = list(dict.fromkeys([*columns, *extra]))
        table = self.read_samples(agent, iteration, mb=mb, columns=cols)
        mask = None
        conds = [pc.is_valid(table.column(f)) for f in need]
        if unconsumed:
            conds.append(pc.is_null(table.column("consumed_step")))
        if policy_version is not None:
            conds.append(pc.equal(table.column("policy_version"), policy_version))
        for c in conds:
            mask = c if mask is None else pc.and_(mask, c)
        if mask is not None:
            table = table.filter(mask)
        return table if columns is None else table.select(list(columns))

    def read_inputs(self, iteration: int | None = None, split: str | None = None) -> pa.Table:
        """Inputs of one iteration (or all), one row per input_id (latest write wins)."""
        its = self.iterations(None) if iteration is None else [validate_iteration(iteration)]
        parts = []
        for it in its:
            for _ in range(_MAX_READ_ATTEMPTS):
                try:
                    t = self._read_all(
                        self._fragments(self._inputs_dir(it), None), INPUT_FILE_SCHEMA
                    )
                    break
                except _Vanished:
                    continue
            else:
                where = self.display(self._inputs_dir(it))
                raise StoreError(f"{where} kept changing while being read", where)
            t = latest(t)
            if split is not None:
                t = t.filter(pc.equal(t.column("split"), split))
            t = t.take(pc.sort_indices(t, sort_keys=[("input_id", "ascending")]))
            t = t.append_column(
                INPUT_PARTITION_SCHEMA.field("iteration"),
                pa.repeat(pa.scalar(it, pa.int64()), t.num_rows),
            )
            parts.append(t)
        if not parts:
            return INPUT_READ_SCHEMA.empty_table()
        return pa.concat_tables(parts).select(INPUT_READ_SCHEMA.names)

    def dataset(self, kind: str = "samples") -> ds.Dataset:
        """A raw ``pyarrow.dataset`` over one table kind with typed partitions.

        Raw means as stored: before compaction a retried write may appear twice and status
        is not folded in. Use ``read_samples`` for the deduplicated, folded view.
        """
        file_schema = {
            "samples": SAMPLE_FILE_SCHEMA,
            "status": STATUS_FILE_SCHEMA,
            "inputs": INPUT_FILE_SCHEMA,
        }[kind]
        part = partitioning(kind)
        schema = pa.schema(list(file_schema) + list(part.schema))
        base = f"{self.root}/{kind}"
        if self.fs.get_file_info(base).type != pafs.FileType.Directory:
            return ds.FileSystemDataset.from_paths(
                [], schema=schema, format=ds.ParquetFileFormat(), filesystem=self.fs
            )
        return ds.dataset(
            base, schema=schema, format="parquet", filesystem=self.fs, partitioning=part
        )


def _check_schema(got: pa.Schema, want: pa.Schema, shown: str) -> None:
    """Raise StoreError naming the file unless ``got`` is ``want`` up to missing nullables."""
    issues = []
    for field in want:
        i = got.get_field_index(field.name)
        if i < 0:
            if not field.nullable:
                issues.append(f"missing required column {field.name!r}")
        elif not got.field(i).type.equals(field.type):
            issues.append(f"column {field.name!r} is {got.field(i).type}, expected {field.type}")
    extra = [n for n in got.names if n not in want.names]
    if extra:
        issues.append(f"unexpected column(s) {extra}")
    if issues:
        raise StoreError(
            f"store fragment {shown} does not match the store schema (foreign file?): "
            + "; ".join(issues),
            shown,
            "schema",
        )
