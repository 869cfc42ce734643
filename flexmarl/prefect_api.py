"""One Prefect API for the whole run: the configured/ambient one, or a local server we start.

Dask worker processes inherit `PREFECT_API_URL` from the environment, so every task run reports
to the same API instead of each worker starting a temporary server of its own (~10 s each).

flexmarl talks only to the API that `PREFECT_API_URL` (or `cluster.prefect_api_url`) names,
or to the server it started itself: its pid file in `PREFECT_HOME` holds the server's pid,
URL and a token that the server process carries in its environment, so another checkout's
server on port 4200, or a process that reused a dead server's pid, is never taken for it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from flexmarl_core.config.checks import ConfigError

DEFAULT_PORT = 4200
PID_FILE = "flexmarl-server.pid"
#: the token a server flexmarl started carries, which its pid file names
TOKEN_ENV = "FLEXMARL_SERVER_TOKEN"
#: The local server we start runs this much nicer than the run. It turns the flow's events into
#: task runs from a queue, so on a shared machine it can take the cycles training leaves
#: (between ops, after the run) instead of slicing a core out of every stage; the UI lags by
#: at most its backlog. Measured with `bench/overhead.py` (docs/results/overhead.md).
SERVER_NICE = 10


def _lower_priority() -> None:
    os.nice(SERVER_NICE)


def _healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(api_url.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def _answers(api_url: str, timeout: float = 2.0) -> bool:
    """True when something answers HTTP at `api_url`/health (an auth error counts: Prefect
    Cloud answers 401 without a key, and Prefect itself reports that one clearly)."""
    try:
        with urllib.request.urlopen(api_url.rstrip("/") + "/health", timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):  # refused, unresolvable, timed out; ValueError: not a URL
        return False


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def current_api_url() -> str | None:
    """The API this process would report to: env var or Prefect settings (e.g. a test harness)."""
    url = os.environ.get("PREFECT_API_URL")
    if url:
        return url
    try:
        from prefect.settings import get_current_settings

        return get_current_settings().api.url
    except Exception:  # settings unavailable means no API configured
        return None


def ui_url(api_url: str) -> str:
    return api_url.removesuffix("/").removesuffix("/api")


def ensure_api(configured: str | None = None, *, home: Path | None = None) -> tuple[str, bool]:
    """Return `(api_url, started)`; start a detached local server if no API is configured.

    A server this `home` started earlier (its pid file, checked by its token) is used again;
    any other server, on port 4200 or elsewhere, is not. The server is left running after the
    run so the UI link keeps working; `flexmarl server stop` stops it.
    """
    url = configured or current_api_url()
    if url:
        if not _answers(url):
            where = "cluster.prefect_api_url" if configured else "PREFECT_API_URL (environment or Prefect profile)"
            raise ConfigError(
                f"{where} is {url}, but no Prefect API answers there; start that server, fix "
                "the URL, or unset it to let flexmarl start a local one"
            )
        os.environ["PREFECT_API_URL"] = url
        return url, False
    home = home or _home()
    own = our_server(home)
    if own is not None and _healthy(own["url"]):
        os.environ["PREFECT_API_URL"] = own["url"]
        return own["url"], False
    url = start_server(home, DEFAULT_PORT)
    os.environ["PREFECT_API_URL"] = url
    return url, True


def _home() -> Path:
    return Path(os.environ.get("PREFECT_HOME", Path.cwd() / ".prefect"))


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def our_server(home: Path) -> dict | None:
    """The server this `home`'s pid file names, if it is still that server: its process lives
    and carries the file's token (None: no file, a dead pid, a pid now someone else's)."""
    try:
        info = json.loads((home / PID_FILE).read_text())
        pid, token = int(info["pid"]), str(info["token"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if f"{TOKEN_ENV}={token}".encode() not in _environ(pid).split(b"\0"):
        return None
    return {"pid": pid, "url": str(info["url"]), "token": token}


def start_server(home: Path, port: int = DEFAULT_PORT) -> str:
    """Start a detached local server with its database in `home`, on `port` or the next free
    one (its pid and URL in `home`/flexmarl-server.pid); its API URL once it is healthy."""
    while not _port_free(port):
        port += 1
    url = f"http://127.0.0.1:{port}/api"
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / "server.log", "ab")  # noqa: SIM115 - handed to the child process
    from tasks.lean import server_env

    token = secrets.token_hex(16)
    env = {**os.environ, **server_env(), "PREFECT_HOME": str(home), TOKEN_ENV: token}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        preexec_fn=_lower_priority,
    )
    (home / PID_FILE).write_text(json.dumps({"pid": proc.pid, "url": url, "token": token}))
    deadline = time.time() + 180
    while time.time() < deadline:
        if _healthy(url):
            return url
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}; see {home / 'server.log'}")
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"prefect server did not become healthy at {url} in 180 s; see {home / 'server.log'}")


def stop_server(home: Path | None = None, sig: int = signal.SIGTERM) -> str:
    """Signal the server `start_server` started in `home` (SIGKILL: a drill's sudden loss), once
    its process is checked to be that server, and wait up to 10 s for its port to be free, so
    a new one can start there. Returns what it did, in a line."""
    home = home or _home()
    pidfile = home / PID_FILE
    if not pidfile.exists():
        return "no server started by flexmarl"
    own = our_server(home)
    pidfile.unlink()
    if own is None:  # its pid is dead, or another process's now: signal nothing
        return f"the server {pidfile} named is gone (stale pid file removed; nothing signalled)"
    try:
        os.killpg(own["pid"], sig)
    except ProcessLookupError:
        pass
    port = urlsplit(own["url"]).port
    deadline = time.time() + 10
    while port and not _port_free(port) and time.time() < deadline:
        time.sleep(0.1)
    return f"stopped the server at {ui_url(own['url'])}"


def drop_unsent() -> int:
    """The API is gone for good: drop the events and logs Prefect's background services still
    hold for it, which the process's exit would otherwise retry one by one against a dead
    server (about 7 s each, minutes in all). Returns how many were dropped (0 where this
    Prefect keeps them elsewhere)."""
    import queue

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    dropped = 0
    for service in (EventsWorker, APILogWorker):
        for inst in list(getattr(service, "_instances", {}).values()):
            q = getattr(inst, "_queue", None)
            while isinstance(q, queue.Queue):
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
                q.task_done()
                dropped += 1
    return dropped
