"""Cheap Prefect reporting from processes flexmarl starts: the local server's batching and the
workers' Prefect settings.

Stage ops do not run Prefect's task engine in the workers (`tasks/task_runs.py`), so workers
talk to Prefect only if user code in them does (a custom reward logging to Prefect). That code
gets lean settings (measured: ~0.43 CPU-s per worker-side task run stock, ~0.08 lean):

- Each worker-side Prefect client builds an SSL context from the 230 KB CA bundle, even for a
  plain-http API (~50 ms here). For an http API we point `PREFECT_API_SSL_CERT_FILE` at a
  one-certificate file (never for https, where it would break verification of the real
  server).
- Those variables reach a worker through the nanny's `env`, which is applied after the spawned
  process has imported Prefect (re-importing `__main__` does) and built its settings from the
  parent's environment. A worker plugin rebuilds Prefect's global settings in every worker,
  restarted ones included, so the variables take effect.
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
    """Rebuild Prefect's global settings from the worker's environment when a worker starts."""

    name = "flexmarl-fresh-prefect-settings"

    def setup(self, worker: Any) -> None:
        _pctx.refresh_global_settings_context()


def refresh_worker_settings(client: Client) -> None:
    client.register_plugin(FreshPrefectSettings())
