"""Cheap Prefect reporting from processes flexmarl starts: the local server's batching and the
workers' Prefect settings.

Stage ops do not run Prefect's task engine in the workers (`tasks/task_runs.py`), so workers
talk to Prefect only if user code in them does (a custom reward logging to Prefect). That code
gets lean settings (measured: ~0.43 CPU-s per worker-side task run stock, ~0.08 lean):

- Each worker-side Prefect client builds an SSL context from the 230 KB CA bundle, even for a
  plain-http API (~50 ms here). For an http API we point `PREFECT_API_SSL_CERT_FILE` at a
  one-certificate file (never for https, where it would break verification of the real
  server).
- Those variables reach a worker through a worker plugin, in every worker, restarted ones
  included: it sets them and rebuilds Prefect's global settings, which the spawned process
  built from the parent's environment when it imported Prefect (re-importing `__main__` does).
  Not through the nanny's `env`: the cluster may start before the launch reaches its API.
- `server_env` batches the local server's task-run recorder and event persister: the task-run
  events the flow sends (several per op) are written in batches.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import certifi
import prefect.context as _pctx
from distributed import Client, WorkerPlugin

from storage.atomic import atomic_file


def _one_cert_file() -> str:
    text = Path(certifi.where()).read_text()
    end = "-----END CERTIFICATE-----"
    first = text[text.index("-----BEGIN CERTIFICATE-----") : text.index(end) + len(end)]
    path = Path(os.environ.get("FLEXMARL_CACHE", Path.home() / ".cache" / "flexmarl")) / "one-ca.pem"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != first + "\n":
        with atomic_file(path) as f:
            f.write(f"{first}\n".encode())
    return str(path)


def worker_env(api_url: str) -> dict[str, str]:
    """Environment for worker processes so they report to `api_url` cheaply."""
    env = {"PREFECT_API_URL": api_url, "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING"}
    if api_url.startswith("http://"):
        env["PREFECT_API_SSL_CERT_FILE"] = _one_cert_file()
    return env


def api_env(api_url: str | None, *, cheap: bool, local: bool) -> dict[str, str]:
    """What the run's workers need of this process's Prefect settings, given to them by a plugin
    (`refresh_worker_settings`): a local cluster starts before the launch has reached its API
    (`flexmarl_core.cluster.workers.start_ahead`), so the API's URL and auth string, set in this
    process's environment since, did not reach them as an inherited environment; and the lean
    settings (`worker_env`) where they report cheaply. Workers of a scheduler address get only
    the lean settings, as before: this process's auth string is not sent to other machines."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PREFECT_")} if local else {}
    if cheap and api_url:
        env.update(worker_env(api_url))
    return env


def server_env() -> dict[str, str]:
    """Settings for a local `prefect server start`: batch the task-run recorder and event
    persister (task runs show up to ~1 s later), quieter logs, and CSRF tokens demanded of
    every write (Prefect's clients and UI fetch them; its auth string: `flexmarl.prefect_api`)."""
    return {
        "PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED": "true",
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "50",
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "50",
        "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "200",
        "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_READ_BATCH_SIZE": "50",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
    }


class FreshPrefectSettings(WorkerPlugin):
    """Set `env` in a worker (every worker, restarted ones included) and rebuild Prefect's
    global settings from it."""

    name = "flexmarl-fresh-prefect-settings"

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def setup(self, worker: Any) -> None:
        os.environ.update(self.env)
        _pctx.refresh_global_settings_context()


def refresh_worker_settings(client: Client, env: dict[str, str]) -> None:
    """The workers report to Prefect with `env` (`worker_env`) from now on: set by a plugin
    rather than at spawn, so a cluster can start before the launch has reached its API."""
    client.register_plugin(FreshPrefectSettings(env))
