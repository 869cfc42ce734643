"""A training run: its folder, its initial state, and the orchestrated loop over iterations.

`prepare_run` lays out the run folder (resolved config, initial weights v0 per agent, every
iteration's inputs in the MEG Store); `train` runs the orchestrator on any `Executor` and writes
metrics. Flows wrap these; tests and benchmarks can call them directly.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from flexmarl_core.config import ExperimentConfig
from flexmarl_core.config.load import HERE
from flexmarl_core.control import Decision, GradientHelper, MoveInstance, TrainSlot, memory
from flexmarl_core.driver.compaction import Compaction
from flexmarl_core.driver.metrics import (
    CriticalPath,
    IterationTracker,
    MetricsWriter,
    log_lines,
    run_summary,
)
from flexmarl_core.driver.retention import KeepRule, Retention
from flexmarl_core.driver.sft import warm_start
from flexmarl_core.driver.telemetry import Pipeline, queue_bound
from flexmarl_core.executors.api import CountsWorkerCPU
from flexmarl_core.meg import MEG
from flexmarl_core.models import default_cache_dir, load_agent_model
from flexmarl_core.models.lora import base_key, initial_adapter_state
from flexmarl_core.ops import OpRecord, StageResult, traits
from flexmarl_core.orchestrator.hooks import Callbacks, RunHook, TrackIterations, WriteOpLog
from flexmarl_core.orchestrator.loop import Executor, Orchestrator
from flexmarl_core.orchestrator.plan import Plan
from flexmarl_core.runfiles import provenance
from flexmarl_core.runfiles.location import (
    CONFIG_NAME,
    LEASE_NAME,
    RUN_MARKER,
    WARM_START_NAME,
    RunLocation,
    as_location,
    base_weights_key,
    make_private,
    weights_key,
)
from flexmarl_core.runfiles.weights import initial_weights, load_base, publish_base, publish_weights
from flexmarl_core.workloads import make_workload
from storage import MEGStore, retry

__all__ = ["CONFIG_NAME", "RUN_MARKER", "WARM_START_NAME", "check_resumable", "check_run_folder",
           "completed_records", "prepare_run", "train"]

#: A run folder: a local path, a URI, or an opened location.
RunDir = str | Path | RunLocation


class RunFolderError(ValueError):
    """`run_dir` names a folder that is not a flexmarl run folder: it is never deleted."""


def _is_run_folder(loc: RunLocation) -> bool:
    if loc.exists(RUN_MARKER) or loc.exists(LEASE_NAME):  # a lease is left only on a checked folder
        return True
    try:  # a run folder of an earlier version: its config names this very folder
        saved = yaml.safe_load(loc.read_text(CONFIG_NAME))
        return RunLocation(saved["run_dir"]) == loc
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return False


def check_run_folder(run_dir: RunDir, init_from: str | None = None) -> None:
    """A fresh run replaces `run_dir` only if it is empty or a flexmarl run folder (it carries
    `RUN_MARKER`): `--set run_dir=$HOME` must not wipe a home folder, nor a project folder
    that happens to hold a `config.yaml`. `init_from` must not lie inside it (the run would
    delete its own starting checkpoints)."""
    loc = as_location(run_dir)
    if init_from and loc.local and Path(init_from).resolve().is_relative_to(Path(loc.root)):
        raise RunFolderError(
            f"train.init_from {init_from!r} lies inside run_dir {loc.uri!r}, which a fresh run "
            "replaces: move the checkpoints elsewhere (flexmarl sft writes <run_dir>-sft by default)"
        )
    if loc.local:
        root = Path(loc.root)
        if not root.exists():
            return
        if not root.is_dir():
            raise RunFolderError(f"run_dir {loc.uri!r} is a file, not a folder")
        if not any(root.iterdir()):
            return
    elif loc.is_empty():
        return
    if not _is_run_folder(loc):
        raise RunFolderError(
            f"run_dir {loc.uri!r} exists and is not a flexmarl run folder (no {RUN_MARKER}); "
            "a fresh run would replace it: choose an empty or new folder"
        )


def prepare_run(cfg: ExperimentConfig, *, fresh: bool = True, log: Callable[[str], None] = print,
                warm: dict[str, Any] | None = None) -> Path | str:
    """Create the run folder: config, initial weights (a warm start, if configured), inputs for
    every iteration. Returns its local path, or its URI for a run on an object store.

    `warm`: the warm start's `sft.json` (`sft.warm_start`) when the caller made it already;
    otherwise it is made (or taken from the cache) here."""
    meg = MEG.from_config(cfg.team)
    workload = make_workload(cfg.workload, cfg.team)  # bad data fails before the folder is touched
    for line in memory.check(cfg):  # a team that cannot fit is refused here, with the figures
        log(line)
    retry.configure(retry.RetryPolicy(**cfg.store.retries.model_dump()))
    loc = cfg.run_location()
    if fresh:
        check_run_folder(loc, cfg.train.init_from)
        loc.delete_all(keep=(LEASE_NAME,))  # the lease of the run that replaces it
        if not loc.local:  # metrics and logs of an earlier run at this URI
            shutil.rmtree(loc.scratch_dir(), ignore_errors=True)
    make_private(loc.scratch_dir())  # the local run folder (a remote run's local scratch): 0700
    make_private(cfg.resolved_store_uri())  # a local store elsewhere too
    loc.write_bytes(RUN_MARKER, b"")
    provenance.record(loc)  # the commit a model exported from this run names
    init_from = cfg.train.init_from
    if init_from is None and cfg.train.warm_start == "sft":
        info = warm if warm is not None else warm_start(cfg, default_cache_dir(), log=log)[1]
        init_from = info["out_dir"]
        loc.write_text(WARM_START_NAME, json.dumps(
            {k: info[k] for k in ("out_dir", "accuracy", "steps", "reused", "target")}, indent=1))

    _publish_bases(cfg, loc, init_from)
    for agent in meg.agent_names:
        if loc.exists(weights_key(agent, 0)):
            continue
        if cfg.agent(agent).model.lora is not None:
            publish_weights(loc, agent, 0, _initial_adapter(cfg, loc, agent))
            continue
        init = initial_weights(init_from, agent)
        if init is None:
            source = cfg.agent(agent).share_model_with or agent
            model, _ = load_agent_model(cfg.agent(source).model, seed=cfg.seed)
            init = model.state_dict()
        publish_weights(loc, agent, 0, init)

    store = MEGStore(cfg.resolved_store_uri())
    n, per_mb = cfg.batch.inputs_per_iteration, cfg.batch.micro_batch_inputs
    for it in range(cfg.train.iterations):
        problems = workload.problems("train", n, seed=cfg.seed, offset=it * n)
        store.write_inputs(
            it,
            [
                {
                    "input_id": p.input_id, "text": p.text, "answer": p.answer, "split": "train",
                    "meta": json.dumps({**p.meta, "mb": k // per_mb, "pos": k}),
                }
                for k, p in enumerate(problems)
            ],
        )
    # The config goes in last, atomically: a folder with one is fully prepared, which is what
    # a Prefect retry of the flow run checks before resuming instead of preparing again.
    loc.write_text(CONFIG_NAME, yaml.safe_dump(_saved_config(cfg, loc), sort_keys=False))
    return Path(loc.root) if loc.local else loc.uri


def _saved_config(cfg: ExperimentConfig, loc: RunLocation) -> dict[str, Any]:
    """The config as the run folder keeps it: its `run_dir` is the folder itself (`{here}`),
    so a copied or moved folder resumes where it is."""
    data = cfg.model_dump(mode="json")
    data["run_dir"] = HERE
    return data


def _publish_bases(cfg: ExperimentConfig, loc: RunLocation, init_from: str | None) -> None:
    """One base file per distinct LoRA base: from `init_from/<agent>` (a warm start saves the
    base it trained under each agent on it) of the base's first agent, else the preset/folder."""
    for a in cfg.team.agents:
        if a.model.lora is None:
            continue
        key = base_key(a.model, cfg.seed)
        if loc.exists(base_weights_key(key)):
            continue
        init = initial_weights(init_from, a.name)
        if init is None:
            init = load_agent_model(a.model, seed=cfg.seed)[0].state_dict()
        publish_base(loc, key, init)


