"""moto's S3 server on loopback for the tests and the benches (a process of its own, reached
over real HTTP), and the settings that reach it. A process, not a thread of the caller:
moto.server brings Flask, whose module-level context proxies raise on attribute access, and
vLLM's engine start scans every loaded module's objects (and Dask workers forked from the
caller would inherit them), so Flask must never be imported where tests or benches run."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

import pyarrow.fs as pafs


class MotoServer:
    """`python -m moto.server` on `host`:`port`, started and answering; `stop()` ends it.
    `wrap`: a command prefix it runs under (`ip netns exec NS`: on a host of its own, with
    `env` as its environment)."""

    def __init__(self, port: int, host: str = "127.0.0.1", wrap: Sequence[str] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self.endpoint = f"http://{host}:{port}"
        self._proc = subprocess.Popen([*wrap, sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      env=None if env is None else dict(env))
        deadline = time.monotonic() + 120  # it imports moto's services: seconds on a busy machine
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=5).close()
                return
            except urllib.error.HTTPError:  # it answers (moto's root is not a page)
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto's server did not start on {self.endpoint}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def require_moto() -> None:
    """Skip, saying why, where moto is absent; never imports it here (it brings Flask)."""
    import pytest  # here, not at the top: the benches use this module and need no pytest

    if importlib.util.find_spec("moto") is None:
        pytest.skip("moto is not installed (the dev extra has it)")


def start_moto() -> tuple[MotoServer, str]:
    """A started moto server with no buckets, and its endpoint `http://127.0.0.1:<port>`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = MotoServer(port)
    return server, server.endpoint


def s3_kwargs(endpoint: str) -> dict[str, str]:
    """`pyarrow.fs.S3FileSystem` keyword arguments for `endpoint` (moto takes any key)."""
    return {"endpoint_override": endpoint.removeprefix("http://"), "scheme": "http",
            "access_key": "testing", "secret_key": "testing", "region": "us-east-1"}


def aws_env(endpoint: str) -> dict[str, str]:
    """The `AWS_*` variables that point S3 clients, and processes started after, at `endpoint`."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def make_bucket(endpoint: str, bucket: str) -> None:
    pafs.S3FileSystem(**s3_kwargs(endpoint), allow_bucket_creation=True).create_dir(bucket)


def start_s3(bucket: str) -> MotoServer:
    """A started moto server holding `bucket`, with this process's environment pointed at it (call
    it before any cluster starts, so its worker processes inherit that); `.stop()` it."""
    server, endpoint = start_moto()
    try:
        make_bucket(endpoint, bucket)
    except BaseException:
        server.stop()
        raise
    os.environ.update(aws_env(endpoint))
    return server
