"""A damaged store before a resume: found (`damaged`), and repaired (`repair_run`).

A resume first checks the run's store (fragment footers, `store check --shallow`): a fragment
that cannot be read stops it with the file named and the command that repairs it. The repair
moves each damaged fragment of `samples/` or `status/` aside (`_quarantine/` under the store,
which readers never list), then, for each, one of two things:

- **written again**: the ops that wrote it leave the run's op log, so the resume runs them
  again. Stages are idempotent and seeded by their op, so they write the same rows (a policy's
  train op after its step writes back the status rows of what it trained). That needs what
  those ops read: a rollout the weights it sampled with (a program or an episode op, every
  agent's), and no other fragment the repair finds lost. The iteration rows stay as they
  were, each of an iteration whose ops run again marked `rebuilt_ops` (how many).
- **lost**: its samples were trained on before the damage, into a trainer state the run keeps,
  and the weights that sampled them are gone (`driver/retention.py` keeps the initial, the
  newest and every `train.keep_every`-th). Nothing will read them again; they are history,
  recorded in the run's `repairs.jsonl` with their ids (from the iteration's inputs and the
  ops' manifests), and the audit reports them as lost, not as missing.

Damage that is neither (samples not yet trained into a kept state whose weights are gone: a
one-worker run between checkpoints, or a retention that kept too little) is refused, naming
why, before anything changes.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from pyarrow.fs import FileSelector

from flexmarl_core.config import ExperimentConfig, config_from_text
from flexmarl_core.config.critic import trainer_kinds
from flexmarl_core.driver.audit import REPAIRS_NAME, RunFiles
from flexmarl_core.driver.metrics import log_lines, rewrite_log
from flexmarl_core.ops import reaches, traits
from flexmarl_core.runfiles.location import CONFIG_NAME, RunLocation
from flexmarl_core.teams import team_shape
from storage import MEGStore, Problem
from storage.check import EXACTLY_ONCE, QUARANTINE, check_store
from storage.fs import open_filesystem
from storage.schema import SAMPLE_FILE_SCHEMA

__all__ = ["QUARANTINE", "Damage", "DamagedStoreError", "Repaired", "check_before_resume", "damaged", "repair_run"]

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


@dataclass
class Repaired:
    """What the repair did with one damaged fragment: `outcome` `rewritten` (`rewound` names
    the ops the resume runs again to write it) or `lost` (`lost` names its samples, or, of a
    status fragment, the samples whose rewards and consumption went with it)."""

    damage: Damage
    outcome: str = "rewritten"
    rewound: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)


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
    """Why the rewound ops (op-log rows) could not write their rows again, if so: an op that
    samples does so with its agent's weights of its iteration (or up to k older), one that
    writes every agent's samples (a program, an episode) with every agent's, and the run
    deletes versions no op needs any more (`driver/retention.py`)."""
    k = cfg.codesign.max_staleness
    kept: dict[str, set[int]] = {}  # agent -> the weight versions the run keeps (listed once)
    for row in rows:
        kind = traits(str(row.get("kind")))
        if not (kind.generates and kind.samples):
            continue
        it = int(row["iteration"])
        agents = [row["agent"]] if kind.samples == "own" else [a.name for a in cfg.team.agents]
        for agent in agents:
            if not cfg.agent(agent).trainable:
                continue
            if agent not in kept:
                kept[agent] = set(loc.versions(f"weights/{agent}"))
            have = kept[agent]
            if not have & set(range(max(it - k, 0), it + 1)):
                return (f"{row['op']} sampled with {agent!r} weights v{max(it - k, 0)}..v{it}, which the run "
                        f"no longer keeps (it keeps {sorted(have)}: the initial, the newest "
                        f"{k + 1}, the newest checkpoint's and every train.keep_every-th)")
    return None


def _trained_below(loc: RunLocation, cfg: ExperimentConfig) -> int:
    """The iterations below this one are trained into a state every trainer keeps: no resume
    reads their samples again (it starts from, or replays after, the newest state)."""
    return min((max(loc.versions(f"trainers/{t}"), default=0) for t in trainer_kinds(cfg)), default=0)


def _overlaps(a: Damage, b: Damage) -> bool:
    """Whether two fragments hold rows of a same micro-batch."""
    return a.iteration == b.iteration and (-1 in (a.mb, b.mb) or a.mb == b.mb)


def _classify(loc: RunLocation, cfg: ExperimentConfig, fixable: list[Damage],
              ops: list[dict]) -> list[Repaired]:
    """Each damaged fragment written again or lost (module docstring); `DamagedStoreError`
    for one that can be neither."""
    below = _trained_below(loc, cfg)
    out: dict[Damage, Repaired] = {}
    why: dict[Damage, str] = {}  # the fragments that cannot be written again, and why
    for d in fixable:
        rows = [row for row in ops if _writes(row, d)]
        missing = _needs_missing(loc, cfg, rows)
        out[d] = Repaired(d, rewound=[str(row["op"]) for row in rows])
        if missing:
            why[d] = missing
    # an op run again must not read samples the repair finds lost (a reward reads every
    # agent's of its micro-batch, a rollout its parents'): what it would write is history too
    changed = True
    while changed:
        changed = False
        for d in fixable:
            gone = [x for x in why if x.table == "samples" and x != d and _overlaps(x, d)]
            if d not in why and gone:
                why[d] = f"its ops would read {gone[0].problem.path}, which cannot be written again"
                changed = True
    for d, reason in why.items():
        if d.iteration >= below:
            raise DamagedStoreError(
                f"cannot repair {d.problem.path}: its rows are written again by the ops that wrote them, and "
                f"{reason}; nor are they history: iteration {d.iteration} is not yet trained into a state "
                f"every trainer keeps (their newest cover iterations below {below}); set train.keep_every "
                "to keep the versions a repair may need")
        out[d].outcome, out[d].rewound = "lost", []
    return [out[d] for d in fixable]


def _lost_ids(store: MEGStore, run: RunFiles, cfg: ExperimentConfig, d: Damage, damaged_paths: set[str]) -> list[str]:
    """The sample ids the damaged fragment held that no other fragment of its partition holds
    (the iteration's inputs and its ops' manifests say which ids it must hold); of a status
    fragment, those whose status rows it may have held."""
    mbs = range(cfg.batch.num_micro_batches) if d.mb == -1 else [d.mb]
    team = team_shape(cfg)
    if d.table == "status":
        return sorted(team.expected_ids(run, d.iteration, mbs, d.agent))
    want = team.expected_ids(run, d.iteration, mbs, d.agent, trained=False)
    have: set[str] = set()
    folder = store.partition_dir("samples", d.agent, d.iteration)
    for e in store.fs.get_file_info(FileSelector(folder, allow_not_found=True)):
        if e.path.endswith(".parquet") and store.display(e.path) not in damaged_paths:
            tbl = store.read_fragment(e.path, SAMPLE_FILE_SCHEMA, ["sample_id"])
            have.update(tbl.column("sample_id").to_pylist())
    return sorted(want - have)


def repair_run(run_dir: str) -> list[Repaired]:
    """Set the run's damaged fragments aside; rewind the ops that write each again, or record
    its samples as lost (module docstring). `DamagedStoreError`, changing nothing, for damage
    it cannot repair."""
    loc = RunLocation(run_dir)
    cfg = config_from_text(loc.read_text(CONFIG_NAME), source=loc.display(CONFIG_NAME))
    fixable, other = damaged(cfg.resolved_store_uri())
    if other:
        raise DamagedStoreError(f"cannot repair {other[0]}: only unreadable sample and status "
                                "fragments can be written again")
    if not fixable:
        return []
    op_rows = _parsed(log_lines(loc, "ops.jsonl"))
    done = _classify(loc, cfg, fixable, [row for _, row in op_rows])
    store = MEGStore(cfg.resolved_store_uri(), create=False)
    run = RunFiles(loc, store)
    paths = {d.problem.path for d in fixable}
    for rep in done:
        if rep.outcome == "lost":
            rep.lost = _lost_ids(store, run, cfg, rep.damage, paths)
    fs, root, prefix = open_filesystem(cfg.resolved_store_uri())
    moved = {d: f"{prefix}{root}/{QUARANTINE}/{d.problem.path[len(prefix) + len(root) + 1:]}" for d in fixable}
    _record(loc, done, moved)  # first: a repair cut short is done again, never forgotten
    for d, target in moved.items():
        target = target[len(prefix):]
        fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        fs.move(d.problem.path[len(prefix):], target)
    rewound = {name for rep in done for name in rep.rewound}
    if rewound:
        rewrite_log(loc, "ops.jsonl", [line for line, row in op_rows if row.get("op") not in rewound])
        per_it: dict[int, int] = {}
        for _, row in op_rows:
            if row.get("op") in rewound:
                per_it[int(row["iteration"])] = per_it.get(int(row["iteration"]), 0) + 1
        rows = _parsed(log_lines(loc, "iterations.jsonl"))
        if rows:  # each row stays; one whose ops run again says how many
            rewrite_log(loc, "iterations.jsonl", [
                json.dumps({**row, "rebuilt_ops": row.get("rebuilt_ops", 0) + per_it[row["iteration"]]})
                if row.get("iteration") in per_it else line for line, row in rows])
    return done


def _record(loc: RunLocation, done: list[Repaired], moved: dict[Damage, str]) -> None:
    """One line per fragment set aside in the run's `repairs.jsonl` (what the audit reads)."""
    lines = []
    try:
        lines = loc.read_text(REPAIRS_NAME).splitlines()
    except FileNotFoundError:
        pass
    at = time.time()
    for rep in done:
        d = rep.damage
        rec: dict[str, Any] = {"at": at, "outcome": rep.outcome, "table": d.table, "agent": d.agent,
                               "iteration": d.iteration, "mb": d.mb, "fragment": d.problem.path,
                               "set_aside": moved[d], "problem": d.problem.kind}
        rec.update({"ops": rep.rewound} if rep.outcome == "rewritten" else {"count": len(rep.lost), "ids": rep.lost})
        lines.append(json.dumps(rec))
    loc.write_text(REPAIRS_NAME, "".join(f"{x}\n" for x in lines))


def _parsed(lines: list[str]) -> list[tuple[str, dict]]:
    """Each whole line with its row (a torn last line goes)."""
    out = []
    for line in lines:
        try:
            out.append((line, json.loads(line)))
        except json.JSONDecodeError:
            continue
    return out


def skipped_check(run_dir: str) -> str:
    """What `--resume --skip-check` left unchecked, in a line for the run's summary: the store
    check it skipped, and the damaged files a footer scan finds (neither repaired nor set
    aside: the run read around them, or did not need them)."""
    loc = RunLocation(run_dir)
    cfg = config_from_text(loc.read_text(CONFIG_NAME), source=loc.display(CONFIG_NAME))
    fixable, other = damaged(cfg.resolved_store_uri())
    found = [d.problem for d in fixable] + other
    if not found:
        return "--skip-check: the store was not checked before the resume (its fragments' footers read whole now)"
    return (f"--skip-check: resumed without repairing {len(found)} damaged store file(s), "
            f"e.g. {found[0].path} ({found[0].kind}); `flexmarl store repair {loc.uri}` sets them aside "
            "(`flexmarl store check` lists them)")
