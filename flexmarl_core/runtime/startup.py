"""A flexmarl process's start-up: packages that load their heavy modules on first use, and what
a process does once its imports are done."""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module `__getattr__` (PEP 562): each name of `homes` loads from its module
    (`homes[name]`, under `package`) on first use, and is kept in the package from then on."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__


def freeze_imports() -> None:
    """Move what is alive now (the ~600k objects torch, transformers and Prefect create at
    import) out of the garbage collector's reach: every full collection scanned them all
    (0.3 s with the GIL held, in the middle of an op or a run), and so did the process's exit
    (1-2 s after its work was done). Garbage of this moment is collected first; objects made
    later are collected as before."""
    gc.collect()
    gc.freeze()
