"""One Prefect API for the whole run: the configured/ambient one, or a local server we start.

Dask worker processes inherit `PREFECT_API_URL` from the environment, so every task run reports
to the same API instead of each worker starting a temporary server of its own (~10 s each).
"""

from __future__ import annotations

import os
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

    The server is left running after the run so the UI link keeps working; `flexmarl server
    stop` (or killing the pid in PREFECT_HOME/flexmarl-server.pid) stops it.
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
    port = DEFAULT_PORT
    url = f"http://127.0.0.1:{port}/api"
    if _healthy(url):
        os.environ["PREFECT_API_URL"] = url
        return url, False
    url = start_server(home or Path(os.environ.get("PREFECT_HOME", Path.cwd() / ".prefect")), port)
    os.environ["PREFECT_API_URL"] = url
    return url, True


def start_server(home: Path, port: int = DEFAULT_PORT) -> str:
    """Start a detached local server with its database in `home`, on `port` or the next free
    one (its pid and URL in `home`/flexmarl-server.pid); its API URL once it is healthy."""
    while not _port_free(port):
        port += 1
    url = f"http://127.0.0.1:{port}/api"
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / "server.log", "ab")  # noqa: SIM115 - handed to the child process
    from tasks.lean import server_env

    env = {**os.environ, **server_env(), "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        preexec_fn=_lower_priority,
    )
    (home / "flexmarl-server.pid").write_text(f"{proc.pid}\n{url}\n")
    deadline = time.time() + 180
    while time.time() < deadline:
        if _healthy(url):
            return url
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}; see {home / 'server.log'}")
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"prefect server did not become healthy at {url} in 180 s; see {home / 'server.log'}")


def stop_server(home: Path | None = None, sig: int = signal.SIGTERM) -> bool:
    """Signal the server `start_server` started in `home` (SIGKILL: a drill's sudden loss) and
    wait up to 10 s for its port to be free, so a new one can start there."""
    home = home or Path(os.environ.get("PREFECT_HOME", Path.cwd() / ".prefect"))
    pidfile = home / "flexmarl-server.pid"
    if not pidfile.exists():
        return False
    pid_text, url = (pidfile.read_text().split() + [""])[:2]
    try:
        os.killpg(int(pid_text), sig)
    except ProcessLookupError:
        pass
    pidfile.unlink()
    port = urlsplit(url).port
    deadline = time.time() + 10
    while port and not _port_free(port) and time.time() < deadline:
        time.sleep(0.1)
    return True
