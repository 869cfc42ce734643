"""Exactly-once audit of a run: every expected sample of every completed iteration is stored
once, every status row belongs to a stored sample, and the run's op log and iteration log
record each op and iteration once, in order (`flexmarl store audit RUN_DIR`).

Samples that `flexmarl store repair` recorded as lost (`REPAIRS_NAME`: their fragment was
damaged after they were trained on, and the weights that sampled them are gone) are one
finding per partition naming them, not an error; a fragment that cannot be read is an error
naming it and the repair."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from flexmarl_core.config import ConfigError, config_from_text
from flexmarl_core.config.critic import trainer_kinds
from flexmarl_core.driver.metrics import log_lines
from flexmarl_core.ops import KINDS
from flexmarl_core.runfiles.location import CONFIG_NAME, RunLocation, weights_key
from flexmarl_core.runtime.worker import inputs_by_mb
from flexmarl_core.teams import team_shape
from flexmarl_core.trainers.kinds import TRAINER_KINDS, AuditCheck
from storage import MEGStore, Problem, Store, StoreError, audit_store
from storage.audit import LOST_NAMED

#: what `flexmarl store repair` did, one JSON line per damaged fragment it set aside (`repair.py`)
REPAIRS_NAME = "repairs.jsonl"
#: problem kinds of a fragment that cannot be read (`StoreError.reason`)
DAMAGE = ("unreadable", "schema")


@dataclass
class RunFiles:
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
    synced = {row["op"] for row in _rows(loc, "metrics/ops.jsonl") if row.get("kind") == "sync"}
    return [k for k in range(iterations) if trainable and all(
        f"sync[{a}] it={k}" in synced or loc.is_file(weights_key(a, k + 1)) for a in trainable)]


class RunAudit(NamedTuple):
    """What `audit_run` found, and what it checked: completed iterations, the samples they
    must hold, the op log's ops and the iteration log's rows; `lost`: samples a repair
    recorded as lost to damage after they were trained on."""

    uri: str
    problems: list[Problem]
    iterations: list[int]
    samples: int
    ops: int
    rows: int
    lost: int = 0

    def verdict(self) -> str:
        """`clean`, `empty` (nothing completed to check), or the count of errors; a clean run
        with samples lost to damage says how many."""
        errors = sum(p.severity == "error" for p in self.problems)
        if errors:
            return f"{errors} error(s)"
        if not self.iterations:
            return "empty (no completed iteration)"
        return "clean" if not self.lost else f"clean but for {self.lost} samples lost to damage, trained before it"


class Lost(NamedTuple):
    """Per (agent, iteration): the sample ids whose rows, or whose status rows, a repair
    recorded as lost."""

    samples: dict[tuple[str, int], set[str]]
    status: dict[tuple[str, int], set[str]]


def read_lost(loc: RunLocation) -> Lost:
    """What the run's repairs recorded as lost (`REPAIRS_NAME`; a torn last line is ignored)."""
    out = Lost({}, {})
    try:
        lines = loc.read_text(REPAIRS_NAME).splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("outcome") == "lost":
            table = out.samples if rec["table"] == "samples" else out.status
            table.setdefault((rec["agent"], int(rec["iteration"])), set()).update(rec["ids"])
    return out


def log_problems(loc: RunLocation) -> tuple[int, int, list[Problem]]:
    """(ops, iteration rows, problems) of a run's op and iteration logs: an op recorded twice
    (a train op may be recorded again by a resume before its step, which redoes it), and
    iteration rows that repeat or go back (two runs wrote into one folder)."""
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    stepped: set[tuple[str, int]] = set()
    ops = 0
    for n, row in enumerate(_rows(loc, "metrics/ops.jsonl"), 1):
        ops += 1
        name, kind = str(row.get("op")), row.get("kind")
        tr = KINDS.get(str(kind))
        if name in seen and not (tr is not None and tr.trains and (row.get("agent"), row.get("iteration")) not in stepped):
            problems.append(Problem("op_twice", loc.display("metrics/ops.jsonl"),
                                    f"{name} recorded twice (lines {seen[name]} and {n}): two runs wrote "
                                    "into this folder, or an op ran again after it was recorded"))
        seen.setdefault(name, n)
        if tr is not None and tr.steps:
            stepped.add((row.get("agent"), row.get("iteration")))
    its = [r.get("iteration") for r in _rows(loc, "metrics/iterations.jsonl")]
    for k, it in enumerate(its):
        if it != k:
            problems.append(Problem("iterations_out_of_order", loc.display("metrics/iterations.jsonl"),
                                    f"row {k + 1} is iteration {it}, expected {k} (rows: {its[:12]}"
                                    f"{'...' if len(its) > 12 else ''}): two runs wrote into this folder"))
            break
    return ops, len(its), problems


