"""Held-out evaluation of a team: the team answers a batch of problems on the given engines
(greedily, or sampling), as its shape runs it (`teams/`); the team is correct when the workload
says the output agent's answer is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexmarl_core.config import config_from_text
from flexmarl_core.runfiles.location import CONFIG_NAME, RunLocation, weights_key
from flexmarl_core.teams import TeamShape
from flexmarl_core.workloads.api import Problem, Workload

if TYPE_CHECKING:
    from flexmarl_core.config import ExperimentConfig


def evaluate_team(
    team: TeamShape,
    workload: Workload,
    engines: Mapping[str, Any],
    problems: Sequence[Problem],
    *,
    seed: int = 0,
    batch: int | None = None,
    greedy: bool = True,
) -> dict[str, Any]:
    """The team's answers to `problems`; returns accuracy, mean reward per agent, outputs.

    `batch`: decode at most this many problems at once, grouped by the length of the problem's
    text. A batch decodes until its longest row ends, so where the answer's length follows the
    question's (the long-tail team) one long problem no longer holds every short one up.
    None: all problems in one batch. `greedy=False`: every agent samples at its own `sampling`,
    seeded by `seed` plus the batch's first row (greedy decoding does not read the seed)."""
    if batch is not None and len(problems) > batch:
        order = sorted(range(len(problems)), key=lambda i: (len(problems[i].text), i))
        outs: list[dict[str, str]] = [{} for _ in problems]
        for k in range(0, len(order), batch):
            rows = order[k:k + batch]
            part = team.outputs(workload, engines, [problems[i] for i in rows], seed=seed + k, greedy=greedy)
            for i, o in zip(rows, part, strict=True):
                outs[i] = o
        return _scored(workload, problems, outs)
    return _scored(workload, problems, team.outputs(workload, engines, problems, seed=seed, greedy=greedy))


def _scored(workload: Workload, problems: Sequence[Problem], outputs: list[dict[str, str]]) -> dict[str, Any]:
    correct = [workload.is_correct(p, o) for p, o in zip(problems, outputs, strict=True)]
    rewards: dict[str, float] = {}
    for p, o in zip(problems, outputs, strict=True):
        for a, r in workload.reward(p, o).items():
            rewards[a] = rewards.get(a, 0.0) + r / len(problems)
    return {"accuracy": sum(correct) / max(len(correct), 1), "reward": rewards,
            "n": len(problems), "outputs": outputs}


def evaluation_iteration(run_dir: str | Path, iteration: int | None = None) -> tuple[ExperimentConfig, int]:
    """The run's config and the iteration whose weights to evaluate (default: the final one,
    `train.iterations`), after checking every agent's weights of that iteration were published.

    Raises FileNotFoundError naming the run folder or the missing weights file, with the
    versions that do exist (e.g. a run stopped early: evaluate one of those instead).
    """
    loc = RunLocation(run_dir)
    if not loc.is_file(CONFIG_NAME):
        raise FileNotFoundError(f"{loc.uri}: not a flexmarl run folder (no {CONFIG_NAME})")
    cfg = config_from_text(loc.read_text(CONFIG_NAME), source=loc.display(CONFIG_NAME))
    it = cfg.train.iterations if iteration is None else iteration
    if it < 0:
        raise ValueError(f"iteration must be >= 0, got {it}")
    for agent in cfg.team.agents:
        # Frozen agents keep version 0 (the same rule the rollout stage applies).
        version = it if agent.trainable else 0
        key = weights_key(agent.name, version)
        if not loc.is_file(key):
            have = loc.versions(f"weights/{agent.name}")
            raise FileNotFoundError(
                f"agent {agent.name!r}: no weights for iteration {it} at {loc.display(key)}; "
                f"published versions: {have or 'none'}"
            )
    return cfg, it


def problems_from_file(workload: Workload, path: str | Path) -> list[Problem]:
    """Problems to evaluate on, one per row of a JSONL or Parquet file: through the run's own
    field mapping when its workload reads files (`kind: dataset`, `gsm8k`), else from the
    columns `input` and `answer` (and `id`, default `e<row>`), every other column in `meta`
    (what a workload's reward may read, e.g. the arithmetic plan)."""
    from flexmarl_core.workloads.api import WorkloadError
    from flexmarl_core.workloads.dataset import read_rows, resolve_path

    file = resolve_path(str(path), None)
    if not file.is_file():
        raise WorkloadError(f"--data {path}: no such file")
    own = getattr(workload, "row_to_problem", None)
    out: list[Problem] = []
    for i, (where, row) in enumerate(read_rows(file)):
        if own is not None:
            out.append(own(row, where=where, default_id=f"e{i}", split="heldout"))
            continue
        missing = [k for k in ("input", "answer") if row.get(k) in (None, "")]
        if missing:
            raise WorkloadError(f"{where}: no {missing} (a row needs `input` and `answer`; it has {sorted(row)})")
        try:
            out.append(Problem(str(row.get("id", f"e{i}")), str(row["input"]), str(row["answer"]),
                               {k: v for k, v in row.items() if k not in ("id", "input", "answer")}))
        except WorkloadError as exc:
            raise WorkloadError(f"{where}: {exc}") from None
    if not out:
        raise WorkloadError(f"--data {path}: no rows")
    return out
