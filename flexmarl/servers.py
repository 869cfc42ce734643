"""The local Prefect servers flexmarl started: which are running, who uses them, and when an
idle one stops itself.

    flexmarl server status         each one: port, Prefect home, pid, in use or idle since
    flexmarl server stop [--all]   this PREFECT_HOME's server (--all: every one listed)
    flexmarl server start          this PREFECT_HOME's server again, on its last port

A server flexmarl starts (`prefect_api.ensure_api`) keeps, in its Prefect home:

    flexmarl-server.pid            {"pid", "url", "token", "port", "started", "idle_s"}: the
                                   server, proved by the token its process carries
    flexmarl-server.auth           the API's auth string (mode 0600; never in the pid file or
                                   the registry): a client sends it as PREFECT_API_AUTH_STRING
    flexmarl-server.users/<pid>-<start>   one file per process using it (a run), while it runs
    flexmarl-server.last-used      touched when a user comes or goes: the idle clock
    flexmarl-server.lock           taken while a user joins and while the idle check decides

and one entry per Prefect home in `$FLEXMARL_CACHE/servers/` (default
`~/.cache/flexmarl/servers/`), which `status` and `stop --all` read. With an idle limit
(`FLEXMARL_SERVER_IDLE_S`, seconds, default 1800; 0: never), a watcher process beside the
server (`python -m flexmarl.servers --watch HOME`) stops it once no process has used it for
that long; it exits when the server is gone. A run that starts under the lock joins first, so
the watcher never stops a server a run has just chosen.

Standard library only: the watcher imports nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

PID_FILE = "flexmarl-server.pid"
USERS_DIR = "flexmarl-server.users"
LAST_USED = "flexmarl-server.last-used"
LOCK_FILE = "flexmarl-server.lock"
#: the token a server flexmarl started carries, which its pid file names
TOKEN_ENV = "FLEXMARL_SERVER_TOKEN"
AUTH_FILE = "flexmarl-server.auth"
#: Prefect's setting for the auth string its API server demands of every client
SERVER_AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"
IDLE_ENV = "FLEXMARL_SERVER_IDLE_S"
#: seconds without a run after which a server flexmarl started stops itself (`IDLE_ENV`)
IDLE_S = 1800.0


def idle_limit() -> float:
    """The idle limit for a server started now (`FLEXMARL_SERVER_IDLE_S`; 0: never)."""
    try:
        return max(float(os.environ.get(IDLE_ENV, IDLE_S)), 0.0)
    except ValueError:
        return IDLE_S


def registry() -> Path:
    cache = os.environ.get("FLEXMARL_CACHE") or str(Path.home() / ".cache" / "flexmarl")
    return Path(cache) / "servers"


def _entry(home: Path) -> Path:
    return registry() / f"{hashlib.sha1(str(home.resolve()).encode()).hexdigest()[:16]}.json"


# -- processes -------------------------------------------------------------------------------
def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def _start_ticks(pid: int) -> int | None:
    """A live process's start time (field 22 of /proc/<pid>/stat); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def read_pid_file(home: Path) -> dict | None:
    try:
        info = json.loads((home / PID_FILE).read_text())
        return info if isinstance(info, dict) else None
    except (OSError, ValueError):
        return None


def our_server(home: Path) -> dict | None:
    """The server this `home`'s pid file names, if it is still that server: its process lives
    and carries the file's token (None: no file, a dead pid, a pid now someone else's)."""
    info = read_pid_file(home)
    try:
        pid, token = int(info["pid"]), str(info["token"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return None
    if f"{TOKEN_ENV}={token}".encode() not in _environ(pid).split(b"\0"):
        return None
    return {**info, "pid": pid, "url": str(info["url"]), "token": token}  # type: ignore[index]


def server_auth(pid: int) -> str | None:
    """The auth string the server process `pid` demands (None: none, e.g. one started before
    flexmarl gave its servers one). Readable only by the server's own user, as its file is."""
    prefix = f"{SERVER_AUTH_ENV}=".encode()
    for item in _environ(pid).split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix):].decode() or None
    return None


