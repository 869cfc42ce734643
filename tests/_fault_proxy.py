"""A loopback HTTP proxy that injects object-store faults, for drills and tests: put it between
flexmarl and an S3-compatible server (`AWS_ENDPOINT_URL=proxy.url`) and it answers some
requests with a 503, drops the connection before or after forwarding a request (a lost request,
a lost reply), or delays it, per a seeded schedule.

    proxy = FaultProxy("http://127.0.0.1:9000", seed=0, rates={"503": 0.05, "drop": 0.02})
    proxy.start(); ...; proxy.burst(20, "503"); ...; proxy.stop()
    proxy.injected   # {"503": 12, "drop": 3, ...}

Which request gets which fault depends only on the seed and the request's arrival order.

On another host (a network namespace: `tests._netns`) it runs as a process of its own, its
counts in a JSON file rewritten after every fault:

    python -m tests._fault_proxy http://10.231.7.2:5000 --listen 10.231.7.2:9000 \
        --rates '{"503": 0.02}' --stats faults.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["FAULTS", "FaultProxy"]

#: "503": answered 503 SlowDown, not forwarded; "drop": the connection closed, not forwarded;
#: "lost_reply": forwarded (it took effect), then the connection closed before the reply;
#: "delay": forwarded after `delay_s`
FAULTS = ("503", "drop", "lost_reply", "delay")
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
        "proxy-connection", "content-length"}
_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
              b"<Message>injected by flexmarl's fault proxy</Message></Error>")


class FaultProxy:
    """See the module docstring. `rates`: each fault's probability per request (at most one
    fault per request); `burst(n, fault)`: the next `n` requests all get `fault`."""

    def __init__(self, upstream: str, *, seed: int = 0, rates: Mapping[str, float] | None = None,
                 delay_s: float = 0.5, stats_file: Path | None = None) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream {upstream!r}: expected http://host:port")
        self.upstream = (parts.hostname, parts.port)
        self.rates = dict(rates or {})
        bad = sorted(set(self.rates) - set(FAULTS))
        if bad or sum(self.rates.values()) > 1:
            raise ValueError(f"rates {self.rates}: faults are {FAULTS}, their sum at most 1")
        self.delay_s = delay_s
        self.stats_file = stats_file
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self._rng = random.Random(seed)
        self._burst: list[str] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the proxy first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def burst(self, n: int, fault: str) -> None:
        if fault not in FAULTS:
            raise ValueError(f"fault {fault!r}: one of {FAULTS}")
        with self._lock:
            self._burst.extend([fault] * n)

    def set_rates(self, rates: Mapping[str, float]) -> None:
        with self._lock:
            self.rates = dict(rates)

    def _fate(self) -> str | None:
        with self._lock:
            self.requests += 1
            draw = self._rng.random()  # drawn for every request: the schedule is by order
            if self._burst:
                fate: str | None = self._burst.pop(0)
            else:
                fate, acc = None, 0.0
                for name in FAULTS:
                    acc += self.rates.get(name, 0.0)
                    if draw < acc:
                        fate = name
                        break
            if fate is not None:
                self.injected[fate] += 1
                self._write_stats()
            return fate

    def _write_stats(self) -> None:
        """`stats_file` replaced whole (a reader never sees half of it); under `_lock`."""
        if self.stats_file is not None:
            tmp = self.stats_file.with_name(self.stats_file.name + ".tmp")
            tmp.write_text(json.dumps({"requests": self.requests, "injected": dict(self.injected)}))
            os.replace(tmp, self.stats_file)

    def start(self, port: int = 0, host: str = "127.0.0.1") -> FaultProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _drop(self) -> None:
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def _serve(self) -> None:
                body = self._body()
                fate = proxy._fate()
                if fate == "503":
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(_SLOW_DOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(_SLOW_DOWN)
                    return
                if fate == "drop":
                    self._drop()
                    return
                if fate == "delay":
                    time.sleep(proxy.delay_s)
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    if body or self.command in ("PUT", "POST"):
                        headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if fate == "lost_reply":
                    self._drop()
                    return
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data) if self.command != "HEAD" else
                                                       resp.getheader("Content-Length") or 0))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _serve

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True).start()
        with self._lock:
            self._write_stats()  # there from the start: its presence says the proxy listens
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def main(argv: list[str] | None = None) -> None:
    """The proxy as a process of its own (module docstring); SIGTERM stops it."""
    ap = argparse.ArgumentParser(prog="python -m tests._fault_proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("upstream", help="the S3 server, http://host:port")
    ap.add_argument("--listen", required=True, metavar="HOST:PORT", help="where the proxy listens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rates", default="{}", help=f"JSON: each fault's probability per request, faults {FAULTS}")
    ap.add_argument("--delay-s", type=float, default=0.5, help="how long a delayed request waits")
    ap.add_argument("--stats", type=Path, required=True, help="JSON file of the counts, rewritten after every fault")
    args = ap.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    proxy = FaultProxy(args.upstream, seed=args.seed, rates=json.loads(args.rates), delay_s=args.delay_s,
                       stats_file=args.stats)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    proxy.start(int(port), host)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    proxy.stop()


if __name__ == "__main__":
    main()
