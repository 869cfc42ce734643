"""The one table of stages: op kind -> `fn(ctx, op) -> StageResult`.

`run_stage(run_dir, op)` is what every executor runs in a worker (on the real stack as a plain
Dask task, which the flow reports as a Prefect task run, `tasks/task_runs.py`): fault point,
the worker's context, the stage, and the measurements every stage reports (worker, wall and
CPU time).
"""

from __future__ import annotations

import hashlib
import os
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

from flexmarl_core.inference.api import PartialBackend
from flexmarl_core.ops import KINDS, FusedResult, Op, OpKind, StageResult, check_after
from flexmarl_core.ops import ConsistencyError as ConsistencyError  # where the stages' callers look
from flexmarl_core.runfiles.location import weights_key
from flexmarl_core.runtime.worker import WorkerContext, context
from flexmarl_core.stages.faults import fault_point
from storage import retry

StageFn = Callable[[WorkerContext, Op], StageResult]
STAGES: dict[OpKind, StageFn] = {}
#: the stages that run an op away from its agent's trainer (`Route.gradient_only`)
GRADIENT_STAGES: dict[OpKind, StageFn] = {}


def stage(kind: OpKind, *, gradient_only: bool = False) -> Callable[[StageFn], StageFn]:
    """Register the stage of one op kind (`gradient_only`: its gradient-helper stage); a second
    registration of a kind is an error."""
    if kind not in KINDS:  # its traits first (`ops.register_kind`): how the run places it
        raise ValueError(f"unknown op kind {kind!r}; kinds: {list(KINDS)}")
    table = GRADIENT_STAGES if gradient_only else STAGES

    def register(fn: StageFn) -> StageFn:
        if kind in table:
            raise ValueError(f"stage {kind!r} is already registered ({table[kind].__qualname__})")
        table[kind] = fn
        return fn

    return register


def worker_name() -> str:
    return os.environ.get("FLEXMARL_WORKER_NAME") or f"{socket.gethostname()}:{os.getpid()}"


def stage_seed(*parts: object) -> int:
    """A seed that depends only on the node's identity, never on where or when it runs."""
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:4], "little")


def weights_version(ctx: WorkerContext, agent: str, iteration: int) -> int:
    """One optimizer step per iteration: iteration i rolls out with version i (frozen: 0).

    With `codesign.max_staleness` k > 0: the newest version published so far among
    i, i-1, ..., i-k (the plan makes iteration i wait until version i-k is published)."""
    if not ctx.cfg.agent(agent).trainable:
        return 0
    k = ctx.cfg.codesign.max_staleness
    oldest = max(iteration - k, 0)
    for v in range(iteration, oldest, -1):
        if ctx.loc.exists(weights_key(agent, v)):
            return v
    return oldest


#: decode steps between two looks for newer weights in a partial rollout (one stat each)
RESUME_EVERY = 16


def newer_weights(ctx: WorkerContext, op: Op, eng: PartialBackend) -> Callable[[], bool]:
    """`codesign.partial_rollouts`: a callback for `eng.generate_partial` that loads the newest
    weights of `op`'s agent published since `eng`'s version (never past the op's iteration) into
    the engine, and says whether it did. Its first call is the `<op> decode` fault point, where
    a test holds a rollout mid-decode until a sync has published (`stages/faults.py`)."""
    first = [True]

    def refresh() -> bool:
        if first:
            first.clear()
            fault_point(ctx.loc.uri, f"{op.name} decode")
        for v in range(op.iteration, eng.version, -1):
            if ctx.loc.exists(weights_key(op.agent, v)):
                ctx.engine(op.agent, v)  # the same engine, its weights replaced
                return True
        return False

    return refresh


def retryable(exc: BaseException) -> bool:
    """False for an error that says another try would fail alike (`retryable = False` on it or
    on an error it was raised from: a sandbox that cannot start programs)."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "retryable", True) is False:
            return False
        seen = seen.__cause__
    return True


def run_stage_retrying(run_dir: str, op: Op, retries: int = 0, delay_s: float = 1.0, *,
                       gradient_only: bool = False) -> StageResult:
    """`run_stage`, tried up to `1 + retries` times in this worker. The result lists the failed
    attempts (`StageResult.retries`); when every attempt fails, the last error is raised with
    all attempts as its `flexmarl_attempts`, so the flow can report each one."""
    failed: list[list[Any]] = []
    r0 = retry.retried()
    while True:
        t0 = time.time()
        try:
            res = run_stage(run_dir, op, gradient_only=gradient_only)
        except Exception as exc:
            failed.append([t0, time.time(), f"{type(exc).__name__}: {exc}"])
            if len(failed) > retries or not retryable(exc):
                exc.flexmarl_attempts = failed  # type: ignore[attr-defined]
                raise
            time.sleep(delay_s)
            continue
        res.retries = failed
        if retry.retried() > r0:  # object-store faults its attempts rode out (or a concurrent op's)
            res.metrics["store/retries"] = float(retry.retried() - r0)
        return res


def run_stage_after(run_dir: str, op: Op, retries: int, delay_s: float,
                    *after: StageResult | FusedResult, gradient_only: bool = False) -> StageResult:
    """`run_stage_retrying` for an op chained on others (`after`: their results, which the
    executor waited for; `ops.check_after`)."""
    check_after(op, after)
    return run_stage_retrying(run_dir, op, retries, delay_s, gradient_only=gradient_only)


def run_fused(run_dir: str, ops: list[Op], retries: list[int], delay_s: float,
              *after: StageResult | FusedResult) -> FusedResult:
    """Run a chain of ops one after another in this worker, each as `run_stage_retrying`
    (the orchestrator fuses a chain whose ops would all run here anyway: one Dask task and
    no round trip per op). Stops at the first op that fails for good; the results of the
    ones before it are returned with that error."""
    check_after(ops[0], after)
    tries = dict(zip(ops, retries, strict=True))
    return FusedResult.run(ops, lambda op: run_stage_retrying(run_dir, op, tries[op], delay_s))


def run_stage(run_dir: str, op: Op, *, gradient_only: bool = False) -> StageResult:
    """Run `op`'s stage in this process, measured (`gradient_only`: a train op as a gradient
    helper, `GRADIENT_STAGES`)."""
    fault_point(run_dir, op.name)
    if gradient_only and op.kind not in GRADIENT_STAGES:
        raise ValueError(f"{op.name}: no stage runs a {op.kind} op as a gradient helper")
    fn = GRADIENT_STAGES[op.kind] if gradient_only else STAGES[op.kind]
    t0, c0 = time.time(), time.process_time()
    res = fn(context(run_dir), op)
    res.worker, res.t_start, res.t_end = worker_name(), t0, time.time()
    res.cpu_s = time.process_time() - c0
    # Linux reports ru_maxrss in KiB: the process's peak, what Dask's memory monitor watches.
    res.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res
