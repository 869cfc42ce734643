"""flexmarl talks only to the Prefect server it started (its pid file names the pid, URL and a
token the server process carries) or to the one PREFECT_API_URL names: another checkout's
server on the default port is never used, and `server stop` signals nothing but its own."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

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


