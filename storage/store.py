"""The MEG Store: per-agent sample tables, status logs and the inputs table as Parquet fragments.

See the package docstring (``storage/__init__.py``) for the layout on disk and the rules
(atomic commits, idempotency, status folding, compaction).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .errors import Problem, StoreError
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

__all__ = ["MEGStore", "Rows", "open_filesystem"]

#: Rows to write: a list of dicts (one per row) or an Arrow table.
Rows = Sequence[Mapping[str, Any]] | pa.Table

MARKER = "_meg_store.json"
FORMAT_VERSION = 1
STAGING = "_staging"
_KEY = ["sample_id", "policy_version"]
# Fragment names: "mb000003-<key>.parquet" holds one micro-batch, "all-<key>.parquet" any
# (compaction output, or status rows without mb). Readers of one micro-batch open only the
# files whose tag matches or is not an mb tag, so they never parse the rest of the partition.
_MB_NAME = re.compile(r"mb(\d{6,})-[0-9a-f]+\.parquet")
_MAX_READ_ATTEMPTS = 8
_STREAM_BYTES = 16 << 20  # fragments bigger than this (in memory) stream to disk


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


def open_filesystem(
    uri: str, filesystem: pafs.FileSystem | None = None, **fs_kwargs: Any
) -> tuple[pafs.FileSystem, str, str]:
    """Resolve ``uri`` to ``(filesystem, root path inside it, display prefix)``.

    ``uri`` is a local path, ``file:///abs/path``, or ``s3://bucket/prefix`` (``gs://`` too).
    For S3, ``fs_kwargs`` go to ``pyarrow.fs.S3FileSystem`` (``endpoint_override``,
    ``scheme``, ``access_key``, ``secret_key``, ``region``...); without them pyarrow reads
    the URI query (``?endpoint_override=host:port&scheme=http``) and the ``AWS_*`` env vars.
    """
    if filesystem is not None:
        if fs_kwargs:
            raise ValueError("pass either filesystem= or filesystem keyword arguments, not both")
        return filesystem, uri.rstrip("/"), ""
    if "://" not in uri:
        if fs_kwargs:
            raise ValueError(f"filesystem keyword arguments {sorted(fs_kwargs)} need an s3:// URI")
        return pafs.LocalFileSystem(), os.path.abspath(uri), ""
    scheme = uri.split("://", 1)[0].lower()
    if scheme == "s3" and fs_kwargs:
        path = uri.split("://", 1)[1].split("?", 1)[0].strip("/")
        return pafs.S3FileSystem(**fs_kwargs), path, "s3://"
    if fs_kwargs:
        raise ValueError(f"filesystem keyword arguments are only supported for s3://, got {uri!r}")
    fs, path = pafs.FileSystem.from_uri(uri)
    prefix = "" if isinstance(fs, pafs.LocalFileSystem) else f"{scheme}://"
    return fs, path.rstrip("/"), prefix


def _now() -> datetime:
    return datetime.now(UTC)


def _content_key(kind: str, table: pa.Table, key_cols: Sequence[str], extra: str = "") -> str:
    """Deterministic fragment key: the same rows (by key) written again get the same name."""
    cols = [table.column(c).to_pylist() for c in key_cols]
    keys = sorted("\x1f".join(map(str, k)) for k in zip(*cols, strict=True))
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{kind}\x1e{extra}\x1e".encode())
    h.update("\x1e".join(keys).encode())
    return h.hexdigest()


def _row_keys(table: pa.Table) -> pa.Array:
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


def _latest(table: pa.Table) -> pa.Table:
    """Keep one row per key (see ``_row_keys``): the latest ``created_at`` wins."""
    if table.num_rows <= 1:
        return table
    keys = _row_keys(table)
    distinct = pc.unique(keys)
    if len(distinct) == table.num_rows:
        return table  # common case: no duplicates; keep the order and skip the sort
    order = _newest_first(table)
    first = pc.index_in(distinct, value_set=keys.take(order))
    return table.take(order.take(first))


def _fold_status(samples: pa.Table, log: pa.Table) -> pa.Table:
    """Set each status field of each sample to its latest non-null value in ``log``."""
    if log.num_rows == 0 or samples.num_rows == 0:
        return samples
    order = _newest_first(log)
    log = log.take(order)
    log_keys = _row_keys(log)
    sample_keys = _row_keys(samples)
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


def _newest_write(table: pa.Table, log: pa.Table) -> pa.Array:
    """Per row of ``table``: the latest created_at among its entries in ``log`` (or null)."""
    order = _newest_first(log)
    idx = pc.index_in(_row_keys(table), value_set=_row_keys(log).take(order))
    return log.column("created_at").take(order).take(idx)


def _status_log(samples: pa.Table, status: pa.Table) -> pa.Table:
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


class MEGStore:
    """Per-agent sample tables, status logs and inputs on any ``pyarrow.fs`` filesystem.

    >>> store = MEGStore("/tmp/run1/store")                             # doctest: +SKIP
    >>> store.write_samples("solver", 0, rows)                          # doctest: +SKIP
    >>> store.write_status("solver", 0, [{"sample_id": ..., "policy_version": 0,
    ...                                   "mb": 0, "reward": 1.0}])     # doctest: +SKIP
    >>> batch = store.ready("solver", 0, mb=0)                          # doctest: +SKIP

    Thread/process safety: any number of processes may write and read one store at once;
    each write is one or more whole fragments made visible atomically.

    Args:
        uri: local path, ``file://`` URI or ``s3://bucket/prefix``.
        filesystem: an existing ``pyarrow.fs.FileSystem``; then ``uri`` is a path inside it.
        create: write the store marker if missing; if False a missing marker is an error.
        fsync: local disk only; fsync each fragment and its directory before the rename, so
            a committed fragment survives a power loss (a crashed *process* never needs it).
        compression: Parquet codec of new fragments.
        fs_kwargs: passed to ``pyarrow.fs.S3FileSystem`` for ``s3://`` URIs.
    """

    def __init__(
        self,
        uri: str,
        *,
        filesystem: pafs.FileSystem | None = None,
        create: bool = True,
        fsync: bool = False,
        compression: str = "snappy",
        **fs_kwargs: Any,
    ) -> None:
        self.fs, self.root, self._prefix = open_filesystem(uri, filesystem, **fs_kwargs)
        self.uri = uri
        self.fsync = fsync
        self.compression = compression
        if isinstance(self.fs, pafs.LocalFileSystem):
            self._commit_mode = "rename"
        elif self.fs.type_name in ("s3", "gcs"):
            self._commit_mode = "put"
        else:
            raise ValueError(
                f"unsupported filesystem {self.fs.type_name!r} for {uri!r}: the store needs "
                "either an atomic replacing rename (local disk) or atomic whole-object PUTs "
                "(s3, gcs)"
            )
        self._known_dirs: set[str] = set()
        marker = f"{self.root}/{MARKER}"
        if self.fs.get_file_info(marker).type != pafs.FileType.File:
            if not create:
                raise StoreError(
                    f"no MEG store at {self.display(self.root)} (no {MARKER})",
                    self.display(self.root),
                    "missing",
                )
            body = json.dumps({"format_version": FORMAT_VERSION, "kind": "flexmarl MEG store"})
            try:
                self._put_bytes(self.root, MARKER, body.encode())
            except OSError as e:
                raise StoreError(
                    f"cannot create a MEG store at {self.display(self.root)}: {_os_reason(e)}",
                    self.display(self.root),
                    "unwritable",
                ) from e

    def __repr__(self) -> str:
        return f"MEGStore({self.display(self.root)!r})"

    # ------------------------------------------------------------------ paths and listing

    def display(self, path: str) -> str:
        """A path as users know it (``s3://bucket/key`` for S3, the plain path on disk)."""
        return self._prefix + path

    def _samples_dir(self, agent: str, iteration: int) -> str:
        return f"{self.root}/samples/agent={agent}/iteration={iteration}"

    def _status_dir(self, agent: str, iteration: int) -> str:
        return f"{self.root}/status/agent={agent}/iteration={iteration}"

    def _inputs_dir(self, iteration: int) -> str:
        return f"{self.root}/inputs/iteration={iteration}"

    def _list(self, directory: str, dirs: bool = False) -> list[str]:
        """Names of the files (or subdirectories) of ``directory``; none if it is missing."""
        if self._commit_mode == "rename":
            # os.listdir is ~5x faster than a FileSelector on a few hundred entries, and this
            # runs on every micro-batch read. File listings are filtered by name afterwards
            # (a directory named like a fragment fails loudly when read).
            try:
                if not dirs:
                    return os.listdir(directory)
                with os.scandir(directory) as it:
                    return [e.name for e in it if e.is_dir()]
            except FileNotFoundError:
                return []
        want = pafs.FileType.Directory if dirs else pafs.FileType.File
        infos = self.fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
        return [i.base_name for i in infos if i.type == want]

    def _fragments(self, directory: str, mb: int | None) -> list[str]:
        names = [n for n in self._list(directory) if n.endswith(".parquet") and n[0] not in "_."]
        if mb is not None:
            tag = f"mb{mb:06d}-"
            names = [
                n
                for n in names
                if n.startswith(tag) or not n.startswith("mb") or not _MB_NAME.fullmatch(n)
            ]
        # mb-tagged rollout fragments first, compaction output last: on equal created_at the
        # later row wins, and compacted rows are the more complete ones.
        names.sort(key=lambda n: (not n.startswith("mb"), n))
        return [f"{directory}/{n}" for n in names]

    def agents(self) -> list[str]:
        """Agents that have a sample table."""
        names = self._list(f"{self.root}/samples", dirs=True)
        return sorted(n[6:] for n in names if n.startswith("agent="))

    def iterations(self, agent: str | None = None) -> list[int]:
        """Iterations present for ``agent``'s samples, or in ``inputs`` when agent is None."""
        base = (
            f"{self.root}/inputs"
            if agent is None
            else f"{self.root}/samples/agent={validate_agent(agent)}"
        )
        out = []
        for n in self._list(base, dirs=True):
            if n.startswith("iteration=") and n[10:].isdigit():
                out.append(int(n[10:]))
        return sorted(out)

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

    # ------------------------------------------------------------------ commit

    def _ensure_dir(self, directory: str) -> None:
        if directory not in self._known_dirs:
            self.fs.create_dir(directory, recursive=True)
            self._known_dirs.add(directory)

    def _commit(self, table: pa.Table, directory: str, name: str) -> str:
        """Make ``directory/name`` hold exactly ``table``, atomically. Returns the path.

        Local disk: write a uniquely named temp file under ``_staging/`` and rename it into
        place; rename(2) is atomic and replaces an existing file, so readers see the old or the
        new fragment, never a partial one, and a retried write simply replaces its own file.
        A writer killed mid-write leaves only a temp file in ``_staging/``, which readers never
        look at (``check_store`` reports it once it is stale). Small fragments are encoded in
        memory and written with one syscall (~2x faster than many small writes); big ones
        stream into the temp file to bound memory.

        Object stores (S3, GCS) have no atomic rename, but an object becomes visible only when
        its upload completes (single PUT, or a multipart upload completed at close), and a PUT
        atomically replaces an object of the same key. So the fragment is serialised in memory
        first (an error while encoding can then never publish a partial object) and written
        straight to its final key.
        """
        path = f"{directory}/{name}"
        try:
            return self._commit_fragment(table, directory, path)
        except OSError as e:
            # A read-only or full disk, a permission error, a file size limit: name the
            # fragment (its partition) instead of the temp file; nothing was published.
            raise StoreError(
                f"cannot write store fragment {self.display(path)}: {_os_reason(e)}; nothing "
                "of this write is visible to readers",
                self.display(path),
                "unwritable",
            ) from e

    def _commit_fragment(self, table: pa.Table, directory: str, path: str) -> str:
        name = path.rsplit("/", 1)[1]
        opts = {
            "compression": self.compression,
            # Token ids are near-random: dictionary pages cost time and save nothing there.
            "use_dictionary": ["input_id", "prompt_text", "sample_id"],
            "write_statistics": ["mb", "policy_version", "traj"],
            "row_group_size": 8192,
        }
        data = None
        if self._commit_mode == "put" or table.nbytes <= _STREAM_BYTES:
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink, **opts)
            data = sink.getvalue()
        if self._commit_mode == "put":
            self._put_bytes(directory, name, data)
            return path
        staging = f"{self.root}/{STAGING}"
        self._ensure_dir(staging)
        self._ensure_dir(directory)
        tmp = f"{staging}/{uuid.uuid4().hex}.{name}.tmp"
        try:
            with open(tmp, "wb") as f:
                if data is not None:
                    f.write(data)
                else:
                    pq.write_table(table, f, **opts)
            if self.fsync:
                _fsync_path(tmp)
            try:
                os.replace(tmp, path)
            except FileNotFoundError:
                # The partition directory vanished (deleted by hand); recreate it once.
                self._known_dirs.discard(directory)
                self._ensure_dir(directory)
                os.replace(tmp, path)
            if self.fsync:
                _fsync_path(directory)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:  # never created, or undeletable: keep the original error
                pass
            raise
        return path

    def _put_bytes(self, directory: str, name: str, data: bytes | pa.Buffer) -> None:
        path = f"{directory}/{name}"
        if self._commit_mode == "rename":
            self._ensure_dir(directory)
            staging = f"{self.root}/{STAGING}"
            self._ensure_dir(staging)
            tmp = f"{staging}/{uuid.uuid4().hex}.{name}.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:  # never created: keep the original error
                    pass
                raise
            return
        # One write then close: the object appears only when close() completes the upload.
        out = self.fs.open_output_stream(path)
        out.write(data)
        out.close()

    # ------------------------------------------------------------------ reading fragments

    def _read_fragment(
        self, path: str, schema: pa.Schema, columns: Sequence[str] | None = None
    ) -> pa.Table:
        """Read one fragment, checked against ``schema``; errors name the file."""
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
            tables = [self._read_fragment(p, schema, columns) for p in paths]
        else:
            tables = list(
                _reader_pool().map(lambda p: self._read_fragment(p, schema, columns), paths)
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

    # ------------------------------------------------------------------ samples

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
            name = f"{tag}-{_content_key(kind, part, _KEY, extra)}.parquet"
            paths.append(self._commit(part, directory, name))
        return [self.display(p) for p in paths]

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
        sort_cols = ["mb", "input_id", "traj", "turn", "policy_version"]
        want_status = columns is None or any(c in STATUS_FIELDS for c in columns)
        if columns is None:
            file_cols = None
        else:
            need = set(columns) | set(sort_cols) | {"sample_id", "created_at"}
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
            log = _status_log(samples, status)
            samples = _latest(samples)
            samples = _fold_status(samples, log)
        else:
            samples = _latest(samples)
        n = samples.num_rows
        samples = samples.take(
            pc.sort_indices(samples, sort_keys=[(c, "ascending") for c in sort_cols])
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

    # ------------------------------------------------------------------ status

    def write_status(self, agent: str, iteration: int, rows: Rows) -> list[str]:
        """Append status changes; returns the fragment paths (one per micro-batch).

        Each row names a sample (``sample_id``, ``policy_version``; give ``mb`` too so that
        micro-batch reads find it cheaply) and sets one or more of ``reward``, ``advantage``,
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
        for c in _KEY:
            if table.column(c).null_count:
                raise ValueError(f"status rows need a non-null {c!r}")
        _reject_duplicates(table, "status")
        return self._write_by_mb(
            "status", self._status_dir(agent, iteration), table, ",".join(set_fields)
        )

    def mark_consumed(self, agent: str, iteration: int, samples: Rows, step: int) -> list[str]:
        """Record that optimizer step ``step`` trained on ``samples`` (rows or a table)."""
        table = samples if isinstance(samples, pa.Table) else pa.Table.from_pylist(list(samples))
        cols = ["sample_id", "policy_version"] + (["mb"] if "mb" in table.column_names else [])
        table = table.select(cols)
        table = table.append_column(
            "consumed_step", pa.repeat(pa.scalar(step, pa.int64()), table.num_rows)
        )
        return self.write_status(agent, iteration, table)

    # ------------------------------------------------------------------ inputs

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
            t = _latest(t)
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

    # ------------------------------------------------------------------ maintenance

    def compact(self, agent: str, iteration: int) -> str | None:
        """Fold one (agent, iteration) partition into a single sample fragment.

        Reads every sample and status fragment, deduplicates, folds the status into the sample
        rows, writes the result as one fragment, then deletes the old sample fragments and
        then the old status fragments (status rows of unknown samples are kept in one status
        fragment). Readers running meanwhile see old and new rows together and deduplicate
        them, so they never lose or double-count a sample. New writes that land during
        compaction keep their own fragments; a retry that *replaces* a fragment being compacted
        is folded in with its earlier content (same keys, normally the same values). Run it
        once an iteration's partition is quiet. Returns the new fragment path, or None when
        the partition is empty or already compact.
        """
        agent = validate_agent(agent)
        iteration = validate_iteration(iteration)
        sdir, tdir = self._samples_dir(agent, iteration), self._status_dir(agent, iteration)
        status_paths = self._fragments(tdir, None)
        sample_paths = self._fragments(sdir, None)
        if not sample_paths:
            return None
        if len(sample_paths) == 1:
            # Compact already if the only status left is this compaction's orphan fragment.
            own = sample_paths[0].rsplit("/", 1)[1]
            if own.startswith("all-") and all(p == f"{tdir}/{own}" for p in status_paths):
                return None
        # Deleted files only come from a concurrent compaction; let it win.
        try:
            status = self._read_all(status_paths, STATUS_FILE_SCHEMA)
            samples = self._read_all(sample_paths, SAMPLE_FILE_SCHEMA)
        except _Vanished:
            return None
        log = _status_log(samples, status)
        # A compacted row's created_at is the time of the latest write folded into it, so it
        # outranks every status entry it absorbed if a stale copy of one is still around.
        folded = _fold_status(_latest(samples), log)
        ts = SAMPLE_FILE_SCHEMA.field("created_at").type
        created = pc.max_element_wise(  # no timestamp kernel: compare as int64 microseconds
            folded.column("created_at").cast(pa.int64()),
            _newest_write(folded, log).cast(pa.int64()),
            skip_nulls=True,
        ).cast(ts)
        folded = folded.set_column(
            folded.schema.get_field_index("created_at"),
            SAMPLE_FILE_SCHEMA.field("created_at"),
            created,
        )
        folded = folded.take(
            pc.sort_indices(
                folded,
                sort_keys=[
                    (c, "ascending") for c in ("mb", "input_id", "traj", "turn", "policy_version")
                ],
            )
        )
        sources = [p.rsplit("/", 1)[1] for p in sample_paths + status_paths]
        key = hashlib.blake2b("\n".join(sorted(sources)).encode(), digest_size=12).hexdigest()
        new_path = self._commit(folded, sdir, f"all-{key}.parquet")
        orphans = status.filter(pc.invert(pc.is_in(_row_keys(status), value_set=_row_keys(folded))))
        new_status = None
        if orphans.num_rows:
            new_status = self._commit(orphans, tdir, f"all-{key}.parquet")
        for p in sample_paths:
            if p != new_path:
                self._delete(p)
        for p in status_paths:
            if p != new_status:
                self._delete(p)
        return self.display(new_path)

    def _delete(self, path: str) -> None:
        try:
            self.fs.delete_file(path)
        except FileNotFoundError:
            pass

    def clean_staging(self, older_than_s: float = 3600.0) -> list[str]:
        """Delete temp files of writers that died mid-write; returns what was deleted.

        Only files older than ``older_than_s`` are touched, so running writers are safe.
        Object stores have no staging files (incomplete uploads are invisible; expire them
        with a bucket lifecycle rule).
        """
        staging = f"{self.root}/{STAGING}"
        infos = self.fs.get_file_info(pafs.FileSelector(staging, allow_not_found=True))
        cutoff = time.time() - older_than_s
        removed = []
        for info in infos:
            if (
                info.type == pafs.FileType.File
                and info.mtime is not None
                and info.mtime.timestamp() <= cutoff
            ):
                self._delete(info.path)
                removed.append(self.display(info.path))
        return removed

    def audit(
        self, agent: str, iteration: int, expected: int | Iterable[str] | None = None
    ) -> list[Problem]:
        """Exactly-once check of one partition.

        Reports raw duplicate (sample_id, policy_version) rows (warning: readers deduplicate,
        compaction removes them), sample_ids present under several policy versions (warning),
        malformed sample_ids, status rows for unknown samples (warning), and, with
        ``expected`` (a row count or the expected sample_ids), missing or unexpected samples.
        """
        agent = validate_agent(agent)
        iteration = validate_iteration(iteration)
        where = self.display(self._samples_dir(agent, iteration))
        samples, status = self._read_partition_raw(agent, iteration, None, None)
        problems: list[Problem] = []
        counts = samples.group_by(_KEY).aggregate([("sample_id", "count")])
        dups = counts.filter(pc.greater(counts.column("sample_id_count"), 1))
        if dups.num_rows:
            ex = dups.column("sample_id").to_pylist()[:5]
            problems.append(
                Problem(
                    "duplicate",
                    where,
                    f"{dups.num_rows} (sample_id, policy_version) keys stored more than once "
                    f"(readers keep the latest; compact to clean up), e.g. {ex}",
                    "warning",
                )
            )
        unique = counts.select(_KEY)
        per_id = unique.group_by("sample_id").aggregate([("policy_version", "count_distinct")])
        multi = per_id.filter(pc.greater(per_id.column("policy_version_count_distinct"), 1))
        if multi.num_rows:
            problems.append(
                Problem(
                    "multi_version",
                    where,
                    f"{multi.num_rows} sample_ids exist under several policy versions, e.g. "
                    f"{multi.column('sample_id').to_pylist()[:5]}",
                    "warning",
                )
            )
        if samples.num_rows:
            bad = samples.filter(
                pc.invert(pc.equal(samples.column("sample_id"), _expected_ids(samples, agent)))
            )
            if bad.num_rows:
                problems.append(
                    Problem(
                        "bad_sample_id",
                        where,
                        f"{bad.num_rows} sample_ids differ from '{{input_id}}:{{traj}}:{agent}:"
                        f"{{turn}}', e.g. {bad.column('sample_id').to_pylist()[:3]}",
                    )
                )
        if status.num_rows:
            orphan = status.filter(
                pc.invert(pc.is_in(_row_keys(status), value_set=_row_keys(samples)))
            )
            if orphan.num_rows:
                problems.append(
                    Problem(
                        "orphan_status",
                        self.display(self._status_dir(agent, iteration)),
                        f"{orphan.num_rows} status rows name samples that are not stored, e.g. "
                        f"{orphan.column('sample_id').to_pylist()[:3]}",
                        "warning",
                    )
                )
        if isinstance(expected, int):
            if unique.num_rows != expected:
                problems.append(
                    Problem("count", where, f"expected {expected} samples, found {unique.num_rows}")
                )
        elif expected is not None:
            want = set(expected)
            have = set(unique.column("sample_id").to_pylist())
            missing, extra = sorted(want - have), sorted(have - want)
            if missing:
                problems.append(
                    Problem(
                        "missing",
                        where,
                        f"{len(missing)} expected samples missing, e.g. {missing[:5]}",
                    )
                )
            if extra:
                problems.append(
                    Problem(
                        "unexpected", where, f"{len(extra)} samples not expected, e.g. {extra[:5]}"
                    )
                )
        return problems


# ---------------------------------------------------------------------- helpers


def _os_reason(e: OSError) -> str:
    """``Permission denied`` / ``No space left on device`` / ... (pyarrow's text otherwise)."""
    if e.errno and e.strerror and not str(e.strerror).startswith("Cannot"):
        return f"{e.strerror} [errno {e.errno}]"
    return str(e)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    created = pa.repeat(pa.scalar(_now(), created_at.type), table.num_rows)
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
    keys = _row_keys(table)
    if len(pc.unique(keys)) != len(keys):
        counts = pc.value_counts(keys)
        dup = counts.filter(pc.greater(counts.field("counts"), 1))[0]["values"].as_py()
        raise ValueError(
            f"{kind} rows name (sample_id, policy_version) {tuple(dup.split(chr(31)))} more "
            "than once in one write; check traj/turn (every trajectory and turn needs its own)"
        )


def _expected_ids(table: pa.Table, agent: str) -> pa.Array:
    return pc.binary_join_element_wise(
        table.column("input_id"),
        pc.cast(table.column("traj"), pa.string()),
        pa.scalar(agent),
        pc.cast(table.column("turn"), pa.string()),
        ":",
    )


def _check_samples(table: pa.Table, agent: str) -> pa.Table:
    """Fill in missing sample_ids, reject wrong ones and mismatched logprobs."""
    expected = _expected_ids(table, agent)
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
