"""A stopped run in one line: what failed (the op, with its agent), where (the path) and what
the operator does next. The full traceback stays in the Prefect UI and the run's logs."""

from __future__ import annotations

import errno

#: what to do about an OSError, by errno
_FIXES = {
    errno.ENOSPC: "free space there",
    errno.EDQUOT: "free space there (a disk quota is full)",
    errno.EACCES: "give this user write access there",
    errno.EPERM: "give this user write access there",
    errno.EROFS: "the filesystem is read-only: point run_dir (or store.uri) at a writable one",
}


def _root_os_error(exc: BaseException) -> OSError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FIXES:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def describe(exc: BaseException) -> str:
    """The failure's own line: the error's message (which names the op and its agent when an
    op failed), without the exception chain."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def stopped_line(exc: BaseException, run_uri: str) -> str:
    """`run stopped: <what failed>; <what to do>, then flexmarl train --resume RUN`."""
    os_error = _root_os_error(exc)
    what = describe(exc)
    if os_error is not None:
        where = f" ({os_error.filename})" if os_error.filename and str(os_error.filename) not in what else ""
        fix = _FIXES[os_error.errno]
        return (f"run stopped: {what}{where}; what finished is stored: {fix}, then "
                f"`flexmarl train --resume {run_uri}`")
    return f"run stopped: {what}; what finished is stored: fix the cause, then `flexmarl train --resume {run_uri}`"
