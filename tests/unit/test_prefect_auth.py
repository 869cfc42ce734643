"""The local Prefect server flexmarl starts demands an auth string: it lives in a file only its
user can read (never in the pid file, the servers' registry or the log), a request or Prefect
client without it is refused, the processes of the server's own user pick it up, a CLI without
it says in one line how to pass it, and a restarted server keeps it. One real server for the
module (`flexmarl server start` in a temporary Prefect home)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flexmarl import servers
from flexmarl.prefect_api import _auth_string, auth_file, our_server, stop_server

REPO = Path(__file__).resolve().parents[2]


def _env(home: Path, cache: Path, **extra: str) -> dict[str, str]:
    """A process of the server's user, given no API and no auth (as a fresh shell would be)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_SERVER_API"))}
    return {**env, "PREFECT_HOME": str(home), "FLEXMARL_CACHE": str(cache), "PYTHONPATH": str(REPO),
            servers.IDLE_ENV: "0", **extra}


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("auth")
    home, cache = root / "prefect", root / "cache"
    res = _run([sys.executable, "-m", "flexmarl.cli", "server", "start"], _env(home, cache))
    try:
        assert res.returncode == 0, res.stdout + res.stderr[-3000:]
        own = our_server(home)
        assert own is not None
        yield {"home": home, "cache": cache, "url": own["url"], "pid": own["pid"], "start_out": res.stdout}
    finally:
        stop_server(home)


def _secret(server: dict) -> str:
    return auth_file(server["home"]).read_text().strip()


def _basic(auth: str) -> dict[str, str]:
    """The header Prefect's client sends for PREFECT_API_AUTH_STRING."""
    return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}


def test_the_auth_string_is_in_a_file_only_its_user_reads_and_nowhere_else(server):
    home, secret = server["home"], _secret(server)
    path = auth_file(home)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(secret) >= 40  # token_urlsafe(32)
    assert servers.server_auth(server["pid"]) == secret  # the one the server demands
    assert f"is in {path}" in server["start_out"] and secret not in server["start_out"]
    entries = list((server["cache"] / "servers").glob("*.json"))
    assert len(entries) == 1
    for where in (home / servers.PID_FILE, entries[0], home / "server.log"):
        assert secret not in where.read_text(), where
    # the server's database and log hold the runs too: its user's alone
    for name in ("prefect.db", "server.log"):
        assert stat.S_IMODE((home / name).stat().st_mode) & 0o077 == 0, name


def test_a_request_without_it_is_refused_and_flexmarls_health_probe_still_answers(server):
    url, secret = server["url"], _secret(server)
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/health").status_code == 200  # unauthenticated, as `_healthy` asks it
        assert http.get("/admin/version").status_code == 401
        assert http.get("/admin/version", headers=_basic("not-" + secret)).status_code == 401
        assert http.post("/flow_runs/filter", json={}).status_code in (401, 403)  # 403: no CSRF token
        # a write needs the CSRF token too, which only a client with the auth string can get
        assert http.get("/csrf-token", params={"client": "t"}).status_code == 401
        got = http.get("/csrf-token", params={"client": "t"}, headers=_basic(secret))
        assert got.status_code == 200, got.text
        csrf = {"Prefect-Csrf-Token": got.json()["token"], "Prefect-Csrf-Client": "t"}
        assert http.post("/flow_runs/filter", json={}, headers=csrf).status_code == 401
        ok = http.post("/flow_runs/filter", json={}, headers={**csrf, **_basic(secret)})
        assert ok.status_code == 200 and ok.json() == [], ok.text


def test_a_prefect_client_without_it_is_refused(server):
    from prefect import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    async def make_flow() -> object:
        async with get_client() as client:  # a write: the CSRF token is fetched first
            return await client.create_flow_from_name("auth-probe")

    with temporary_settings(updates={PREFECT_API_URL: server["url"], PREFECT_API_AUTH_STRING: None}):
        with pytest.raises(PrefectHTTPStatusError, match="401"):
            asyncio.run(make_flow())
    with temporary_settings(updates={PREFECT_API_URL: server["url"], PREFECT_API_AUTH_STRING: _secret(server)}):
        assert asyncio.run(make_flow())


