"""A training run: its folder, its initial state, and the orchestrated loop over iterations.

`prepare_run` lays out the run folder (resolved config, initial weights v0 per agent, every
iteration's inputs in the MEG Store); `train` runs the orchestrator on any `Executor` and writes
metrics. Flows wrap these; tests and benchmarks can call them directly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from flexmarl_core.config import ExperimentConfig
from flexmarl_core.meg import MEG
from flexmarl_core.metrics import MetricsWriter, critical_path, iteration_metrics
from flexmarl_core.orchestrator import Executor, Op, OpRecord, Orchestrator
from flexmarl_core.worker import CONFIG_NAME, publish_weights, weights_path


def prepare_run(cfg: ExperimentConfig, *, fresh: bool = True) -> Path:
    """Create the run folder: config, initial weights, inputs for every iteration."""
    from flexmarl_core.models import load_agent_model
    from flexmarl_core.workloads import make_workload
    from storage import MEGStore

    meg = MEG.from_config(cfg.team)
    workload = make_workload(cfg.workload, cfg.team)  # bad data fails before the folder is touched
    run_dir = cfg.resolved_run_dir().resolve()
    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    for agent in meg.agent_names:
        if weights_path(run_dir, agent, 0).exists():
            continue
        init = _initial_weights(cfg, agent)
        if init is None:
            source = cfg.agent(agent).share_model_with or agent
            model, _ = load_agent_model(cfg.agent(source).model, seed=cfg.seed)
            init = model.state_dict()
        publish_weights(run_dir, agent, 0, init)

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
    data = cfg.model_dump(mode="json")
    data["run_dir"] = str(run_dir)
    tmp = run_dir / f".{CONFIG_NAME}.tmp"
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(run_dir / CONFIG_NAME)
    return run_dir


def _initial_weights(cfg: ExperimentConfig, agent: str) -> dict[str, Any] | None:
    """Weights from `train.init_from/<agent>` (e.g. `flexmarl sft` output), if configured."""
    if not cfg.train.init_from:
        return None
    from safetensors.torch import load_file

    path = Path(cfg.train.init_from) / agent / "model.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"train.init_from: no checkpoint for agent {agent!r} at {path}")
    return load_file(str(path))


class ResumeError(RuntimeError):
    """A run folder that cannot be resumed; the message names the folder and why."""


def check_resumable(cfg: ExperimentConfig, run_dir: Path) -> None:
    """`--resume` continues the run in `run_dir` only with the config it was started with."""
    saved = run_dir / CONFIG_NAME
    if not saved.exists():
        raise ResumeError(f"cannot resume {run_dir}: no {CONFIG_NAME} (not a flexmarl run folder)")
    data = cfg.model_dump(mode="json")
    data["run_dir"] = str(run_dir)
    if yaml.safe_load(saved.read_text()) != data:
        raise ResumeError(f"cannot resume {run_dir}: the config differs from the run's own {saved}")


def completed_records(run_dir: Path) -> list[OpRecord]:
    """Ops an earlier attempt of this run finished, from its op log, as far as they still hold:
    a micro-batch's training counts only once its agent's step is done (accumulated gradients
    live in worker memory and died with the attempt); a torn last line is ignored."""
    path = Path(run_dir) / "metrics" / "ops.jsonl"
    if not path.exists():
        return []
    recs: dict[Op, OpRecord] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            op = Op(row["iteration"], row["kind"], row["agent"], row.get("turn", 0), row["mb"])
        except (json.JSONDecodeError, KeyError):
            continue  # the attempt died while writing this line
        recs[op] = OpRecord(op, row["submitted"], row["finished"], row.get("worker"), row)
    stepped = {(op.agent, op.iteration) for op in recs if op.kind == "step"}
    return [r for op, r in recs.items() if op.kind != "train" or (op.agent, op.iteration) in stepped]


def train(
    cfg: ExperimentConfig,
    run_dir: Path,
    executor: Executor,
    *,
    on_op_done: Any = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Run every iteration through the orchestrator; write and return the metrics.

    `resume`: continue an interrupted run in `run_dir` (same config): ops its op log records
    as finished are not run again; every stage is idempotent, so an op that finished but was
    not logged runs again without duplicating samples, and trainers restart from their last
    checkpoint (`worker.trainer_state_path`).
    """
    meg = MEG.from_config(cfg.team)
    earlier = completed_records(run_dir) if resume else []
    writer = MetricsWriter(run_dir)

    def kwargs(op: Any) -> dict[str, Any]:
        return {"run_dir": str(run_dir), "iteration": op.iteration, "agent": op.agent,
                "turn": op.turn, "mb": op.mb}

    def done(rec: OpRecord) -> None:
        writer.op(rec)
        if on_op_done:
            on_op_done(rec)

    orch = Orchestrator(cfg, meg, executor, kwargs, on_op_done=done, skip=[r.op for r in earlier])
    result = orch.run()
    if earlier:
        result.records = [*earlier, *result.records]
        result.started = min(result.started, *(r.submitted for r in earlier))
    per_it = iteration_metrics(result, cfg)
    for m in per_it:
        writer.iteration(m)
    writer.decisions(result.decisions)
    writer.close()
    return {"iterations": per_it, "wall_s": result.wall_s, "ops": len(result.records),
            "run_dir": str(run_dir), "decisions": result.decisions,
            "critical_path": critical_path(result.records, orch.plan.deps)}
