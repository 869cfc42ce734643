"""Where a run's files live: a local folder or an object-store prefix, and their layout.

Every file a worker reads is reached through a `RunLocation`, never through a local path, so a
run needs no folder shared between machines: `run_dir` is a local path (one machine, or an HPC
filesystem mounted alike everywhere) or any `pyarrow.fs` URI (`s3://bucket/runs/<name>`, with
the endpoint from `AWS_ENDPOINT_URL` for S3-compatible servers). Tasks carry the location's
`uri` string; `RunLocation(uri)` opens it again in the worker.

    RUN/.flexmarl-run                       marker: this is a run folder (a fresh run may replace it)
    RUN/run.lease                           its owner while a run uses it (driver/lease.py)
    RUN/config.yaml                         the resolved config, written last by prepare_run
    RUN/weights/<agent>/v<k>.safetensors    published weights, one file per version
    RUN/trainers/<agent>/v<k>.state         trainer state after k steps (training/handles.py format)
    RUN/metrics/{ops,iterations,decisions}.jsonl   the op log and metrics (JSON lines)
    RUN/warm_start.json                     the SFT warm start the run began from
    RUN/prefect-runs.json                   each attempt's Prefect flow run (tasks/leftovers.py)
    RUN/provenance.json                     the flexmarl version and commit that prepared it
    RUN.faults/<kind>@<op name>             fault-injection markers (stages/faults.py)

On local disk a write is a temp file and a rename; on an object store one whole-object PUT.
Both are atomic: a reader sees the old object or the new one, never half. Only the flow
process keeps a local scratch folder (`scratch_dir`: TensorBoard, Dask logs, pictures), and
nothing a worker needs is in it. A local run folder, and a local store, flexmarl creates is
its owner's only (mode 0700, `make_private`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow.fs as pafs

from storage.atomic import atomic_file
from storage.fs import open_filesystem, open_for_probe

RUN_MARKER = ".flexmarl-run"
LEASE_NAME = "run.lease"
CONFIG_NAME = "config.yaml"
WARM_START_NAME = "warm_start.json"
FAULTS_SUFFIX = ".faults"
STATE_SUFFIX = ".state"
_VERSION_FILE = re.compile(r"v(0|[1-9]\d*)\.[a-z]+")


def weights_key(agent: str, version: int) -> str:
    return f"weights/{agent}/v{version}.safetensors"


def trainer_key(agent: str, version: int) -> str:
    """The trainer state after `version` steps: the swap tier every worker can read (on-demand
    allocation swaps in from here) and the checkpoint `--resume` starts from."""
    return f"trainers/{agent}/v{version}{STATE_SUFFIX}"


def program_key(iteration: int, mb: int) -> str:
    """A program op's manifest of one micro-batch: the sample ids it committed and the
    trajectories that failed (`stages/program.py`)."""
    return f"programs/it{iteration}/mb{mb}.json"


def reward_key(iteration: int, mb: int) -> str:
    """A reward op's manifest of one micro-batch when some of its trajectories failed (their
    reward ran past its deadline): `{"failed": [{"input_id", "traj", "error"}]}`."""
    return f"rewards/it{iteration}/mb{mb}.json"


def gradient_key(agent: str, iteration: int, mb: int) -> str:
    """A gradient helper's gradient of one micro-batch (`codesign.gradient_helpers`), until the
    agent's step of `iteration` adds it."""
    return f"gradients/{agent}/it{iteration}-mb{mb}.safetensors"


def base_weights_key(key: str) -> str:
    """Where the shared base of LoRA agents (`models.lora.base_key`) is published, once per run."""
    return f"bases/{key}.safetensors"


