"""flexmarl talks only to the Prefect server it started (its pid file names the pid, URL and a
token the server process carries) or to the one PREFECT_API_URL names: another checkout's
server on the default port is never used, and `server stop` signals nothing but its own. The
servers flexmarl started, in any Prefect home, are listed and stopped together, and stop
themselves once idle."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"true")

    def log_message(self, *args: object) -> None:
        pass


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    return {**env, "PREFECT_HOME": str(home), "PYTHONPATH": str(REPO)}


def test_a_healthy_server_that_is_not_ours_is_never_used(tmp_path):
    foreign = http.server.HTTPServer(("127.0.0.1", 0), _Health)  # another checkout's server
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    port = foreign.server_address[1]
    home = tmp_path / "prefect"
    code = ("import json, flexmarl.prefect_api as p\n"
            f"p.DEFAULT_PORT = {port}\n"
            "url, started = p.ensure_api(None)\n"
            "again = p.ensure_api(None)\n"
            "print(json.dumps([url, started, again[0], again[1], p.stop_server()]))\n")
    try:
        res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(home), capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        url, started, again, started_again, stopped = json.loads(res.stdout.strip().splitlines()[-1])
        assert started and f":{port}/" not in url  # its own server, on another port
        assert again == url and not started_again  # the next run reuses it, checked by its token
        assert stopped.startswith("stopped the server")
    finally:
        foreign.shutdown()


def test_server_stop_signals_nothing_but_its_own_server(tmp_path):
    home = tmp_path / "prefect"
    home.mkdir()
    bystander = subprocess.Popen(["sleep", "120"], start_new_session=True)  # a reused pid
    try:
        for content in (json.dumps({"pid": bystander.pid, "url": "http://127.0.0.1:1/api", "token": "t"}),
                        f"{bystander.pid}\nhttp://127.0.0.1:1/api\n"):  # the older format too
            (home / "flexmarl-server.pid").write_text(content)
            res = subprocess.run([sys.executable, "-m", "flexmarl.cli", "server", "stop"], cwd=REPO,
                                 env=_env(home), capture_output=True, text=True, timeout=60)
            assert res.returncode == 0 and "nothing signalled" in res.stdout, res.stdout + res.stderr
            assert bystander.poll() is None  # still alive
            assert not (home / "flexmarl-server.pid").exists()
    finally:
        os.killpg(bystander.pid, signal.SIGKILL)
        bystander.wait()




def _cli(args: list[str], home: Path, cache: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {**_env(home), "FLEXMARL_CACHE": str(cache), **extra}
    return subprocess.run([sys.executable, "-m", "flexmarl.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_servers_of_two_prefect_homes_are_listed_stop_themselves_when_idle_and_stop_all(tmp_path, monkeypatch):
    """Two Prefect homes, a real server each: `server status` lists both (port, home, pid, in
    use or idle); the one with an idle limit stops itself once its last user leaves, and
    `server start` brings it back on its old port (the links printed before work again);
    `server stop --all` stops every one."""
    import time

    from flexmarl import servers
    from flexmarl.prefect_api import local_server, our_server

    cache, a, b = tmp_path / "cache", tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv("FLEXMARL_CACHE", str(cache))
    monkeypatch.setenv(servers.IDLE_ENV, "3")
    got: dict = {}
    # b's server in this process, which uses it (a run would); a's from the CLI, never idle-stopped.
    starter = threading.Thread(target=lambda: got.update(b=local_server(b)))
    starter.start()
    res = _cli(["server", "start"], a, cache, **{servers.IDLE_ENV: "0"})
    starter.join()
    try:
        assert res.returncode == 0 and res.stdout.startswith("started the local Prefect server at "), res.stderr[-2000:]
        url_b, started_b = got["b"]
        assert started_b
        pids = {h: our_server(h)["pid"] for h in (a, b)}
        res = _cli(["server", "status"], a, cache)
        lines = res.stdout.strip().splitlines()
        assert res.returncode == 0 and len(lines) == 2, res.stdout + res.stderr
        line_a, line_b = (next(x for x in lines if f"Prefect home {h}" in x) for h in (a, b))
        assert f"pid {pids[a]}" in line_a and " idle " in line_a and "stops itself" not in line_a, line_a
        assert f"pid {pids[b]}" in line_b and "in use by 1 run" in line_b, line_b
        assert f"port {urlsplit(url_b).port}" in line_b
        # Its user leaves: b's watcher stops it after 3 s idle (bounded wait: it polls each second).
        servers._leave(b.resolve(), next((b / servers.USERS_DIR).iterdir()))
        deadline = time.monotonic() + 120
        while our_server(b) is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert our_server(b) is None, "the idle server did not stop itself"
        listed = [x for x in _cli(["server", "status"], a, cache).stdout.splitlines() if "Prefect home" in x]
        assert len(listed) == 1 and f"Prefect home {a}" in listed[0], listed
        res = _cli(["server", "start"], b, cache, **{servers.IDLE_ENV: "600"})
        assert res.returncode == 0 and urlsplit(url_b).netloc in res.stdout and "stops itself 10 min after" in res.stdout, \
            res.stdout + res.stderr
        res = _cli(["server", "stop", "--all"], a, cache)
        assert res.returncode == 0 and len(res.stdout.strip().splitlines()) == 2, res.stdout + res.stderr
        assert all(line.startswith("stopped the server") for line in res.stdout.strip().splitlines())
        assert our_server(a) is None and our_server(b) is None
        assert "no local Prefect server" in _cli(["server", "status"], a, cache).stdout
    finally:
        for h in (a, b):
            servers.stop_server(h, signal.SIGKILL)
