"""Exactly-once audit of a run: every expected sample of every completed iteration is stored
once, and every status row belongs to a stored sample (`flexmarl store audit RUN_DIR`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexmarl_core.config import ConfigError, config_from_text
from flexmarl_core.config.critic import trainer_kinds
from flexmarl_core.runtime.kinds import TRAINER_KINDS, AuditCheck
from flexmarl_core.runtime.location import CONFIG_NAME, RunLocation, weights_key
from flexmarl_core.runtime.worker import inputs_by_mb
from flexmarl_core.teams import team_shape
from storage import MEGStore, Problem, Store, audit_store


@dataclass
class _RunFiles:
    """A run's files, store and inputs, as the team shape reads them (`teams.RunView`)."""

    loc: RunLocation
    store: Store
    _inputs: dict[int, dict[int, list[dict[str, Any]]]] = field(default_factory=dict)

    def inputs(self, iteration: int, mb: int) -> list[dict[str, Any]]:
        if iteration not in self._inputs:
            self._inputs[iteration] = inputs_by_mb(self.store, iteration)
        return self._inputs[iteration].get(mb, [])


def completed_iterations(run_dir: str | Path | RunLocation, iterations: int, trainable: list[str]) -> list[int]:
    """Iterations whose update every trainable agent published (weights v<k+1>, or between
    checkpoints its sync in the op log): all their samples were produced, rewarded and
    trained on."""
    loc = run_dir if isinstance(run_dir, RunLocation) else RunLocation(run_dir)
    synced: set[str] = set()
    try:
        lines = loc.read_text("metrics/ops.jsonl").splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        if row.get("kind") == "sync":
            synced.add(row["op"])
    return [k for k in range(iterations) if trainable and all(
        f"sync[{a}] it={k}" in synced or loc.is_file(weights_key(a, k + 1)) for a in trainable)]


def audit_run(run_dir: str | Path) -> tuple[str, list[Problem]]:
    """(store URI, problems) of a run folder: `audit_store` with the sample_ids each completed
    iteration must hold (from its inputs and the team graph), and, for trainable agents,
    samples of a completed iteration that no update consumed (or, with gae, no critic valued);
    an iteration counts as completed once its critics synced too."""
    loc = RunLocation(run_dir)
    if not loc.is_file(CONFIG_NAME):
        raise ConfigError(f"{loc.uri}: neither a MEG store nor a run folder (no {CONFIG_NAME})")
    cfg = config_from_text(loc.read_text(CONFIG_NAME), source=loc.display(CONFIG_NAME))
    team = team_shape(cfg)
    meg = team.meg
    uri = cfg.resolved_store_uri()
    store = MEGStore(uri, create=False)
    expected: dict[tuple[str, int], list[str]] = {}
    trainers = trainer_kinds(cfg)
    done = completed_iterations(loc, cfg.train.iterations, list(trainers))
    run = _RunFiles(loc, store)
    for it in done:
        for agent in meg.agent_names:
            expected[(agent, it)] = sorted(team.expected_ids(run, it, range(cfg.batch.num_micro_batches), agent))
    problems = audit_store(uri, expected)
    checks: dict[str, list[AuditCheck]] = {}
    for name, kind in trainers.items():  # each trainer's kind says what its samples must show
        for agent, cs in TRAINER_KINDS.get(kind).audited(cfg, name).items():
            checks.setdefault(agent, []).extend(cs)
    for agent, cs in checks.items():
        for it in done:
            tbl = store.read_samples(agent, it, columns=["sample_id", *(c.column for c in cs)])
            for c in cs:
                bare = tbl.filter(tbl.column(c.column).is_null())
                if bare.num_rows:
                    problems.append(Problem(
                        c.kind, store.display(store.partition_dir("samples", agent, it)),
                        f"{bare.num_rows} samples of completed iteration {it} {c.what}, "
                        f"e.g. {bare.column('sample_id').to_pylist()[:5]}"))
    return uri, problems