def _rows(loc: RunLocation, key: str) -> list[dict[str, Any]]:
    lines = log_lines(loc, key.removeprefix("metrics/"))
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line
    return out


def audit_run(run_dir: str | Path) -> RunAudit:
    """A run folder's audit: `audit_store` with the sample_ids each completed iteration must
    hold (from its inputs and the team's shape), what each trainer's kind checks on its
    agents' samples (consumed by an update; with gae, valued by a critic), and the op and
    iteration logs (`log_problems`). An iteration counts as completed once every trainer,
    critics included, synced it."""
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
    run = RunFiles(loc, store)
    mbs = range(cfg.batch.num_micro_batches)
    trained: dict[tuple[str, int], set[str]] = {}
    for it in done:
        for agent in meg.agent_names:
            expected[(agent, it)] = sorted(team.expected_ids(run, it, mbs, agent, trained=False))
            trained[(agent, it)] = team.expected_ids(run, it, mbs, agent)
    lost = read_lost(loc)
    problems = audit_store(uri, expected, lost.samples)
    damaged = set()
    for k, p in enumerate(problems):
        if p.kind in DAMAGE:  # what to do about it, in the line that names it
            damaged.add(p.path)
            problems[k] = Problem(p.kind, p.path, f"{p.message}; `flexmarl store repair {loc.uri}` sets it "
                                  "aside and says what a resume writes again and what is lost", p.severity)
    ops, rows, logged = log_problems(loc)
    problems += logged
    checks: dict[str, list[AuditCheck]] = {}
    for name, kind in trainers.items():  # each trainer's kind says what its samples must show
        for agent, cs in TRAINER_KINDS.get(kind).audited(cfg, name).items():
            checks.setdefault(agent, []).extend(cs)
    for agent, cs in checks.items():
        for it in done:
            try:
                tbl = store.read_samples(agent, it, columns=["sample_id", *(c.column for c in cs)])
            except StoreError as err:
                if err.path not in damaged:  # one damaged fragment is one problem
                    problems.append(Problem(err.reason, err.path or "", str(err)))
                continue
            # a failed trajectory trains nobody; a status row lost to damage is a finding below
            ours = pa.array(sorted(trained[(agent, it)] - lost.status.get((agent, it), set())), pa.string())
            tbl = tbl.filter(pc.is_in(tbl.column("sample_id"), value_set=ours))
            for c in cs:
                bare = tbl.filter(tbl.column(c.column).is_null())
                if bare.num_rows:
                    problems.append(Problem(
                        c.kind, store.display(store.partition_dir("samples", agent, it)),
                        f"{bare.num_rows} samples of completed iteration {it} {c.what}, "
                        f"e.g. {bare.column('sample_id').to_pylist()[:5]}"))
    for (agent, it), ids in sorted(lost.status.items()):
        problems.append(Problem("lost", store.display(store.partition_dir("status", agent, it)),
                                f"the rewards and consumption of {len(ids)} samples lost to damage, trained "
                                f"before it: {', '.join(sorted(ids)[:LOST_NAMED])}", "warning"))
    n_lost = sum(len(v) for v in lost.status.values())
    for (agent, it), ids in lost.samples.items():  # those still missing (a later run may have written some)
        try:
            have = set(store.read_samples(agent, it, columns=["sample_id"]).column("sample_id").to_pylist())
        except StoreError:
            continue
        n_lost += len(ids - have)
    return RunAudit(uri, problems, done, sum(len(v) for v in expected.values()), ops, rows, n_lost)