def default_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """This machine's cache folder (models, tokenizers, warm starts, scratch of remote runs):
    `cache_dir`, else `$FLEXMARL_CACHE`, else `~/.cache/flexmarl`."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("FLEXMARL_CACHE") or Path.home() / ".cache" / "flexmarl")


def is_uri(where: str | os.PathLike[str]) -> bool:
    """A URI of a remote filesystem (`file://` is local disk)."""
    text = os.fspath(where)
    return "://" in text and not text.startswith("file://")


def shown(where: str | os.PathLike[str], within: str | os.PathLike[str] | None = None) -> str:
    """A run's folder or file as records others read name it (Prefect artifacts and logs),
    without this machine's absolute path: a URI as it is; a path inside `within` (the run
    folder) relative to it; else relative to the working folder when inside it, `~/...` inside
    the home folder, else `.../<parent>/<name>`."""
    text = os.fspath(where)
    if is_uri(text):
        return text
    path = Path(text.removeprefix("file://")).absolute()
    for base, prefix in ((within, ""), (Path.cwd(), ""), (Path.home(), "~/")):
        if base is None or is_uri(base):
            continue
        try:
            rel = path.relative_to(Path(os.fspath(base)).absolute())
        except ValueError:
            continue
        return prefix + (rel.as_posix() if rel.parts else ".")
    return "/".join(["...", *path.parts[1:][-2:]])


#: the mode of a local run folder (and store) flexmarl creates: its owner's only, as it holds the
#: run's config, logs and weights
PRIVATE_MODE = 0o700


def make_private(where: str | os.PathLike[str]) -> None:
    """Create the local folder `where` readable by its owner only (`PRIVATE_MODE`; missing
    parents get the usual mode). A folder that exists keeps its mode (the owner chose it); a URI
    is left alone (an object store's access is its own)."""
    text = os.fspath(where)
    if is_uri(text):
        return
    path = Path(text.removeprefix("file://"))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, PRIVATE_MODE)  # the umask can only take bits away from 0o700
    except FileExistsError:
        pass


