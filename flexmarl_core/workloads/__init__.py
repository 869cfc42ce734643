"""Workloads: problems, rule-based rewards and demonstrations for a team.

    from flexmarl_core.workloads import make_workload
    wl = make_workload(cfg.workload, cfg.team)
    batch = wl.problems("train", n=8, seed=cfg.seed, offset=8 * iteration)
    rewards = wl.reward(batch[0], {"planner": "7*2", "solver": "14", "verifier": "14"})

Kinds (`workload.kind`): ``arithmetic`` (synthetic, for tiny CPU models; the default),
``longtail`` (running sums whose written working grows with the problem, a long-tail
length distribution), ``dataset`` (JSONL / Parquet + field mapping), ``callable`` (a user
function yields problems), ``gsm8k``, ``code`` (a coder -> tester team rewarded by running the code in the
sandbox), ``calculator`` (a planner -> solver team over MEG rounds, the solver calling a
calculator tool inside its responses). Any kind takes user reward callables (`workload.reward`,
`workload.agent_rewards`). Contracts are in `api`; reward shape in `api`'s docstring.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flexmarl_core.config import TeamConfig, WorkloadConfig
from flexmarl_core.meg import MEG
from flexmarl_core.workloads.answers import MatchMode
from flexmarl_core.workloads.api import (
    SPLITS,
    Problem,
    Split,
    SupportsPerturbation,
    Workload,
    WorkloadError,
)
from flexmarl_core.workloads.arithmetic import ArithmeticWorkload
from flexmarl_core.workloads.base import AnswerPoolWorkload, PoolWorkload, RuleWorkload
from flexmarl_core.workloads.calculator import CalculatorWorkload
from flexmarl_core.workloads.callables import (
    CallableRef,
    CallableWorkload,
    RewardCallable,
    load_callable,
)
from flexmarl_core.workloads.code import CodeWorkload
from flexmarl_core.workloads.dataset import DatasetWorkload, GSM8KWorkload, gsm8k_path, resolve_path
from flexmarl_core.workloads.longtail import LongTailWorkload

__all__ = [
    "SPLITS",
    "AnswerPoolWorkload",
    "ArithmeticWorkload",
    "CalculatorWorkload",
    "CallableRef",
    "CallableWorkload",
    "CodeWorkload",
    "DatasetWorkload",
    "GSM8KWorkload",
    "LongTailWorkload",
    "PoolWorkload",
    "Problem",
    "RewardCallable",
    "RuleWorkload",
    "Split",
    "SupportsPerturbation",
    "Workload",
    "WorkloadError",
    "load_callable",
    "make_workload",
]

_P = TypeVar("_P", bound=BaseModel)
_DEFAULT_FIELDS = WorkloadConfig.model_fields["fields"].default_factory()  # type: ignore[misc]


class _PoolParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    heldout_fraction: float = Field(
        0.2, ge=0.0, lt=1.0, description="Share of unpinned problems (hash of text) held out."
    )
    match: MatchMode = Field(
        "auto",
        description="Answer matching: auto (numeric if the answer is a number), numeric, exact.",
    )


class _DatasetParams(_PoolParams):
    heldout_path: str | None = Field(
        None,
        description="Optional second file whose rows are all held-out (same fields); every row "
        "of workload.path is then train.",
    )


class _CallableParams(_PoolParams):
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the problem callable."
    )


def _params(model: type[_P], cfg: WorkloadConfig) -> _P:
    try:
        return model.model_validate(cfg.params)
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        valid = sorted(model.model_fields)
        raise WorkloadError(
            f"workload.params for kind={cfg.kind}: {msgs} (valid keys: {valid})"
        ) from None


def _unused(cfg: WorkloadConfig, *names: str) -> None:
    """Fail on keys that this kind ignores, so a misplaced `path` is not silently unused."""
    for name in names:
        value = getattr(cfg, name)
        unset = value is None if name != "fields" else value == _DEFAULT_FIELDS
        if not unset:
            raise WorkloadError(f"workload.{name} is not used by kind={cfg.kind}; remove it")


def _arithmetic(cfg: WorkloadConfig, common: dict[str, Any], base_dir: Any) -> RuleWorkload:
    _unused(cfg, "path", "callable", "fields")
    return ArithmeticWorkload(params=cfg.params, **common)


def _longtail(cfg: WorkloadConfig, common: dict[str, Any], base_dir: Any) -> RuleWorkload:
    _unused(cfg, "path", "callable", "fields")
    return LongTailWorkload(params=cfg.params, **common)


def _code(cfg: WorkloadConfig, common: dict[str, Any], base_dir: Any) -> RuleWorkload:
    _unused(cfg, "path", "callable", "fields")
    return CodeWorkload(params=cfg.params, **common)


def _calculator(cfg: WorkloadConfig, common: dict[str, Any], base_dir: Any) -> RuleWorkload:
    _unused(cfg, "path", "callable", "fields")
    return CalculatorWorkload(params=cfg.params, **common)


def _dataset(cfg: WorkloadConfig, common: dict[str, Any], base_dir: Any) -> RuleWorkload:
    _unused(cfg, "callable")
    if cfg.path is None:
        raise WorkloadError("kind=dataset needs workload.path (a .jsonl or .parquet file)")
    p = _params(_DatasetParams, cfg)
    if p.heldout_path and "heldout_fraction" in cfg.params:
        raise WorkloadError(
            f"workload.params.heldout_fraction={p.heldout_fraction} has no effect with "
            f"params.heldout_path ({p.heldout_path}): the held-out set is that file and "
            "workload.path is all train; remove one of them"
        )
    heldout = resolve_path(p.heldout_path, base_dir) if p.heldout_path else None
    return DatasetWorkload(
        path=resolve_path(cfg.path, base_dir),
        fields=cfg.fields,
        heldout_path=heldout,
        heldout_fraction=p.heldout_fraction,
        match=p.match,
        **common,
    )


def _gsm8k(cfg: WorkloadConfig, common: dict[str, Any], base_dir: Any) -> RuleWorkload:
    _unused(cfg, "callable")
    p = _params(_PoolParams, cfg)
    return GSM8KWorkload(
        path=gsm8k_path(cfg.path, base_dir),
        fields=cfg.fields,
        heldout_fraction=p.heldout_fraction,
        match="numeric" if p.match == "auto" else p.match,
        **common,
    )


def _callable(cfg: WorkloadConfig, common: dict[str, Any], base_dir: Any) -> RuleWorkload:
    _unused(cfg, "path", "fields")
    if cfg.callable is None:
        raise WorkloadError(
            "kind=callable needs workload.callable ('module:function' yielding problems)"
        )
    p = _params(_CallableParams, cfg)
    return CallableWorkload(
        source=CallableRef(cfg.callable, base_dir=base_dir, key="callable"),
        kwargs=p.kwargs,
        heldout_fraction=p.heldout_fraction,
        match=p.match,
        **common,
    )


_BUILDERS: dict[str, Callable[[WorkloadConfig, dict[str, Any], Any], RuleWorkload]] = {
    "arithmetic": _arithmetic,
    "dataset": _dataset,
    "gsm8k": _gsm8k,
    "callable": _callable,
    "code": _code,
    "longtail": _longtail,
    "calculator": _calculator,
}


def make_workload(
    cfg: WorkloadConfig,
    team: TeamConfig,
    *,
    base_dir: str | os.PathLike[str] | None = None,
) -> RuleWorkload:
    """Build the workload that `cfg` describes for `team`.

    `base_dir` is where relative paths and `module:function` callables are resolved (default:
    the working directory). Everything that can be checked up front is: callables are
    imported and a dataset is read here, so a bad config fails before any rollout.
    """
    if cfg.kind not in _BUILDERS:
        raise WorkloadError(f"unknown workload.kind {cfg.kind!r}; valid: {sorted(_BUILDERS)}")
    meg = MEG.from_config(team)
    if meg.output is None:  # validate() always sets it; narrow the type
        raise WorkloadError("the team has no output agent; set team.output")
    team_reward = None
    if cfg.reward is not None:
        team_reward = RewardCallable(cfg.reward, base_dir=base_dir, key="reward").load()
    agent_rewards = {
        agent: RewardCallable(spec, base_dir=base_dir, key=f"agent_rewards.{agent}").load()
        for agent, spec in cfg.agent_rewards.items()
    }
    common: dict[str, Any] = {
        "agents": meg.agent_names,
        "output_agent": meg.output,
        "credit": cfg.credit,
        "format_weight": cfg.format_weight,
        "team_reward": team_reward,
        "agent_rewards": agent_rewards,
    }
    if cfg.kind == "calculator":
        common["rounds"] = None if team.program else team.rounds  # a program runs its own loop
    workload = _BUILDERS[cfg.kind](cfg, common, base_dir)
    _check_tool_backends(workload, team)
    if isinstance(workload, PoolWorkload):
        workload.pools()  # read the data now: bad rows fail at startup, not mid-run
    return workload


def _check_tool_backends(workload: RuleWorkload, team: TeamConfig) -> None:
    """A tool loop needs an engine that continues from token ids (`inference/tools.py`): the
    HF engine. vLLM is refused here, at config load, rather than mid-rollout."""
    get = getattr(workload, "tool", None)
    for agent in team.agents:
        if get is not None and get(agent.name) is not None and agent.backend.inference != "hf":
            raise WorkloadError(
                f"agent {agent.name!r} calls a tool (workload.kind={type(workload).__name__}), "
                f"which backend.inference={agent.backend.inference!r} does not support: the tool "
                f"loop runs on the hf engine; set team.agents.{agent.name}.backend.inference=hf"
            )
