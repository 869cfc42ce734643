"""Models named as users name them: `model.path: Qwen/Qwen2.5-0.5B-Instruct` resolves through the
standard Hugging Face cache and its environment (`HF_HOME`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE`),
read when the id is resolved rather than when `huggingface_hub` was imported.

The driver resolves an id once, at config load, to a commit (`model.revision` pins it) and a
snapshot folder (`model.path`). A worker that finds that folder reads it; one on another machine
(its own cache) resolves the same id at the same commit, a cache hit or a download there. So every
process reads one snapshot even if the hub's branch moves during the run, and no worker needs the
driver's paths.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: what a hub id looks like: `org/name` (a folder that exists always wins)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: the files a causal LM and its tokenizer need (no pickled weights, no remote code)
WANTED = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


class HubModelMissing(ValueError):
    """The id is not in the cache and cannot be downloaded (offline, unknown, no network)."""


def looks_like_hub_id(path: str) -> bool:
    return bool(HUB_ID.match(path)) and not Path(os.path.expanduser(path)).exists()


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expanduser(os.environ["HF_HUB_CACHE"]))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface")
    return Path(os.path.expanduser(home)) / "hub"


def resolve(repo_id: str, revision: str | None = None) -> tuple[Path, str]:
    """(snapshot folder, commit) of `repo_id` at `revision` (default: main)."""
    from huggingface_hub import snapshot_download

    cache, rev = cache_dir(), revision or "main"
    pinned = cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / rev
    if _COMMIT.match(rev) and (pinned / "config.json").is_file():
        return pinned, rev  # a commit never changes: no need to ask the hub
    try:
        folder = Path(snapshot_download(repo_id, revision=rev, cache_dir=str(cache), allow_patterns=WANTED,
                                        local_files_only=offline()))
    except Exception as e:  # offline miss, unknown id, no network: all one answer for the user
        how = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
        state = "HF_HUB_OFFLINE is set" if offline() else f"it could not be downloaded ({type(e).__name__})"
        raise HubModelMissing(
            f"{repo_id!r} is not a model folder, and as a Hugging Face hub id it is not in the cache "
            f"{cache} and {state}: download it with `{how}` (same HF_HOME), or set model.path to a "
            "local folder") from None
    if not (folder / "config.json").is_file():
        raise HubModelMissing(f"hub model {repo_id!r} at {rev} has no config.json: not a transformers model")
    return folder, folder.name
