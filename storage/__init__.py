"""MEG Store: the data hub of flexmarl, as Parquet fragments on any ``pyarrow.fs`` filesystem.

Knows Arrow and filesystems, nothing about models (never imports torch, prefect or
``flexmarl_core``).

Layout of a store at ``ROOT`` (a local directory, or ``s3://bucket/prefix``)::

    ROOT/
      _meg_store.json                                   marker + format version
      _staging/<uuid>.<name>.tmp                        local writes in progress (never read)
      inputs/iteration=<k>/part-<key>.parquet           INPUT_FILE_SCHEMA
      samples/agent=<a>/iteration=<k>/mb<NNNNNN>-<key>.parquet   SAMPLE_FILE_SCHEMA, one mb
      samples/agent=<a>/iteration=<k>/all-<key>.parquet          compaction output, all mbs
      status/agent=<a>/iteration=<k>/mb<NNNNNN>-<key>.parquet    STATUS_FILE_SCHEMA (appends)

* ``agent`` (string) and ``iteration`` (int64) live only in the directory names (hive
  partitioning); ``SAMPLE_PARTITION_SCHEMA`` types them so an agent named ``"7"`` stays a
  string. Names starting with ``_`` or ``.`` are ignored by readers, pyarrow and DuckDB.
* ``<key>`` is a hash of the (sample_id, policy_version) set of the write (plus the status
  fields it sets), so a retried write replaces its own fragment instead of adding one; readers
  also deduplicate by (sample_id, policy_version), latest ``created_at`` (the writer's clock)
  wins.
* A commit is atomic: staged + renamed on local disk, one whole-object PUT on S3/GCS
  (see :mod:`storage.commit`). A killed writer leaves at most a ``_staging`` temp file.
* Rewards, advantages and "consumed by step k" arrive later as ``status`` appends; readers
  fold the latest non-null value of each field into the sample rows; ``compact`` folds a
  partition into one ``all-`` fragment.

Reading a store from other tools (raw rows: possible duplicates before compaction, status
not folded; pass the agent type, DuckDB infers ``agent=7`` as a number otherwise)::

    duckdb: SELECT agent, iteration, count(*) FROM read_parquet('ROOT/samples/**/*.parquet',
            hive_partitioning=true, hive_types={'agent': VARCHAR, 'iteration': BIGINT})
            GROUP BY ALL
    pyarrow: MEGStore(ROOT).dataset("samples")  or  pyarrow.dataset.dataset(ROOT + "/samples",
             partitioning=storage.partitioning("samples"))

API: :class:`MEGStore` (write_samples / write_status / mark_consumed / write_inputs,
read_samples / ready / read_inputs, compact, audit, clean_staging; agents / iterations /
partitions, dataset, read_fragment for tools), :func:`check_store`, :func:`audit_store`.
The class is assembled in ``storage/store.py`` from one module per concern (fs, commit,
write, read and fold, compact, audit).
"""

from .api import Store
from .check import audit_store, check_store, main
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
)
from .store import MEGStore, Rows, open_filesystem

__all__ = [
    "INPUT_FILE_SCHEMA",
    "INPUT_PARTITION_SCHEMA",
    "INPUT_READ_SCHEMA",
    "SAMPLE_FILE_SCHEMA",
    "SAMPLE_PARTITION_SCHEMA",
    "SAMPLE_READ_SCHEMA",
    "STATUS_FIELDS",
    "STATUS_FILE_SCHEMA",
    "MEGStore",
    "Store",
    "Problem",
    "Rows",
    "StoreError",
    "audit_store",
    "check_store",
    "main",
    "open_filesystem",
    "partitioning",
    "validate_agent",
]