def _initial_adapter(cfg: ExperimentConfig, loc: RunLocation, agent: str) -> dict[str, Any]:
    mcfg = cfg.agent(agent).model
    assert mcfg.lora is not None
    model, _ = load_agent_model(mcfg, seed=cfg.seed)
    model.load_state_dict(load_base(loc, base_key(mcfg, cfg.seed)))
    return initial_adapter_state(model, mcfg.lora, seed=cfg.seed, agent=agent)


class ResumeError(RuntimeError):
    """A run folder that cannot be resumed; the message names the folder and why."""


def check_resumable(cfg: ExperimentConfig, run_dir: RunDir) -> None:
    """`--resume` continues the run in `run_dir` only with the config it was started with."""
    loc = as_location(run_dir)
    try:
        saved = yaml.safe_load(loc.read_text(CONFIG_NAME))
    except FileNotFoundError:
        raise ResumeError(f"cannot resume {loc.uri}: no {CONFIG_NAME} (not a flexmarl run folder)") from None
    if saved != _saved_config(cfg, loc):
        raise ResumeError(f"cannot resume {loc.uri}: the config differs from the run's own "
                          f"{loc.display(CONFIG_NAME)}")


def completed_records(run_dir: RunDir) -> list[OpRecord]:
    """Ops an earlier attempt of this run finished, from its op log, as far as they still hold:
    a micro-batch's training counts only once its agent's step is done (accumulated gradients
    live in worker memory and died with the attempt); a torn last line is ignored."""
    recs: dict[object, OpRecord] = {}
    for line in log_lines(as_location(run_dir), "ops.jsonl"):
        try:
            row = json.loads(line)
            res = StageResult.from_row(row)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # the attempt died while writing this line
        recs[res.op] = OpRecord(res.op, row["submitted"], row["finished"], res)
    stepped = {(op.agent, op.iteration) for op in recs if traits(op.kind).steps}
    return [r for r in recs.values() if not traits(r.op.kind).trains or (r.op.agent, r.op.iteration) in stepped]


