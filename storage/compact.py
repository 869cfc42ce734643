"""Compaction of the MEG Store: fold one partition's fragments and status into one fragment."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.compute as pc

from .commit import Committer
from .fold import fold_status, latest, newest_write, row_keys, status_log
from .read import SORT_KEYS, Reader, _Vanished
from .schema import SAMPLE_FILE_SCHEMA, STATUS_FILE_SCHEMA, validate_agent, validate_iteration

__all__ = ["Compactor"]


class Compactor(Reader, Committer):
    """Compacting partitions."""

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
        log = status_log(samples, status)
        # A compacted row's created_at is the time of the latest write folded into it, so it
        # outranks every status entry it absorbed if a stale copy of one is still around.
        folded = fold_status(latest(samples), log)
        ts = SAMPLE_FILE_SCHEMA.field("created_at").type
        created = pc.max_element_wise(  # no timestamp kernel: compare as int64 microseconds
            folded.column("created_at").cast(pa.int64()),
            newest_write(folded, log).cast(pa.int64()),
            skip_nulls=True,
        ).cast(ts)
        folded = folded.set_column(
            folded.schema.get_field_index("created_at"),
            SAMPLE_FILE_SCHEMA.field("created_at"),
            created,
        )
        folded = folded.take(
            pc.sort_indices(folded, sort_keys=[(c, "ascending") for c in SORT_KEYS])
        )
        sources = [p.rsplit("/", 1)[1] for p in sample_paths + status_paths]
        key = hashlib.blake2b("\n".join(sorted(sources)).encode(), digest_size=12).hexdigest()
        new_path = self._commit(folded, sdir, f"all-{key}.parquet")
        orphans = status.filter(pc.invert(pc.is_in(row_keys(status), value_set=row_keys(folded))))
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
