"""One Prefect API for the whole run: the configured/ambient one, or a local server we start.

Dask worker processes inherit `PREFECT_API_URL` from the environment, so every task run reports
to the same API instead of each worker starting a temporary server of its own (~10 s each).

flexmarl talks only to the API that `PREFECT_API_URL` (or `cluster.prefect_api_url`) names,
or to the server it started itself: its pid file in `PREFECT_HOME` holds the server's pid,
URL and a token that the server process carries in its environment, so another checkout's
server on port 4200, or a process that reused a dead server's pid, is never taken for it.
The servers flexmarl started, their users and their idle stop: `flexmarl/servers.py`.

A server flexmarl starts demands an auth string of every API call (another account on the
machine could otherwise read, cancel and rewrite runs): a random one, kept in
`PREFECT_HOME/flexmarl-server.auth` (mode 0600) and reused by the server's restarts, so the
workers and CLIs given it keep working. A process that uses that server puts it in its own
`PREFECT_API_AUTH_STRING` (its Dask workers and subprocesses inherit it); a process given
another API sends what the user set there, as Prefect does (`PREFECT_API_AUTH_STRING` or
`PREFECT_API_KEY`). flexmarl never prints, logs or records either.
"""

from __future__ import annotations

import base64
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


def _nice_session(nice: int) -> None:
    """This process's session (autogroup) at `nice`. With autogroup scheduling on (most Linux
    desktops and VMs), the kernel first shares the cores evenly between sessions and only then
    by nice within one: a server in a session of its own at nice 10 still took half the cores
    from the run whenever it was busy. No-op where the kernel has no autogroups."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass
#: what a Prefect client sends as its Basic auth (Prefect's own setting)
CLIENT_AUTH_ENV = "PREFECT_API_AUTH_STRING"


def _server_child() -> None:
    os.nice(SERVER_NICE)
    _nice_session(SERVER_NICE)  # start_new_session gave it a session, so an autogroup, of its own
    os.umask(0o077)  # its database and logs are the runs too: readable by this user only


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
    (`flexmarl server stop` stops it at once). This process sends the auth string of a server
    flexmarl started (read from the server's process, which only its user can); an API that
    answers 401 to the auth it would send is a `ConfigError` saying how to pass it.
    """
    url = configured or current_api_url()
    if url:
        where = "cluster.prefect_api_url" if configured else "PREFECT_API_URL (environment or Prefect profile)"
        if not _answers(url):
            raise ConfigError(
                f"{where} is {url}, but no Prefect API answers there; start that server, fix "
                "the URL, or unset it to let flexmarl start a local one"
            )
        os.environ["PREFECT_API_URL"] = url
        named = servers.find_home(url)  # a server flexmarl started, named by its URL
        if named is not None:  # this user's own server: its string, over any the env has (stale)
            _use_auth(own_auth(url))
        _refresh_prefect_settings()
        _check_auth(url, where, named)
        if named is not None:
            with servers.lock(named):
                servers.use(named)
        return url, False
    url, started = local_server(home or _home())
    os.environ["PREFECT_API_URL"] = url
    _refresh_prefect_settings()
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
        if not started:  # the string it runs with: its file may be gone or newer
            _use_auth(servers.server_auth(own["pid"]))  # type: ignore[index]
        if join:
            servers.use(home)
    return url, started


def _home() -> Path:
    return Path(os.environ.get("PREFECT_HOME", Path.cwd() / ".prefect"))


def auth_file(home: Path) -> Path:
    """Where the auth string of `home`'s server is kept (readable by its user only)."""
    return home / servers.AUTH_FILE