def _reported_iterations(run_dir: RunDir) -> list[dict[str, Any]]:
    """The iteration rows an earlier attempt wrote (a torn last line is ignored)."""
    rows = []
    for line in log_lines(as_location(run_dir), "iterations.jsonl"):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


@dataclass
class RunOutcome:
    """What `train` did: each iteration's metrics row, the ops and decisions, and the CPU the
    run's processes spent, from which its summary is made (`summary`)."""

    iterations: list[dict[str, Any]]
    #: the run's time: this attempt's, and an earlier attempt's up to its last op (a resume)
    wall_s: float
    #: this attempt's
    attempt_wall_s: float
    run_dir: str
    #: this process's own files (metrics, logs, pictures): the run folder, or a local scratch
    #: folder for a run on object storage
    scratch_dir: str
    decisions: list[Decision]
    #: ops of the run, an earlier attempt's included (resume); each is in the op log
    ops: int
    critical_path: dict[str, Any]
    #: CPU seconds of this process during the run, and of the executor's worker processes
    #: (None: the executor runs its ops in this process, or does not count its workers)
    flow_cpu_s: float
    worker_cpu_s: float | None
    #: store partitions the run compacted, and the seconds that took (`store.compact`)
    compacted: tuple[int, float] = (0, 0.0)

    def summary(self) -> dict[str, Any]:
        """Whole-run figures (`metrics.run_summary`) with where the CPU went: the stages' own
        work and the bookkeeping around it (the Prefect task engine, API calls, Dask; the API
        server's CPU is not included), and the control plane's moves, swaps and helpers."""
        stage = sum(m["cpu_s"] for m in self.iterations)
        if self.worker_cpu_s is None:  # stages ran in this process: the rest is bookkeeping
            workers, flow = 0.0, max(self.flow_cpu_s - stage, 0.0)
        else:
            workers, flow = max(self.worker_cpu_s - stage, 0.0), self.flow_cpu_s
        overhead = workers + flow
        resumed = {"attempt_wall_s": self.attempt_wall_s} if self.attempt_wall_s < self.wall_s else {}
        return {
            **run_summary(self.iterations, self.wall_s), **resumed,
            "run_dir": self.run_dir, "scratch_dir": self.scratch_dir, "ops": self.ops,
            "stage_cpu_s": stage, "bookkeeping_cpu_s": overhead, "flow_cpu_s": self.flow_cpu_s,
            "worker_bookkeeping_cpu_s": workers,
            "prefect_overhead_frac": overhead / max(overhead + stage, 1e-9),
            "critical_path": self.critical_path,
            "balance_moves": sum(1 for d in self.decisions if isinstance(d, MoveInstance)),
            "train_swaps": sum(1 for d in self.decisions if isinstance(d, TrainSlot) and d.swap),
            "gradient_helpers": sum(1 for d in self.decisions if isinstance(d, GradientHelper)),
            "store_compacted_partitions": self.compacted[0], "store_compact_s": self.compacted[1],
        }


