"""``python -m storage check PATH``: see :mod:`storage.check`."""

from __future__ import annotations

import sys

from .check import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] != "check":
        print(
            "usage: python -m storage check PATH_OR_URI [--stale-after S] [--strict]",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.exit(main(args[1:]))
