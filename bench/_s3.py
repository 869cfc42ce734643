"""An S3-compatible server on loopback for the benches that price object storage (moto in
server mode, reached over real HTTP)."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3(bucket: str) -> Any:
    """Start moto on a free port with `bucket` in it and point this process's environment at it
    (before any cluster starts, so its worker processes inherit it). Returns the server:
    `.stop()` it."""
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="testing",
                      AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                      allow_bucket_creation=True).create_dir(bucket)
    return server
