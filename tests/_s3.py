"""moto's S3 server on loopback for the tests (a thread of the test process, reached over real
HTTP), and the settings that reach it. moto is imported when a server starts, not at
collection: moto.server brings Flask, whose module-level context proxies raise on attribute
access, and vLLM's engine start scans every loaded module's objects."""

from __future__ import annotations

import logging
import socket
from typing import Any

import pyarrow.fs as pafs


def start_moto() -> tuple[Any, str]:
    """A started moto server with no buckets, and its endpoint `http://127.0.0.1:<port>`."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"


def s3_kwargs(endpoint: str) -> dict[str, str]:
    """`pyarrow.fs.S3FileSystem` keyword arguments for `endpoint` (moto takes any key)."""
    return {"endpoint_override": endpoint.removeprefix("http://"), "scheme": "http",
            "access_key": "testing", "secret_key": "testing", "region": "us-east-1"}


def make_bucket(endpoint: str, bucket: str) -> None:
    pafs.S3FileSystem(**s3_kwargs(endpoint), allow_bucket_creation=True).create_dir(bucket)