def _auth_string(home: Path) -> str:
    """The auth string for `home`'s server: its file's, so a restarted server keeps the one its
    clients have; a new one if there is none, or if the file has become readable by others (then
    it is no longer a secret)."""
    path = auth_file(home)
    try:
        if path.stat().st_mode & 0o077 == 0 and (kept := path.read_text().strip()):
            return kept
    except OSError:  # none yet
        pass
    auth = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, even briefly
    with os.fdopen(fd, "w") as fh:
        fh.write(auth + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return auth


def own_auth(api_url: str) -> str | None:
    """The auth string of the server flexmarl started at `api_url`, read from its process (so
    only its own user can); None where `api_url` is not such a server, or it demands none."""
    home = servers.find_home(api_url)
    own = our_server(home) if home is not None else None
    return servers.server_auth(own["pid"]) if own is not None else None


def _use_auth(auth: str | None) -> None:
    """This process, its Dask workers and its subprocesses send `auth` to the API from now on."""
    if auth:
        os.environ[CLIENT_AUTH_ENV] = auth


def _refresh_prefect_settings() -> None:
    """Prefect built its global settings from the environment when it was imported: rebuild
    them, so clients made without a settings context (threads) see the API and its auth."""
    if "prefect.context" in sys.modules:
        import prefect.context

        prefect.context.refresh_global_settings_context()


def _auth_header() -> dict[str, str]:
    """The Authorization header a Prefect client here sends (auth string first, then API key;
    from the environment, else the Prefect profile)."""
    auth, key = os.environ.get(CLIENT_AUTH_ENV), os.environ.get("PREFECT_API_KEY")
    if not (auth or key):
        try:
            from prefect.settings import get_current_settings

            api = get_current_settings().api
            auth = api.auth_string.get_secret_value() if api.auth_string else None
            key = api.key.get_secret_value() if api.key else None
        except Exception:  # no usable Prefect settings: nothing to send
            pass
    if auth:
        return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}
    return {"Authorization": f"Bearer {key}"} if key else {}


def _check_auth(url: str, where: str, home: Path | None) -> None:
    """One authenticated request, as the run's Prefect client will make them, before anything
    starts: an API that refuses this process's auth is a line naming how to pass it, not a
    traceback from the flow. (`/health` answers without auth, so `_answers` cannot tell.)"""
    header = _auth_header()
    req = urllib.request.Request(url.rstrip("/") + "/admin/version", headers=header)
    try:
        with urllib.request.urlopen(req, timeout=10):
            return
    except urllib.error.HTTPError as exc:
        if exc.code != 401:  # anything else is Prefect's client's to report
            return
    except (OSError, ValueError):
        return
    kept = auth_file(home or _home())
    if header:
        raise ConfigError(f"{where} is {url}, which answered 401 Unauthorized to the {CLIENT_AUTH_ENV} (or "
                          f"PREFECT_API_KEY) given here: set the server's own (a local server flexmarl started "
                          f"keeps it in {kept})")
    raise ConfigError(f"{where} is {url}, which answered 401 Unauthorized: set {CLIENT_AUTH_ENV} to the server's "
                      f"auth string (the local server's is in {kept}), or PREFECT_API_KEY for Prefect Cloud")


def start_server(home: Path, port: int = DEFAULT_PORT, idle_s: float = 0.0) -> str:
    """Start a detached local server with its database in `home`, on `port` or the next free
    one (its pid and URL in `home`/flexmarl-server.pid, listed by `flexmarl server status`);
    its API URL once it is healthy. It demands the auth string `home` keeps (`auth_file`), which
    this process sends from then on. `idle_s` > 0: it stops itself after that long without a
    user (`servers.watch`). Servers start one at a time on this machine (`servers.start_lock`),
    so two starting at once never both pick the same free port."""
    with servers.start_lock():
        while not servers.port_free(port):
            port += 1
        return _start(home, port, idle_s)


def _start(home: Path, port: int, idle_s: float) -> str:
    url = f"http://127.0.0.1:{port}/api"
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    log = os.fdopen(os.open(home / "server.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
    from tasks.lean import server_env

    token = secrets.token_hex(16)
    auth = _auth_string(home)
    env = {**os.environ, **server_env(), "PREFECT_HOME": str(home), TOKEN_ENV: token, servers.SERVER_AUTH_ENV: auth}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
         "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        preexec_fn=_server_child,
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
            _use_auth(auth)  # the process that starts a server uses it
            _refresh_prefect_settings()
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
