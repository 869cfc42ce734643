"""Name -> function registries for advantage estimators and policy losses (verl style).

Registering a name twice is an error (a silent overwrite would change a run's algorithm by
import order); an unknown name lists the valid ones and the config key to fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])


class Registry(Generic[F]):
    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._items: dict[str, F] = {}
        self._meta: dict[str, dict[str, object]] = {}

    def register(self, name: str, **meta: object) -> Callable[[F], F]:
        """Decorator: `@register("grpo")`; `meta` is stored for `info(name)`."""

        def deco(fn: F) -> F:
            if name in self._items:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by "
                    f"{getattr(self._items[name], '__qualname__', self._items[name])}); "
                    "pick another name"
                )
            self._items[name] = fn
            self._meta[name] = dict(meta)
            return fn

        return deco

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r} ({self.config_key}); valid: {', '.join(self.names())}"
            ) from None

    def info(self, name: str) -> dict[str, object]:
        self.get(name)
        return dict(self._meta[name])

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items
