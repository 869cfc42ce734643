"""One Prefect API for the whole run: the configured/ambient one, or a local server we start.

Dask worker processes inherit `PREFECT_API_URL` from the environment, so every task run reports
to the same API instead of each worker starting a temporary server of its own (~10 s each).

flexmarl talks only to the API that `PREFECT_API_URL` (or `cluster.prefect_api_url`) names,
or to the server it started itself: its pid file in `PREFECT_HOME` holds the server's pid,
URL and a token that the server process carries in its environment, so another checkout's
server on port 4200, or a process that reused a dead server's pid, is never taken for it.
The servers flexmarl started, their users and their idle stop: `flexmarl/servers.py`.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from flexmarl import servers
from flexmarl.servers import PID_FILE, TOKEN_ENV, our_server  # noqa: F401 - this module's names too
from flexmarl_core.config.checks import ConfigError

DEFAULT_PORT = 4200
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
    any other server, on port 4200 or elsewhere, is not. This process counts as a user of a
    server flexmarl started (`servers.use`); the server is left running after the run, so the
    UI link keeps working, and stops itself once idle for `FLEXMARL_SERVER_IDLE_S`
    (`flexmarl server stop` stops it at once).
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
        named = servers.find_home(url)  # a server flexmarl started, named by its URL
        if named is not None:
            with servers.lock(named):
                servers.use(named)
        return url, False
    url, started = local_server(home or _home())
    os.environ["PREFECT_API_URL"] = url
    return url, started


def local_server(home: Path, *, join: bool = True) -> tuple[str, bool]:
    """`(api_url, started)` of `home`'s own server: the one running, else one started now on
    the port it last had (links to it work again), stopping itself once idle
    (`servers.idle_limit`). `join`: this process counts as its user until it exits."""
    with servers.lock(home):  # the idle watcher decides under it: never stops a server chosen here
        own = our_server(home)
        started = own is None or not _healthy(own["url"])
        url = start_server(home, servers.last_port(home) or DEFAULT_PORT, idle_s=servers.idle_limit()) \
            if started else own["url"]
        if join:
            servers.use(home)
    return url, started


def _home() -> Path:
    return Path(os.environ.get("PREFECT_HOME", Path.cwd() / ".prefect"))


def start_server(home: Path, port: int = DEFAULT_PORT, idle_s: float = 0.0) -> str:
    """Start a detached local server with its database in `home`, on `port` or the next free
    one (its pid and URL in `home`/flexmarl-server.pid, listed by `flexmarl server status`);
    its API URL once it is healthy. `idle_s` > 0: it stops itself after that long without a
    user (`servers.watch`). Servers start one at a time on this machine (`servers.start_lock`),
    so two starting at once never both pick the same free port."""
    with servers.start_lock():
        while not servers.port_free(port):
            port += 1
        return _start(home, port, idle_s)


def _start(home: Path, port: int, idle_s: float) -> str:
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
    info = {"pid": proc.pid, "url": url, "token": token, "port": port, "started": time.time(), "idle_s": idle_s}
    (home / PID_FILE).write_text(json.dumps(info))
    servers.record(home, info)
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:  # before health: another process may answer on the port
            raise RuntimeError(f"prefect server exited with {proc.returncode}; see {home / 'server.log'}")
        if _healthy(url):
            if idle_s > 0:
                servers.start_watcher(home, idle_s)
            return url
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"prefect server did not become healthy at {url} in 180 s; see {home / 'server.log'}")


def stop_server(home: Path | None = None, sig: int = signal.SIGTERM) -> str:
    """Signal the server `start_server` started in `home` (default: this PREFECT_HOME's);
    see `servers.stop_server`."""
    return servers.stop_server(home or _home(), sig)


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