def train(
    cfg: ExperimentConfig,
    run_dir: RunDir,
    executor: Executor,
    *,
    hooks: Sequence[RunHook] = (),
    resume: bool = False,
    plan: Plan | None = None,
) -> RunOutcome:
    """Run every iteration through the orchestrator; write the metrics as the run goes (each
    iteration's row once it is final) and return what the run did.

    `hooks`: called as each op ends (after the op log and the iteration tracker) and with each
    iteration's metrics row once it is final and written (the console's iteration lines).
    `resume`: continue an interrupted run in `run_dir` (same config): ops its op log records
    as finished are not run again; every stage is idempotent, so an op that finished but was
    not logged runs again without duplicating samples, and trainers restart from their last
    checkpoint (`location.trainer_key`). `plan`: the run's plan, if the caller built it.
    Metrics are written in the flow process's scratch folder and, for a remote run, copied to
    its location as they grow (`MetricsWriter`), so a resume needs nothing but the location.
    """
    loc = as_location(run_dir)
    cpu0, workers0 = time.process_time(), _worker_cpu(executor)
    earlier = completed_records(loc) if resume else []
    writer = MetricsWriter(loc.scratch_dir(), mirror=None if loc.local else loc)
    plan = plan or Plan.build(cfg, window=PLAN_WINDOW)

    compaction = Compaction(MEGStore(cfg.resolved_store_uri())) if cfg.store.compact else None
    reported = _reported_iterations(loc) if resume else []
    if compaction is not None:
        compaction.catch_up(int(r["iteration"]) for r in reported)

    def emit(row: dict[str, Any], *, written: bool = False) -> None:
        if not written:
            writer.iteration(row)
        if compaction is not None:
            compaction.iteration_done(row)
        for hook in hooks:
            hook.iteration_done(row)

    # an iteration a repair rewound: its row stands as first written, its ops ran again
    tracker = IterationTracker(plan.sizes(), emit, lambda: len(executor.worker_resources()),
                               rebuilt=lambda row: emit(row, written=True), pipeline=Pipeline(
                                   plan.deps_of, queue_bound(cfg.codesign.async_pipeline, cfg.codesign.max_staleness)))
    if resume:  # the downtime since the earlier attempt's last op is no iteration's time
        tracker.resume(earlier, reported, resumed_at=executor.now())
    retention = Retention(KeepRule(cfg.codesign.max_staleness, cfg.train.keep_every), loc, writer.durable)
    retention.restore(earlier)
    path = CriticalPath(plan.deps_of, plan.sizes(), plan.reach)
    for rec in earlier:
        path.add(rec)
    orch = Orchestrator(plan, cfg, executor, skip=[r.op for r in earlier], keep_records=False,
                        hooks=[WriteOpLog(writer), TrackIterations(tracker), Callbacks(path.add), retention,
                               *hooks])
    orch.control.warm(r.result for r in earlier)
    n_earlier = len(earlier)
    del earlier  # the op log has them; the run's memory stays flat
    ended = False
    try:
        result = orch.run()
        tracker.flush(final=True)
        ended = True
    finally:
        writer.decisions(orch.control.decisions)
        writer.close()
        if compaction is not None:
            compaction.close(abandon=not ended)
    retention.release(everything=True)  # only after a run that ended: a failed one keeps its files
    workers1 = _worker_cpu(executor)
    return RunOutcome(
        iterations=tracker.rows, wall_s=tracker.earlier_s + result.wall_s, attempt_wall_s=result.wall_s,
        run_dir=loc.uri if not loc.local else loc.root,
        scratch_dir=str(loc.scratch_dir()), decisions=result.decisions, ops=n_earlier + result.ops,
        critical_path=path.summary(), flow_cpu_s=time.process_time() - cpu0,
        worker_cpu_s=None if workers0 is None or workers1 is None else workers1 - workers0,
        compacted=(compaction.partitions, compaction.seconds) if compaction else (0, 0.0))


#: iterations of a run's plan built ahead at its start (the orchestrator extends it as it goes)
PLAN_WINDOW = 2


def _worker_cpu(executor: Executor) -> float | None:
    return executor.worker_cpu_s() if isinstance(executor, CountsWorkerCPU) else None
