"""Exactly-once audit of one MEG Store partition (``audit_store`` in :mod:`storage.check`
runs it over a whole store)."""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc

from .errors import Problem
from .fold import KEY, row_keys
from .read import Reader
from .schema import derive_sample_ids, validate_agent, validate_iteration

__all__ = ["LOST_NAMED", "Auditor"]

#: lost sample_ids a ``lost`` finding names (the rest are counted)
LOST_NAMED = 40


class Auditor(Reader):
    """Auditing partitions."""

    def audit(
        self,
        agent: str,
        iteration: int,
        expected: int | Iterable[str] | None = None,
        lost: Iterable[str] = (),
    ) -> list[Problem]:
        """Exactly-once check of one partition.

        Reports raw duplicate (sample_id, policy_version) rows (warning: readers deduplicate,
        compaction removes them), sample_ids present under several policy versions (warning),
        malformed sample_ids, status rows for unknown samples (warning), and, with
        ``expected`` (a row count or the expected sample_ids), missing or unexpected samples.
        ``lost``: sample_ids recorded as lost to damage after they were trained on (a repair
        set their fragment aside): missing, they are one ``lost`` finding (a warning) naming
        them, and status rows naming them are no orphans.
        """
        gone = set(lost)
        agent = validate_agent(agent)
        iteration = validate_iteration(iteration)
        where = self.display(self._samples_dir(agent, iteration))
        samples, status = self._read_partition_raw(agent, iteration, None, None)
        problems: list[Problem] = []
        counts = samples.group_by(KEY).aggregate([("sample_id", "count")])
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
        unique = counts.select(KEY)
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
                pc.invert(pc.equal(samples.column("sample_id"), derive_sample_ids(samples, agent)))
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
                pc.invert(pc.is_in(row_keys(status), value_set=row_keys(samples)))
            )
            if gone and orphan.num_rows:
                orphan = orphan.filter(
                    pc.invert(pc.is_in(orphan.column("sample_id"), value_set=pa.array(sorted(gone), pa.string())))
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
            missing, extra = sorted(want - have - gone), sorted(have - want)
            lost_here = sorted((want & gone) - have)
            if lost_here:
                shown = ", ".join(lost_here[:LOST_NAMED])
                more = f" and {len(lost_here) - LOST_NAMED} more" if len(lost_here) > LOST_NAMED else ""
                problems.append(
                    Problem(
                        "lost",
                        where,
                        f"{len(lost_here)} samples lost to damage, trained before it: {shown}{more}",
                        "warning",
                    )
                )
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
