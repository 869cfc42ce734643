"""A damaged store before a resume: found (`damaged`), and repaired (`repair_run`).

A resume first checks the run's store (fragment footers, `store check --shallow`): a fragment
that cannot be read stops it with the file named and the command that repairs it. The repair
moves each damaged fragment of `samples/` or `status/` aside (`_quarantine/` under the store,
which readers never list) and takes the ops that wrote it out of the run's op log, so the
resume runs them again: stages are idempotent and seeded by their op, so they write the same
rows (a policy's train op after its step writes back the status rows of what it trained). The
iteration rows from the first iteration it touches on are dropped, to be written again.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from flexmarl_core.config import ExperimentConfig, config_from_text
from flexmarl_core.driver.metrics import log_lines, rewrite_log
from flexmarl_core.ops import reaches, traits
from flexmarl_core.runfiles.location import CONFIG_NAME, RunLocation
from storage import Problem
from storage.check import EXACTLY_ONCE, check_store
from storage.fs import open_filesystem

QUARANTINE = "_quarantine"
#: a micro-batch's fragment (`mb000003-...`), or a compacted partition's (`all-...`: every one)
_FRAGMENT = re.compile(r"(samples|status)/agent=([^/]+)/iteration=(\d+)/(?:mb(\d+)|all)-[^/]+\.parquet$")


class DamagedStoreError(RuntimeError):
    """The run's store has damaged files; the message names the first and the repair."""


@dataclass(frozen=True)
class Damage:
    """One damaged fragment: its table, agent, iteration and micro-batch (-1: a compacted
    fragment, every micro-batch's rows and their status folded in), and the problem."""

    table: str
    agent: str
    iteration: int
    mb: int
    problem: Problem


def damaged(store_uri: str) -> tuple[list[Damage], list[Problem]]:
    """(repairable damaged fragments, other errors) of the store, reading fragment footers."""
    fixable, other = [], []
    for p in check_store(store_uri, deep=False):
        if p.severity != "error":
            continue
        m = _FRAGMENT.search(p.path)
        if m and p.kind not in EXACTLY_ONCE and p.kind != "mb_tag":
            fixable.append(Damage(m[1], m[2], int(m[3]), -1 if m[4] is None else int(m[4]), p))
        else:
            other.append(p)
    return fixable, other


def check_before_resume(run_dir: str) -> None:
    """`DamagedStoreError` if the run's store has a damaged file: the resume would train on
    what it cannot read."""
    loc = RunLocation(run_dir)
    cfg = config_from_text(loc.read_text(CONFIG_NAME), source=loc.display(CONFIG_NAME))
    fixable, other = damaged(cfg.resolved_store_uri())
    if other:
        raise DamagedStoreError(f"{_said(other[0])} ({len(fixable) + len(other)} damaged file(s)); "
                                "`flexmarl store check` lists them; this damage cannot be repaired in place")
    if fixable:
        raise DamagedStoreError(f"{_said(fixable[0].problem)} ({len(fixable)} damaged file(s)); repair with "
                                f"`flexmarl store repair {loc.uri}`, then resume (or --skip-check to resume as is)")


def _said(p: Problem) -> str:
    """A problem in one short clause: the file, what is wrong with it, and why."""
    why = p.message.split(f"{p.path}: ", 1)[-1]
    return f"the store file {p.path} is {p.kind}: {why}"


def _writes(op: dict, d: Damage) -> bool:
    """Whether the op of an op-log row writes the damaged fragment's rows."""
    if op.get("iteration") != d.iteration or (d.mb != -1 and op.get("mb") not in (d.mb, -1)):
        return False
    kind = traits(str(op.get("kind")))
    mine = op.get("agent") == d.agent
    samples = reaches(kind.samples, mine)
    if d.table == "samples" and d.mb != -1:
        return samples
    # a status fragment, or a compacted one (samples with their status folded in)
    return reaches(kind.status, mine) or (samples and d.table == "samples")


def _needs_missing(loc: RunLocation, cfg: ExperimentConfig, rows: list[dict]) -> str | None:
    """Why the rewound ops (op-log rows) could not write their rows again, if so: a rollout
    samples with its agent's weights of its iteration (or up to k older), a program with every
    agent's, and the run deletes versions no op needs any more (`driver/retention.py`)."""
    k = cfg.codesign.max_staleness
    kept: dict[str, set[int]] = {}  # agent -> the weight versions the run keeps (listed once)
    for row in rows:
        if row.get("kind") not in ("rollout", "program"):
            continue
        it = int(row["iteration"])
        agents = [row["agent"]] if row["kind"] == "rollout" else [a.name for a in cfg.team.agents]
        for agent in agents:
            if not cfg.agent(agent).trainable:
                continue
            if agent not in kept:
                kept[agent] = set(loc.versions(f"weights/{agent}"))
            have = kept[agent]
            if not have & set(range(max(it - k, 0), it + 1)):
                return (f"{row['op']} sampled with {agent!r} weights v{max(it - k, 0)}..v{it}, which the run "
                        f"no longer keeps (it keeps {sorted(have)}: the initial, the newest "
                        f"{k + 1} and every train.keep_every-th)")
    return None


def repair_run(run_dir: str) -> list[Damage]:
    """Quarantine the run's damaged fragments and rewind the ops that wrote them (module
    docstring); returns what it repaired. `DamagedStoreError` for damage it cannot repair."""
    loc = RunLocation(run_dir)
    cfg = config_from_text(loc.read_text(CONFIG_NAME), source=loc.display(CONFIG_NAME))
    fixable, other = damaged(cfg.resolved_store_uri())
    if other:
        raise DamagedStoreError(f"cannot repair {other[0]}: only unreadable sample and status "
                                "fragments can be written again")
    if not fixable:
        return []
    rewound = [row for _, row in _parsed(log_lines(loc, "ops.jsonl")) if any(_writes(row, d) for d in fixable)]
    missing = _needs_missing(loc, cfg, rewound)
    if missing:
        raise DamagedStoreError(f"cannot repair {fixable[0].problem.path}: its rows are written again by "
                                f"the ops that wrote them, and {missing}; set train.keep_every to keep the "
                                "versions a repair may need")
    fs, root, prefix = open_filesystem(cfg.resolved_store_uri())
    for d in fixable:
        path = d.problem.path[len(prefix):]
        target = f"{root}/{QUARANTINE}/{path[len(root) + 1:]}"
        fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        fs.move(path, target)
    first = min(d.iteration for d in fixable)
    for key, keep in (("metrics/ops.jsonl", lambda row: not any(_writes(row, d) for d in fixable)),
                      ("metrics/iterations.jsonl", lambda row: row.get("iteration", 0) < first)):
        name = key.removeprefix("metrics/")
        lines = log_lines(loc, name)
        if not lines:
            continue
        rewrite_log(loc, name, [line for line, row in _parsed(lines) if keep(row)])
    return fixable


def _parsed(lines: list[str]) -> list[tuple[str, dict]]:
    """Each whole line with its row (a torn last line goes)."""
    out = []
    for line in lines:
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError:
            continue
    return out

