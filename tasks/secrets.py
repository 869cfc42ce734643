"""`${secret:BLOCK}` config references: a Prefect Secret block's value, read from the Prefect
API at the moment the value is used (`flexmarl_core.config.secrets`). `install` registers the
resolver in this process; the CLI and the training flow call it when they start."""

from __future__ import annotations

import json
from typing import Any

from flexmarl_core.config import ExperimentConfig
from flexmarl_core.config.cluster import TLSFilesConfig
from flexmarl_core.config.secrets import Unresolved, references, register, resolve, resolve_map


def _secret_block(name: str) -> str:
    """The value of the Secret block `name` on the current Prefect API, as text (a JSON
    value stored in the block comes back as its JSON)."""
    from prefect.blocks.system import Secret
    from prefect.settings import PREFECT_API_URL

    try:
        block: Any = Secret.load(name)
    except ValueError:  # Prefect's "Unable to find block document named ..."
        raise Unresolved(f"names no Prefect Secret block on the API at {PREFECT_API_URL.value()} "
                         f"(save one: Secret(value=...).save({name!r}))") from None
    except Exception as exc:  # the API unreachable or refusing: its type only, the URL is said
        raise Unresolved(f"could not be read from the Prefect API at {PREFECT_API_URL.value()} "
                         f"({type(exc).__name__})") from None
    # The stored text itself, not `.get()`: that parses JSON-looking text ("123" -> 123).
    value = block.value.get_secret_value()
    return value if isinstance(value, str) else json.dumps(value)


def install() -> None:
    """Resolve `${secret:...}` references in this process from the Prefect API."""
    register("secret", _secret_block)


def check_references(cfg: ExperimentConfig) -> None:
    """Resolve, now, every reference of the fields that take them and drop the values: an
    unset variable or a missing block fails before a run folder or a cluster exists, as a
    `SecretError` naming the field."""
    install()
    if cfg.cluster.address is None:  # worker_env is only used for a cluster flexmarl starts
        resolve_map(cfg.cluster.worker_env, "cluster.worker_env")
    tls = cfg.cluster.security
    if isinstance(tls, TLSFilesConfig):  # certificates may be PEM text held by reference
        for field in ("ca_file", "cert_file", "key_file"):
            value = getattr(tls, field)
            if value and references(value):
                resolve(value, f"cluster.security.{field}")