def stop_server(home: Path, sig: int = signal.SIGTERM) -> str:
    """Signal the server started in `home` (SIGKILL: a drill's sudden loss), once its process
    is checked to be that server, and wait up to 10 s for its port to be free, so a new one
    can start there. Returns what it did, in a line."""
    pidfile = home / PID_FILE
    if not pidfile.exists():
        return "no server started by flexmarl"
    own = our_server(home)
    pidfile.unlink(missing_ok=True)
    if own is None:  # its pid is dead, or another process's now: signal nothing
        return f"the server {pidfile} named is gone (stale pid file removed; nothing signalled)"
    try:
        os.killpg(own["pid"], sig)
    except ProcessLookupError:
        pass
    port = urlsplit(own["url"]).port
    deadline = time.time() + 10
    while port and not port_free(port) and time.time() < deadline:
        time.sleep(0.1)
    return f"stopped the server at {own['url'].removesuffix('/').removesuffix('/api')} (Prefect home {home})"


# -- the registry ----------------------------------------------------------------------------
def record(home: Path, info: dict) -> None:
    """A server `home` started (its pid file's content): listed by `status` from now on."""
    path = _entry(home)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"home": str(home.resolve()), **{k: v for k, v in info.items() if k != "token"}}))
    tmp.replace(path)