class RunLocation:
    """One run's files, on local disk or an object store, addressed by relative keys
    (`weights/solver/v3.safetensors`). Picklable: it travels to Dask workers as its `uri`."""

    def __init__(self, uri: str | os.PathLike[str]) -> None:
        text = os.fspath(uri)
        if is_uri(text):
            self.uri = text.rstrip("/")
        else:
            self.uri = str(Path(text.removeprefix("file://")).resolve())
        self.fs, self.root, _ = open_filesystem(self.uri)
        self.local = isinstance(self.fs, pafs.LocalFileSystem)

    def __reduce__(self) -> tuple[Any, ...]:
        return (RunLocation, (self.uri,))

    def __repr__(self) -> str:
        return f"RunLocation({self.uri!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunLocation) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    # -- names -----------------------------------------------------------------------------
    def path(self, key: str = "") -> str:
        """`key`'s path inside the filesystem (a local path on disk)."""
        return f"{self.root}/{key}" if key else self.root

    def display(self, key: str = "") -> str:
        """`key` as users know it: `s3://bucket/runs/x/weights/...`, or the local path."""
        return f"{self.uri}/{key}" if key else self.uri

    def sibling(self, suffix: str) -> RunLocation:
        """The location next to this one named `<this><suffix>` (e.g. the faults folder)."""
        return RunLocation(self.uri + suffix)

    def scratch_dir(self) -> Path:
        """The flow process's local folder for this run: the run folder itself on local disk; for
        a remote run a folder under `$FLEXMARL_CACHE/scratch`, keyed by the URI."""
        if self.local:
            return Path(self.root)
        tail = re.sub(r"[^A-Za-z0-9._-]+", "_", self.uri.split("://", 1)[1])[-80:]
        digest = hashlib.sha1(self.uri.encode()).hexdigest()[:8]
        return default_cache_dir() / "scratch" / f"{tail}-{digest}"

    # -- reads -----------------------------------------------------------------------------
    def exists(self, key: str = "") -> bool:
        if self.local:
            return os.path.exists(self.path(key))
        return self.fs.get_file_info(self.path(key)).type != pafs.FileType.NotFound

    def is_file(self, key: str) -> bool:
        if self.local:
            return os.path.isfile(self.path(key))
        return self.fs.get_file_info(self.path(key)).type == pafs.FileType.File

    def size(self, key: str) -> int:
        info = self.fs.get_file_info(self.path(key))
        if info.type != pafs.FileType.File:
            raise FileNotFoundError(f"{self.display(key)} does not exist")
        return int(info.size)

    def open_input(self, key: str) -> Any:
        """A readable binary file (`read`, `readinto`); FileNotFoundError names the key."""
        try:
            if self.local:
                return open(self.path(key), "rb", buffering=0)  # noqa: SIM115 - the caller closes it
            return self.fs.open_input_file(self.path(key))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.display(key)} does not exist") from None

    def read_bytes(self, key: str) -> bytes:
        with self.open_input(key) as f:
            return f.read()

    def read_text(self, key: str) -> str:
        return self.read_bytes(key).decode("utf-8")

    def list(self, key: str = "", *, dirs: bool = False) -> list[str]:
        """Names of the files (or sub-folders) directly under `key`; none if it is missing."""
        want = pafs.FileType.Directory if dirs else pafs.FileType.File
        infos = self.fs.get_file_info(pafs.FileSelector(self.path(key), allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == want)

    def versions(self, key: str) -> list[int]:
        """The versions `k` of the `v<k>.<ext>` files under `key`, ascending."""
        return sorted(int(n[1:].split(".")[0]) for n in self.list(key) if _VERSION_FILE.fullmatch(n))

    def is_empty(self) -> bool:
        return not self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))

    # -- writes ----------------------------------------------------------------------------
    @contextmanager
    def open_output(self, key: str) -> Iterator[BinaryIO]:
        """A binary file that appears at `key` whole when the block ends (and never, if it
        raises): temp + rename on disk, one PUT on an object store."""
        path = self.path(key)
        if not self.local:  # an object store has no folders to make first
            with self.fs.open_output_stream(path) as f:
                yield f  # type: ignore[misc]
            return
        with atomic_file(path) as f:
            yield f

    def write_bytes(self, key: str, data: bytes) -> None:
        with self.open_output(key) as f:
            f.write(data)

    def write_text(self, key: str, text: str) -> None:
        self.write_bytes(key, text.encode("utf-8"))

    def upload(self, local: Path, key: str) -> None:
        """Copy a local file to `key` (atomically, as every write here)."""
        self.write_bytes(key, Path(local).read_bytes())

    def delete(self, key: str) -> None:
        """Delete one file (missing is fine)."""
        try:
            self.fs.delete_file(self.path(key))
        except FileNotFoundError:
            pass

    def delete_all(self, keep: tuple[str, ...] = ()) -> None:
        """Delete everything under this location (a fresh run replacing an old one) but the
        top-level entries named in `keep` (the new run's lease)."""
        if self.local:
            if not os.path.exists(self.root):
                return
            if not keep:
                shutil.rmtree(self.root)
                return
            for entry in os.scandir(self.root):
                if entry.name in keep:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            return
        if not keep:
            try:
                self.fs.delete_dir(self.root)
            except FileNotFoundError:
                pass
            return
        for info in self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True)):
            if info.base_name in keep:
                continue
            if info.type == pafs.FileType.Directory:
                self.fs.delete_dir(info.path)
            else:
                self.fs.delete_file(info.path)


class LocationError(ValueError):
    """A run folder or store on an object store that cannot be reached as configured."""


def check_reachable(field: str, uri: str) -> None:
    """One request to the object store `uri` is on, now: a host that does not resolve, refused
    credentials, a bucket that does not exist or a scheme pyarrow lacks is a one-line error
    naming `field`, before a run folder or a cluster exists. A local path passes."""
    if not is_uri(uri):
        return
    try:
        fs, root = open_for_probe(uri)
        bucket = root.split("/", 1)[0]
        missing = fs.get_file_info(bucket).type == pafs.FileType.NotFound
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        text = " ".join(str(exc).split())
        raise LocationError(f"{field} {uri!r}: cannot reach it: {text[:400]}") from None
    if missing:
        raise LocationError(f"{field} {uri!r}: the bucket {bucket!r} does not exist (create it, or "
                            "check the endpoint: AWS_ENDPOINT_URL)")


def as_location(run_dir: str | os.PathLike[str] | RunLocation) -> RunLocation:
    """`run_dir` opened as a location (an opened one as it is)."""
    if isinstance(run_dir, RunLocation):
        return run_dir
    return _location(os.fspath(run_dir))


@functools.lru_cache(maxsize=16)
def _location(run_dir: str) -> RunLocation:
    # Every op names its run by string: one filesystem client per run and process, not per op.
    return RunLocation(run_dir)
