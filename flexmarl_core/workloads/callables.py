"""User code named in the config: reward callables and problem sources.

A callable is named ``module:function`` (``module.sub:Class.method`` works too) or
``path/to/file.py:function``:

* ``module:function`` is imported the way Python would from the run's base folder (the
  folder `flexmarl` was started in, unless `make_workload(base_dir=...)` says otherwise):
  that folder is put on ``sys.path`` first, so ``examples.custom_team.reward:score`` works
  from the repository root, and a user's module can import its siblings.
* ``file.py:function`` loads that file directly (relative to the base folder), for code
  that is not laid out as a package.

Contracts (see ``examples/custom_team/reward.py``)::

    def score(problem: Problem, outputs: dict[str, str]) -> float   # reward / agent_rewards
    def make_problems(**params.kwargs) -> Iterable[dict | Problem]  # kind: callable

A reward returns a number (bool counts as 0/1), normally in 0..1 where 1 is full marks.
Anything that goes wrong (import, a raise, a non-number) stops the run with an error naming
the callable, the config key and, for rewards, the sample's `input_id`: a silently-zero
reward would train the team on garbage.

Loaded functions are cached per process and dropped when pickled; a Dask worker re-imports
them by name, so user code must be importable there too (same base folder on a shared
filesystem, or an installed package).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Self

from flexmarl_core.workloads.api import Problem, WorkloadError
from flexmarl_core.workloads.base import AnswerPoolWorkload


def _base(base_dir: str | os.PathLike[str] | None) -> Path:
    return Path(base_dir) if base_dir is not None else Path.cwd()


def load_callable(
    spec: str, *, base_dir: str | os.PathLike[str] | None = None, key: str = "callable"
) -> Callable[..., Any]:
    """Import ``module:function`` or ``file.py:function``; `key` names the config field."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise WorkloadError(
            f"workload.{key}={spec!r} must look like 'module:function' or 'path/file.py:function'"
        )
    base = _base(base_dir).resolve()
    try:
        if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
            module = _load_file(base / module_name)
        else:
            if str(base) not in sys.path:
                sys.path.insert(0, str(base))
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise WorkloadError(
            f"workload.{key}: cannot import {spec!r}: {type(exc).__name__}: {exc} "
            f"(modules are imported with {base} on sys.path; files resolve against it)"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise WorkloadError(
                f"workload.{key}: {spec!r}: {getattr(obj, '__name__', obj)!r} has no attribute "
                f"{part!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise WorkloadError(f"workload.{key}: {spec!r} is a {type(obj).__name__}, not a callable")
    return obj


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"no such file {path}")
    # One stable module name per file, so loading twice returns the same module.
    name = f"_flexmarl_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def as_score(value: Any) -> float | None:
    """A reward callable's result as a finite float (numpy scalars too), else None."""
    if isinstance(value, numbers.Real):
        f = float(value)
        return f if math.isfinite(f) else None
    return None


class CallableRef:
    """A named callable, loaded on first use and re-imported after unpickling."""

    def __init__(
        self, spec: str, *, base_dir: str | os.PathLike[str] | None = None, key: str = "callable"
    ) -> None:
        self.spec = spec
        self.key = key
        self.base_dir = str(_base(base_dir).resolve())
        self._fn: Callable[..., Any] | None = None

    @property
    def fn(self) -> Callable[..., Any]:
        """The function, imported on first use in this process."""
        if self._fn is None:
            self._fn = load_callable(self.spec, base_dir=self.base_dir, key=self.key)
        return self._fn

    def load(self) -> Self:
        """Import now (so a typo fails at startup, not at the first reward); returns self."""
        self.fn  # noqa: B018 -- the property imports and caches
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fn": None}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, key={self.key!r})"


class RewardCallable(CallableRef):
    """`workload.reward` or one of `workload.agent_rewards`: `(problem, outputs) -> float`."""

    def __call__(self, problem: Problem, outputs: Mapping[str, str]) -> float:
        try:
            value = self.fn(problem, dict(outputs))
        except WorkloadError:
            raise
        except Exception as exc:
            raise WorkloadError(
                f"reward callable {self.spec!r} (workload.{self.key}) raised "
                f"{type(exc).__name__}: {exc} on sample input_id={problem.input_id!r}"
            ) from exc
        score = as_score(value)
        if score is None:
            raise WorkloadError(
                f"reward callable {self.spec!r} (workload.{self.key}) returned "
                f"{type(value).__name__} {value!r} on sample input_id={problem.input_id!r}; "
                "expected a finite number (float, int or bool)"
            )
        return score


_TEXT_KEYS = ("input", "text", "question")
_ID_KEYS = ("id", "input_id")


def problem_from_item(item: Any, *, index: int, where: str) -> Problem:
    """One item yielded by a problem callable -> Problem (see module docstring for keys)."""
    if isinstance(item, Problem):
        return item
    if not isinstance(item, Mapping):
        raise WorkloadError(
            f"{where}: item {index} is a {type(item).__name__}; expected a dict or a Problem"
        )
    text_key = next((k for k in _TEXT_KEYS if k in item), None)
    if text_key is None or "answer" not in item:
        raise WorkloadError(
            f"{where}: item {index} needs an input ({' / '.join(_TEXT_KEYS)}) and an 'answer'; "
            f"it has keys {sorted(map(str, item))}"
        )
    id_key = next((k for k in _ID_KEYS if k in item), None)
    input_id = str(item[id_key]) if id_key else f"c{index}"
    meta = dict(item.get("meta") or {})
    meta.update({k: v for k, v in item.items() if k not in {text_key, id_key, "answer", "meta"}})
    try:
        return Problem(input_id, str(item[text_key]), str(item["answer"]), meta)
    except WorkloadError as exc:
        raise WorkloadError(f"{where}: item {index}: {exc}") from None


class CallableWorkload(AnswerPoolWorkload):
    """`kind: callable`: problems come from a user function, called once per process with
    `params.kwargs`; scored by answer matching like `kind: dataset` (or by your reward).

    A dict item may carry `meta: {demo: {agent: text}}` to give agents their own
    demonstrations, and `split: train|heldout` to pin its split.
    """

    def __init__(
        self,
        agents: list[str],
        output_agent: str,
        source: CallableRef,
        *,
        kwargs: Mapping[str, Any] | None = None,
        **rest: Any,
    ) -> None:
        super().__init__(agents, output_agent, **rest)
        self.ref = source
        self.kwargs = dict(kwargs or {})

    @property
    def source(self) -> str:
        return f"problem callable {self.ref.spec!r}"

    def load(self) -> list[Problem]:
        where = f"{self.source} (workload.callable)"
        try:
            items: Iterable[Any] = self.ref.fn(**self.kwargs)
            items = list(items)
        except WorkloadError:
            raise
        except Exception as exc:
            raise WorkloadError(f"{where} raised {type(exc).__name__}: {exc}") from exc
        return [problem_from_item(item, index=i, where=where) for i, item in enumerate(items)]