def last_port(home: Path) -> int | None:
    """The port `home`'s server last had (so a server brought back answers the old links)."""
    try:
        return int(json.loads(_entry(home).read_text())["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def homes() -> list[Path]:
    """Every Prefect home flexmarl started a server in (entries whose home is gone are
    dropped)."""
    out = []
    for path in sorted(registry().glob("*.json")):
        try:
            home = Path(json.loads(path.read_text())["home"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if home.is_dir():
            out.append(home)
        else:
            path.unlink(missing_ok=True)
    return out


def find_home(api_url: str) -> Path | None:
    """The Prefect home whose running server answers at `api_url`, if flexmarl started one."""
    want = api_url.rstrip("/")
    for home in homes():
        own = our_server(home)
        if own is not None and own["url"].rstrip("/") == want:
            return home
    return None


# -- users and the idle clock ----------------------------------------------------------------
@contextlib.contextmanager
def lock(home: Path) -> Iterator[None]:
    home.mkdir(parents=True, exist_ok=True)
    with open(home / LOCK_FILE, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def start_lock() -> Iterator[None]:
    """Held while a server is started on this machine, from its port's choice to its health."""
    registry().mkdir(parents=True, exist_ok=True)
    with open(registry() / ".start.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _touch(path: Path) -> None:
    path.touch()
    os.utime(path)


_using: set[Path] = set()


def use(home: Path) -> None:
    """This process uses `home`'s server until it exits (the idle clock stops meanwhile). Call
    under `lock(home)`, with the server checked alive."""
    home = home.resolve()
    if home in _using:
        return
    users = home / USERS_DIR
    users.mkdir(parents=True, exist_ok=True)
    mine = users / f"{os.getpid()}-{_start_ticks(os.getpid())}"
    mine.write_text("")
    _touch(home / LAST_USED)
    _using.add(home)

    import atexit

    atexit.register(_leave, home, mine)


def _leave(home: Path, mine: Path) -> None:
    with contextlib.suppress(OSError):
        mine.unlink(missing_ok=True)
        _touch(home / LAST_USED)


def _alive_user(path: Path) -> bool:
    try:
        pid, start = path.name.split("-", 1)
        return start != "None" and _start_ticks(int(pid)) == int(start)
    except ValueError:
        return False


def idle_since(home: Path, *, tidy: bool = False) -> float | None:
    """Since when no process has used `home`'s server (epoch seconds); None while one does.
    `tidy`: users whose process died without leaving (kill -9) are removed, and the idle
    clock starts when that is noticed."""
    users = sorted((home / USERS_DIR).glob("*")) if (home / USERS_DIR).is_dir() else []
    live = [u for u in users if _alive_user(u)]
    if tidy and len(live) < len(users):
        for u in users:
            if u not in live:
                u.unlink(missing_ok=True)
        _touch(home / LAST_USED)
    if live:
        return None
    times = [float((read_pid_file(home) or {}).get("started", 0.0))]
    with contextlib.suppress(OSError):
        times.append((home / LAST_USED).stat().st_mtime)
    return max(times)


def watch(home: Path, idle_s: float, poll_s: float | None = None) -> None:
    """The watcher's loop (module docstring): stop `home`'s server once it has been idle for
    `idle_s`; return when the server is gone."""
    poll_s = poll_s if poll_s is not None else min(30.0, max(1.0, idle_s / 10))
    while True:
        time.sleep(poll_s)
        if our_server(home) is None:
            return
        with lock(home):
            since = idle_since(home, tidy=True)
            if since is not None and time.time() - since >= idle_s and our_server(home) is not None:
                stop_server(home)
                return


def start_watcher(home: Path, idle_s: float) -> None:
    """The watcher of `home`'s server, detached (it outlives the process that started it)."""
    subprocess.Popen([sys.executable, "-m", "flexmarl.servers", "--watch", str(home), "--idle-s", str(idle_s)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, cwd=str(Path(__file__).resolve().parents[1]))


# -- what the CLI shows ----------------------------------------------------------------------
def _minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"


def status() -> list[dict]:
    """Each running server flexmarl started: url, port, home, pid, users, idle seconds (None
    while in use) and its idle limit."""
    out = []
    for home in homes():
        own = our_server(home)
        if own is None:
            continue
        since = idle_since(home)
        users = [u for u in (home / USERS_DIR).glob("*") if _alive_user(u)] if (home / USERS_DIR).is_dir() else []
        out.append({"url": own["url"], "port": urlsplit(own["url"]).port, "home": str(home), "pid": own["pid"],
                    "users": len(users), "idle_s": None if since is None else time.time() - since,
                    "idle_limit_s": float(own.get("idle_s") or 0.0)})
    return out


def status_lines() -> list[str]:
    servers = status()
    if not servers:
        return ["no local Prefect server started by flexmarl is running"]
    lines = []
    for s in servers:
        if s["idle_s"] is None:
            use = f"in use by {s['users']} run(s)"
        else:
            use = f"idle {_minutes(s['idle_s'])}"
            if s["idle_limit_s"] > 0:
                use += f" (stops itself at {_minutes(s['idle_limit_s'])})"
        lines.append(f"port {s['port']}  pid {s['pid']}  {use}  Prefect home {s['home']}  "
                     f"UI {s['url'].removesuffix('/api')}")
    return lines


def stop_all() -> list[str]:
    """Stop every running server flexmarl started; a line for each."""
    lines = [stop_server(home) for home in homes() if our_server(home) is not None]
    return lines or ["no local Prefect server started by flexmarl is running"]


def idle_note(api_url: str) -> str:
    """` (it stops itself N min after its last run)` for a server flexmarl started with an
    idle limit; empty otherwise."""
    home = find_home(api_url)
    limit = float((our_server(home) or {}).get("idle_s") or 0.0) if home is not None else 0.0
    return f" (it stops itself {_minutes(limit)} after its last run)" if limit > 0 else ""


def ui_hint(api_url: str | None) -> str:
    """What the UI link of a run adds when its server is one flexmarl started that stops
    itself when idle: how long it stays, and how to bring it back."""
    home = find_home(api_url) if api_url else None
    if home is None:
        return ""
    limit = float((our_server(home) or {}).get("idle_s") or 0.0)
    if limit <= 0:
        return ""
    here = Path(os.environ.get("PREFECT_HOME") or Path.cwd() / ".prefect").resolve()
    start = "flexmarl server start" if home.resolve() == here else f"PREFECT_HOME={home} flexmarl server start"
    return f" (this local server stops itself {_minutes(limit)} after its last run; `{start}` brings it back)"


def _main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flexmarl.servers", description="a local server's idle watcher")
    ap.add_argument("--watch", required=True, metavar="HOME")
    ap.add_argument("--idle-s", type=float, required=True)
    args = ap.parse_args(argv)
    watch(Path(args.watch), args.idle_s)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
