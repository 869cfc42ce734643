"""Filesystem adapter of the MEG Store: resolving URIs, the directory layout, listing.

Everything here is about where files live and how to find them; what is in them is the
business of the other parts (``commit``, ``read``, ``write``, ``compact``, ``audit``).
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit

import pyarrow.fs as pafs

from .retry import retrying
from .schema import AGENT_NAME_RE, validate_agent

__all__ = [
    "FORMAT_VERSION",
    "ITERATION_DIR",
    "MARKER",
    "MB_NAME",
    "STAGING",
    "CommitMode",
    "StoreFiles",
    "commit_mode",
    "open_filesystem",
    "os_reason",
    "s3_endpoint_from_env",
]

MARKER = "_meg_store.json"
FORMAT_VERSION = 1
STAGING = "_staging"
#: Fragment names: "mb000003-<key>.parquet" holds one micro-batch, "all-<key>.parquet" any
#: (compaction output, or status rows without mb). Readers of one micro-batch open only the
#: files whose tag matches or is not an mb tag, so they never parse the rest of the partition.
MB_NAME = re.compile(r"mb(\d{6,})-[0-9a-f]+\.parquet")
#: An iteration directory as the store writes it (no sign, no leading zeros).
ITERATION_DIR = re.compile(r"iteration=(0|[1-9]\d*)")

#: How a fragment is published atomically: ``rename`` a staged file (local disk) or one
#: whole-object ``put`` (S3, GCS).
CommitMode = Literal["rename", "put"]


def open_filesystem(
    uri: str, filesystem: pafs.FileSystem | None = None, **fs_kwargs: Any
) -> tuple[pafs.FileSystem, str, str]:
    """Resolve ``uri`` to ``(filesystem, root path inside it, display prefix)``.

    ``uri`` is a local path, ``file:///abs/path``, or ``s3://bucket/prefix`` (``gs://`` too).
    A remote filesystem comes wrapped in `storage.retry` (transient failures retried). For
    S3, ``fs_kwargs`` go to ``pyarrow.fs.S3FileSystem`` (``endpoint_override``,
    ``scheme``, ``access_key``, ``secret_key``, ``region``...); without them pyarrow reads
    the URI query (``?endpoint_override=host:port&scheme=http``), ``AWS_ENDPOINT_URL`` (see
    `s3_endpoint_from_env`) and the other ``AWS_*`` env vars (keys, region).
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
        return retrying(pafs.S3FileSystem(**fs_kwargs), "s3://"), path, "s3://"
    if fs_kwargs:
        raise ValueError(f"filesystem keyword arguments are only supported for s3://, got {uri!r}")
    if scheme == "s3" and "endpoint_override" not in uri:
        endpoint = s3_endpoint_from_env()
        if endpoint:
            path = uri.split("://", 1)[1].split("?", 1)[0].strip("/")
            return retrying(pafs.S3FileSystem(**endpoint), "s3://"), path, "s3://"
    fs, path = pafs.FileSystem.from_uri(uri)
    prefix = "" if isinstance(fs, pafs.LocalFileSystem) else f"{scheme}://"
    return retrying(fs, prefix), path.rstrip("/"), prefix


#: The AWS SDKs' own variables for an S3-compatible endpoint (MinIO, Ceph, moto): pyarrow does
#: not read them, so every machine of a run would otherwise need the endpoint in each URI.
ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


#: S3 options a probe takes from the URI's query (others: the probe opens it as pyarrow would)
_PROBE_QUERY = ("endpoint_override", "scheme", "region")


def open_for_probe(uri: str) -> tuple[pafs.FileSystem, str]:
    """``uri``'s filesystem for one quick look (a launch's reachability check): not wrapped in
    `storage.retry`, and on S3 two attempts with a 3 s connect timeout, so a host that does not
    answer is an error in seconds; the run's own calls (`open_filesystem`) retry for longer."""
    scheme, rest = uri.split("://", 1) if "://" in uri else ("", uri)
    query = dict(parse_qsl(urlsplit(uri).query))
    if scheme.lower() == "s3" and set(query) <= set(_PROBE_QUERY):
        kwargs: dict[str, Any] = dict(query)
        if "endpoint_override" not in kwargs:
            kwargs = {**(s3_endpoint_from_env() or {}), **kwargs}
        fs = pafs.S3FileSystem(**kwargs, connect_timeout=3.0, request_timeout=10.0,
                               retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=2))
        return fs, rest.split("?", 1)[0].strip("/")
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path.rstrip("/")


