"""``check_store``: find what is wrong in a MEG Store, and the ``store check`` command line.

Usage (the ``flexmarl store check`` CLI calls :func:`main`)::

    python -m storage check PATH_OR_URI [--stale-after SECONDS] [--strict]

Exit status: 0 when no errors were found (warnings are printed), 1 when there are errors (or
warnings with ``--strict``), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow.compute as pc
import pyarrow.fs as pafs

from .errors import Problem, StoreError
from .fs import ITERATION_DIR, MARKER, MB_NAME, STAGING, open_filesystem
from .schema import (
    AGENT_NAME_RE,
    INPUT_FILE_SCHEMA,
    SAMPLE_FILE_SCHEMA,
    STATUS_FILE_SCHEMA,
)
from .store import MEGStore

__all__ = ["EXACTLY_ONCE", "QUARANTINE", "audit_store", "check_store", "main"]

#: where ``flexmarl store repair`` sets damaged fragments aside, under the store's root: no
#: reader lists it, and the check passes over it (the run's audit reports what was lost)
QUARANTINE = "_quarantine"

_SAMPLE_NAME = re.compile(r"(mb\d{6,}|all)-[0-9a-f]+\.parquet")
_INPUT_NAME = re.compile(r"part-[0-9a-f]+\.parquet")


def check_store(
    uri: str,
    *,
    stale_after_s: float = 3600.0,
    deep: bool = True,
    filesystem: pafs.FileSystem | None = None,
    **fs_kwargs: Any,
) -> list[Problem]:
    """Check a store and return its problems (empty list: all good).

    Finds: a missing store or marker; files or directories that do not belong to the layout
    (a ``.parquet`` file outside a partition is an error, since DuckDB globs would read it);
    bad agent or iteration directory names; fragments that are unreadable, truncated, or of a
    foreign schema; fragments whose micro-batch tag disagrees with their rows; staging files
    older than ``stale_after_s`` (left by killed writers); and per partition what
    ``MEGStore.audit`` reports (duplicates, malformed sample_ids, orphan status rows).
    ``deep=False`` only reads footers instead of whole fragments (faster, misses damaged
    pages).
    """
    fs, root, prefix = open_filesystem(uri, filesystem, **fs_kwargs)

    def shown(path: str) -> str:
        return prefix + path

    info = fs.get_file_info(root)
    if info.type != pafs.FileType.Directory:
        # Object stores have no directories: a prefix "exists" once it has a key under it.
        if fs.get_file_info(f"{root}/{MARKER}").type != pafs.FileType.File:
            return [Problem("missing", shown(root), "no MEG store here (no such directory)")]
    problems: list[Problem] = []
    if fs.get_file_info(f"{root}/{MARKER}").type != pafs.FileType.File:
        problems.append(
            Problem("not_a_store", shown(root), f"no {MARKER}: not a MEG store (wrong path?)")
        )
        return problems
    store = (
        MEGStore(uri, filesystem=fs, create=False)
        if filesystem
        else MEGStore(uri, create=False, **fs_kwargs)
    )
    entries = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    now = time.time()
    partitions: set[tuple[str, int]] = set()
    bad_partitions: set[tuple[str, int]] = set()
    for e in sorted(entries, key=lambda e: e.path):
        rel = e.path[len(root) + 1 :]
        parts = rel.split("/")
        is_file = e.type == pafs.FileType.File
        top = parts[0]
        if rel == MARKER or top == QUARANTINE:
            continue
        if top == STAGING:
            if is_file and e.mtime is not None and now - e.mtime.timestamp() > stale_after_s:
                age = now - e.mtime.timestamp()
                problems.append(
                    Problem(
                        "stale_staging",
                        shown(e.path),
                        f"temp file last written {age:.0f} s ago, by a writer that died?; "
                        "never visible to readers; delete with MEGStore.clean_staging",
                        "warning",
                    )
                )
            continue
        if top in ("samples", "status", "inputs"):
            depth = 3 if top != "inputs" else 2
            level = len(parts) - 1  # 1: agent= (or iteration= for inputs)
            if not is_file:
                msg = _check_dir_name(top, level, parts[-1])
                if msg:
                    problems.append(Problem("bad_partition", shown(e.path), msg))
                continue
            name = parts[-1]
            if level != depth:
                if name.endswith(".parquet"):
                    problems.append(
                        Problem(
                            "misplaced",
                            shown(e.path),
                            "Parquet file outside a partition directory: readers ignore it but "
                            "DuckDB/pyarrow globs over the table would read it",
                        )
                    )
                else:
                    problems.append(
                        Problem(
                            "unexpected",
                            shown(e.path),
                            "file not part of the store layout",
                            "warning",
                        )
                    )
                continue
            if name.startswith(("_", ".")) and name.endswith(".parquet"):
                problems.append(
                    Problem(
                        "misplaced",
                        shown(e.path),
                        "hidden Parquet file: the store ignores it but DuckDB globs read it",
                    )
                )
                continue
            if not name.endswith(".parquet"):
                problems.append(
                    Problem(
                        "unexpected",
                        shown(e.path),
                        "file in a partition that readers ignore (not .parquet)",
                        "warning",
                    )
                )
                continue
            dir_msgs = [_check_dir_name(top, i + 1, parts[i + 1]) for i in range(depth - 1)]
            if any(dir_msgs):
                continue  # already reported on the directory
            pattern = _INPUT_NAME if top == "inputs" else _SAMPLE_NAME
            if not pattern.fullmatch(name):
                problems.append(
                    Problem(
                        "unexpected_name",
                        shown(e.path),
                        "fragment name not written by the store; readers read it for every "
                        "micro-batch",
                        "warning",
                    )
                )
            schema = {
                "samples": SAMPLE_FILE_SCHEMA,
                "status": STATUS_FILE_SCHEMA,
                "inputs": INPUT_FILE_SCHEMA,
            }[top]
            key = None if top == "inputs" else (parts[1][6:], int(parts[2][10:]))
            if key:
                partitions.add(key)
            try:
                table = store.read_fragment(e.path, schema, None if deep else [])
            except StoreError as err:
                problems.append(Problem(err.reason, shown(e.path), str(err)))
                if key:
                    bad_partitions.add(key)
                continue
            except Exception as err:  # noqa: BLE001 - a vanished file etc.: report, go on
                problems.append(Problem("unreadable", shown(e.path), repr(err)))
                if key:
                    bad_partitions.add(key)
                continue
            m = MB_NAME.fullmatch(name)
            if deep and m and table.num_rows:
                col = table.column("mb")
                if (
                    col.null_count
                    or pc.min(col).as_py() != int(m[1])
                    or pc.max(col).as_py() != int(m[1])
                ):
                    problems.append(
                        Problem(
                            "mb_tag",
                            shown(e.path),
                            f"fragment named for micro-batch {int(m[1])} holds rows of other "
                            "micro-batches: micro-batch reads would miss them",
                        )
                    )
            continue
        if is_file or not top.startswith(("_", ".")):
            problems.append(
                Problem(
                    "unexpected", shown(e.path), "entry not part of the store layout", "warning"
                )
            )
    if deep:
        for agent, iteration in sorted(partitions - bad_partitions):
            problems.extend(store.audit(agent, iteration))
    return problems


#: Findings of ``MEGStore.audit`` that break exactly-once storage; ``audit_store`` makes them
#: errors (``check_store`` keeps duplicates and orphans as warnings: readers tolerate them).
EXACTLY_ONCE = frozenset({"duplicate", "orphan_status", "bad_sample_id", "missing", "unexpected", "count"})


def audit_store(
    uri: str,
    expected: Mapping[tuple[str, int], Iterable[str]] | None = None,
    lost: Mapping[tuple[str, int], Iterable[str]] | None = None,
    **fs_kwargs: Any,
) -> list[Problem]:
    """Exactly-once audit of every (agent, iteration) partition of a store.

    Errors: a (sample_id, policy_version) stored more than once, a status row naming no stored
    sample, a malformed sample_id, and, for the partitions in ``expected`` (its keys: (agent,
    iteration); values: the sample_ids that must be there), missing or unexpected samples; a
    partition with a fragment that cannot be read is one error naming the file, and the audit
    goes on with the others. A sample_id under several policy versions stays a warning, and so
    do the ``lost`` ones (per partition: sample_ids lost to damage after they were trained on,
    see ``MEGStore.audit``).
    """
    store = MEGStore(uri, create=False, **fs_kwargs)
    keys = set(expected or {}) | set(store.partitions("samples")) | set(store.partitions("status"))
    problems = []
    for agent, iteration in sorted(keys):
        want = (expected or {}).get((agent, iteration))
        try:
            found = store.audit(agent, iteration, expected=want, lost=(lost or {}).get((agent, iteration), ()))
        except StoreError as err:  # the first damaged fragment of the partition, named
            problems.append(Problem(err.reason, err.path or store.display(store.partition_dir("samples", agent, iteration)),
                                    str(err)))
            continue
        for p in found:
            if p.kind in EXACTLY_ONCE:
                p = Problem(p.kind, p.path, p.message, "error")
            problems.append(p)
    return problems


def _check_dir_name(table: str, level: int, name: str) -> str | None:
    """Why a directory name is wrong at this level of ``table``, or None."""
    if level == 0:
        return None
    if table == "inputs":
        if level == 1 and not ITERATION_DIR.fullmatch(name):
            return f"expected iteration=<int>, got {name!r}"
        if level > 1:
            return "unexpected directory inside a partition"
        return None
    if level == 1:
        if not name.startswith("agent=") or not AGENT_NAME_RE.fullmatch(name[6:]):
            return f"expected agent=<name> with a valid agent name, got {name!r}"
    elif level == 2:
        if not ITERATION_DIR.fullmatch(name):
            return f"expected iteration=<int>, got {name!r}"
    else:
        return "unexpected directory inside a partition"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``store check PATH``: print the problems of a store; non-zero exit if any error."""
    parser = argparse.ArgumentParser(
        prog="flexmarl store check",
        description="Check a MEG Store: unreadable or foreign fragments, bad layout, stale "
        "staging files, duplicates. S3 stores: s3://bucket/prefix, with credentials and "
        "endpoint from AWS_* variables or ?endpoint_override=host:port&scheme=http.",
    )
    parser.add_argument("uri", help="store path or URI (local path, file://, s3://)")
    parser.add_argument(
        "--stale-after",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="report staging files older than this (default 3600)",
    )
    parser.add_argument("--strict", action="store_true", help="warnings also fail the check")
    parser.add_argument(
        "--shallow",
        action="store_true",
        help="read fragment footers only (faster, misses damaged pages)",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        problems = check_store(args.uri, stale_after_s=args.stale_after, deep=not args.shallow)
    except (OSError, ValueError, StoreError) as e:
        print(f"ERROR cannot check {args.uri}: {e}", file=sys.stderr)
        return 1
    for p in problems:
        print(p)
    errors = sum(p.severity == "error" for p in problems)
    warnings = len(problems) - errors
    print(f"{args.uri}: {errors} error(s), {warnings} warning(s)")
    return 1 if errors or (args.strict and warnings) else 0
