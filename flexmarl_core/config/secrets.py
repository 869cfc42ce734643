"""Secret references in config values: `${env:NAME}` (the environment variable NAME of the
process that uses the value) and `${secret:BLOCK}` (a Prefect Secret block's value).

A config keeps the reference text everywhere it is recorded (the run folder's config.yaml, the
Prefect flow run's parameters, logs): only the code that uses a value calls `resolve`, at that
moment, and hands the result on without storing it. A value may also embed references
(`https://user:${env:PW}@host`); text without one is a literal and is returned as it is.

The `env` kind is built in. Other kinds are registered by the process that can read them
(`register`): the flexmarl CLI and the training flow register `secret` (tasks/secrets.py),
since flexmarl_core never talks to Prefect. A reference that cannot be resolved is a
`SecretError` naming the field and the reference, never the value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping

from flexmarl_core.config.checks import ConfigError

#: `${kind:name}`: a kind is a word; a name is anything but braces
REFERENCE = re.compile(r"\$\{([A-Za-z][A-Za-z0-9_-]*):([^{}]*)\}")

#: kinds flexmarl knows, and where they come from (said when one has no resolver here)
KINDS = {
    "env": "the environment variable NAME of the process that uses the value",
    "secret": "a Prefect Secret block, read from the Prefect API by the flexmarl CLI and the training flow",
}


class SecretError(ConfigError):
    """A secret reference that cannot be resolved; the message names the field and the
    reference (never a value)."""


class Unresolved(LookupError):
    """Raised by a resolver: its message completes `<field>: <reference> ...` (`is not set`)."""


#: a resolver: the name inside the reference -> its value now; `Unresolved` when there is none
Resolver = Callable[[str], str]


def _env(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise Unresolved("is not set")
    return value


_RESOLVERS: dict[str, Resolver] = {"env": _env}


def register(kind: str, resolver: Resolver) -> None:
    """Resolve `${kind:...}` references with `resolver` in this process (a later call for
    the same kind replaces it)."""
    _RESOLVERS[kind] = resolver


def references(value: str) -> list[str]:
    """The reference texts in `value` (`['${env:S3_SECRET}']`), in order."""
    return [m.group(0) for m in REFERENCE.finditer(value)]


def resolve(value: str, field: str) -> str:
    """`value` with each reference replaced by what it names now; `field` (the dotted config
    path) names it in errors. A value without references is returned unchanged."""

    def one(m: re.Match[str]) -> str:
        ref, kind, name = m.group(0), m.group(1), m.group(2)
        resolver = _RESOLVERS.get(kind)
        if resolver is None:
            if kind in KINDS:
                raise SecretError(f"{field}: {ref}: this process cannot resolve {kind!r} references "
                                  f"({KINDS[kind]})")
            raise SecretError(f"{field}: {ref}: unknown reference kind {kind!r}; use "
                              "${env:NAME} or ${secret:BLOCK}")
        if not name.strip():
            raise SecretError(f"{field}: {ref} names nothing: write ${{{kind}:NAME}}")
        try:
            return resolver(name.strip())
        except Unresolved as exc:  # from None: a resolver's traceback never rides along
            raise SecretError(f"{field}: {ref} {exc}") from None

    return REFERENCE.sub(one, value)


def resolve_map(values: Mapping[str, str], field: str) -> dict[str, str]:
    """Each value of a mapping resolved (`cluster.worker_env`), its key named in errors."""
    return {key: resolve(value, f"{field}.{key}") for key, value in values.items()}