def test_the_servers_own_user_picks_it_up_for_itself_and_what_it_starts(server):
    """`ensure_api` given the server's URL (as `cluster.prefect_api_url`), then with no URL at
    all (this Prefect home's server), puts the string in the process's environment, over a
    stale one there; a subprocess, as a Dask worker is, inherits it and is served."""
    code = (
        "import hashlib, json, os, subprocess, sys\n"
        "from flexmarl.prefect_api import ensure_api\n"
        f"url = {server['url']!r}\n"
        "got = [ensure_api(url)]\n"
        "have = [hashlib.sha256(os.environ['PREFECT_API_AUTH_STRING'].encode()).hexdigest()]\n"
        "del os.environ['PREFECT_API_AUTH_STRING'], os.environ['PREFECT_API_URL']\n"
        "import prefect.context; prefect.context.refresh_global_settings_context()  # as a fresh process\n"
        "got.append(ensure_api(None))\n"
        "have.append(hashlib.sha256(os.environ['PREFECT_API_AUTH_STRING'].encode()).hexdigest())\n"
        "child = ('import asyncio\\nfrom prefect import get_client\\n'\n"
        "         'async def m():\\n    async with get_client() as c:\\n        await c.read_flow_runs()\\n'\n"
        "         'asyncio.run(m())')\n"
        "rc = subprocess.run([sys.executable, '-c', child]).returncode\n"
        "print(json.dumps({'got': got, 'have': have, 'child': rc}))\n"
    )
    res = _run([sys.executable, "-c", code], _env(server["home"], server["cache"], PREFECT_API_AUTH_STRING="stale"))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    import hashlib

    want = hashlib.sha256(_secret(server).encode()).hexdigest()
    assert out["got"] == [[server["url"], False], [server["url"], False]]
    assert out["have"] == [want, want]
    assert out["child"] == 0
    assert _secret(server) not in res.stdout + res.stderr


@pytest.mark.parametrize("given", [None, "a-wrong-string"])
def test_the_cli_without_the_right_string_says_how_to_pass_it_in_one_line(server, tmp_path, given):
    """Another account (its own registry; it cannot read the server's file) points
    `flexmarl train` at the server: one line naming PREFECT_API_AUTH_STRING and the file, exit
    2, no traceback, and no run folder made."""
    extra = {"PREFECT_API_URL": server["url"], **({"PREFECT_API_AUTH_STRING": given} if given else {})}
    env = _env(server["home"], tmp_path / "their-cache", **extra)
    run_dir = tmp_path / "run"
    res = _run([sys.executable, "-m", "flexmarl.cli", "train", "configs/tiny.yaml", "--set", f"run_dir={run_dir}",
                "--no-progress"], env)
    assert res.returncode == 2, res.stdout + res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, res.stderr[-3000:]
    assert "401 Unauthorized" in lines[0] and "PREFECT_API_AUTH_STRING" in lines[0], lines[0]
    assert str(auth_file(server["home"])) in lines[0] and _secret(server) not in res.stderr + res.stdout
    assert not run_dir.exists()


def test_a_restarted_server_keeps_its_string(server):
    """Last in the module: it restarts the module's server."""
    home, secret = server["home"], _secret(server)
    assert stop_server(home).startswith("stopped the server")
    res = _run([sys.executable, "-m", "flexmarl.cli", "server", "start"], _env(home, server["cache"]))
    assert res.returncode == 0 and res.stdout.startswith("started"), res.stdout + res.stderr[-3000:]
    own = our_server(home)
    assert own is not None and own["pid"] != server["pid"]
    assert _secret(server) == secret and servers.server_auth(own["pid"]) == secret


def test_the_auth_file_is_made_private_and_replaced_once_others_could_read_it(tmp_path):
    first = _auth_string(tmp_path)
    path = auth_file(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text().strip() == first
    assert _auth_string(tmp_path) == first  # kept for the next start
    path.chmod(0o644)  # readable by others: no longer a secret
    second = _auth_string(tmp_path)
    assert second != first and stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text("\n")
    assert _auth_string(tmp_path) not in ("", second)
    assert [p.name for p in tmp_path.iterdir()] == [servers.AUTH_FILE]  # no temporary file left