def s3_endpoint_from_env() -> dict[str, str] | None:
    """``S3FileSystem`` keyword arguments from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
    (``http://host:port``), or None when neither is set."""
    for name in ENDPOINT_ENV:
        url = os.environ.get(name, "").strip()
        if url:
            scheme, _, hostport = url.rpartition("://")
            if scheme not in ("http", "https") or not hostport.strip("/"):
                raise ValueError(f"{name}={url!r}: expected http://host:port or https://host:port")
            return {"endpoint_override": hostport.strip("/"), "scheme": scheme}
    return None


def commit_mode(fs: pafs.FileSystem, uri: str) -> CommitMode:
    """How ``fs`` can publish a fragment atomically; ValueError if it cannot."""
    if isinstance(fs, pafs.LocalFileSystem):
        return "rename"
    if fs.type_name.removeprefix("py::") in ("s3", "gcs"):  # py::: wrapped by storage.retry
        return "put"
    raise ValueError(
        f"unsupported filesystem {fs.type_name!r} for {uri!r}: the store needs "
        "either an atomic replacing rename (local disk) or atomic whole-object PUTs "
        "(s3, gcs)"
    )


def os_reason(e: OSError) -> str:
    """``Permission denied`` / ``No space left on device`` / ... (pyarrow's text otherwise)."""
    if e.errno and e.strerror and not str(e.strerror).startswith("Cannot"):
        return f"{e.strerror} [errno {e.errno}]"
    return str(e)


class StoreFiles:
    """The files of one store: its paths, listings and deletions.

    Base of every part of :class:`storage.MEGStore`; the store's constructor sets the
    attributes.
    """

    fs: pafs.FileSystem
    root: str
    _prefix: str
    _commit_mode: CommitMode

    def display(self, path: str) -> str:
        """A path as users know it (``s3://bucket/key`` for S3, the plain path on disk)."""
        return self._prefix + path

    def partition_dir(self, kind: str, agent: str, iteration: int) -> str:
        """The folder of one (agent, iteration) partition of the `samples` or `status` table."""
        return f"{self.root}/{kind}/agent={agent}/iteration={iteration}"

    def _samples_dir(self, agent: str, iteration: int) -> str:
        return self.partition_dir("samples", agent, iteration)

    def _status_dir(self, agent: str, iteration: int) -> str:
        return self.partition_dir("status", agent, iteration)

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
                if n.startswith(tag) or not n.startswith("mb") or not MB_NAME.fullmatch(n)
            ]
        # mb-tagged rollout fragments first, compaction output last: on equal created_at the
        # later row wins, and compacted rows are the more complete ones.
        names.sort(key=lambda n: (not n.startswith("mb"), n))
        return [f"{directory}/{n}" for n in names]

    def _delete(self, path: str) -> None:
        try:
            self.fs.delete_file(path)
        except FileNotFoundError:
            pass

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

    def partitions(self, kind: str = "samples") -> list[tuple[str, int]]:
        """The (agent, iteration) partitions of the ``samples`` or ``status`` table.

        Only directories named as the store names them count (a valid agent name, a plain
        iteration number); ``check_store`` reports the others.
        """
        if kind not in ("samples", "status"):
            raise ValueError(f"unknown partitioned table {kind!r}; expected 'samples' or 'status'")
        base = f"{self.root}/{kind}"
        out = []
        for adir in self._list(base, dirs=True):
            if adir.startswith("agent=") and AGENT_NAME_RE.fullmatch(adir[6:]):
                for idir in self._list(f"{base}/{adir}", dirs=True):
                    if ITERATION_DIR.fullmatch(idir):
                        out.append((adir[6:], int(idir[10:])))
        return sorted(out)
