"""What a flexmarl process does once its imports are done."""

from __future__ import annotations

import gc


def freeze_imports() -> None:
    """Move what is alive now (the ~600k objects torch, transformers and Prefect create at
    import) out of the garbage collector's reach: every full collection scanned them all
    (0.3 s with the GIL held, in the middle of an op or a run), and so did the process's exit
    (1-2 s after its work was done). Garbage of this moment is collected first; objects made
    later are collected as before."""
    gc.collect()
    gc.freeze()
