"""A simulated cluster behind the orchestrator's `Executor` seam: discrete events on a virtual
clock, no sleeping. The real `Plan`, routing, instance balancing and on-demand allocation run
unchanged; only the ops' durations come from a `CostModel`.

Each worker (a device group) runs one op at a time and queues the rest FIFO, like a 1-thread
Dask worker; with `cost.replica_release`, a rollout frees the group replica by replica and the
next rollout starts on the replicas already free (`_release`). What a worker holds decides
what an op costs there, as in `runtime/worker.py`: a rollout on a worker without the agent's engine
builds it; with an older version it loads the published weights; a trainer op where the
agent's trainer is not at its version swaps the state in from the checkpoint tier; a step
checkpoints it (swap out); a sync updates an engine of the agent on the same worker in place.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from flexmarl_core.config import ExperimentConfig
from flexmarl_core.control import OrchestratorError
from flexmarl_core.meg import MEG, NodeKey
from flexmarl_core.ops import KindTraits, Op, Route, StageResult, agent_key, traits
from flexmarl_core.sim.cost import CostModel, op_rng

_FREE, _SEEN = 0, 1  # event kinds; at equal times a worker frees before a completion is seen


Price = Literal["rollout", "reward", "train", "step", "sync"]


def priced_as(kind: KindTraits) -> Price | None:
    """Which of the cost model's formulas (`sim/cost.py`, a graph team's ops) prices an op of
    this kind, read from its traits; None: none does (a program's or an environment's host op,
    a critic's forward), and a guess would be a wrong answer."""
    if kind.generates and kind.placement == "instance":
        return "rollout"
    if kind.scores and kind.placement == "anywhere":
        return "reward"
    if kind.trains:
        return "train"
    if kind.steps:
        return "step"
    if kind.publishes:
        return "sync"
    return None


@dataclass
class _Job:
    op: Op
    worker: str
    submitted: float
    base_s: float  #: the op's own work; state-dependent extras are added when it starts
    gradient_only: bool = False  #: a train op run as a gradient helper (`Route.gradient_only`)
    #: a rollout on replicas released one by one: its worker takes the next op before it ends,
    #: but counts its work as queued until it does (`_pick` must not see the group as free)
    released: bool = False
    result: StageResult | None = None


class SimExecutor:
    """`workers`: `{name: resource tags}`; `seed` fixes the sampled response lengths."""

    def __init__(self, cost: CostModel, workers: dict[str, dict[str, float]], cfg: ExperimentConfig,
                 meg: MEG, seed: int = 0) -> None:
        self.cost, self.cfg, self.meg, self.seed = cost, cfg, meg, seed
        self.resources = {w: dict(r) for w, r in workers.items()}
        self.t = 0.0
        self._jobs: dict[int, _Job] = {}
        self._events: list[tuple[float, int, int, str | int]] = []
        self._seq = 0
        self._queue: dict[str, deque[int]] = {w: deque() for w in workers}
        self._running: dict[str, int | None] = dict.fromkeys(workers)
        self._backlog: dict[str, float] = dict.fromkeys(workers, 0.0)
        #: per worker: agent -> engine version / trainer version, in LRU order
        self._engines: dict[str, OrderedDict[str, int]] = {w: OrderedDict() for w in workers}
        self._trainers: dict[str, OrderedDict[str, int]] = {w: OrderedDict() for w in workers}
        #: per worker: agent -> weights version its gradient helper holds
        self._helpers: dict[str, dict[str, int]] = {w: {} for w in workers}
        self._lengths: dict[tuple[str, int, int, int], np.ndarray] = {}
        b = cfg.batch
        self._seqs = b.micro_batch_inputs * b.group_size
        #: rollout seconds workers were held, and replica-seconds of actual decoding in them
        self.rollout_held_s = 0.0
        self.rollout_replica_busy_s = 0.0
        #: `cost.replica_release`: when each worker's engine replicas are next free
        self._replicas = max((a.replicas for a in cost.agents.values()), default=1)
        self._rep_free: dict[str, list[float]] = {w: [0.0] * self._replicas for w in workers}

    # -- Executor protocol ---------------------------------------------------------------

    def submit(self, op: Op, route: Route, deps: Sequence[Op] = ()) -> int:
        worker = route.worker or self._pick(route)
        if worker not in self.resources:
            raise OrchestratorError(f"{op.name}: route names unknown worker {worker!r}")
        hid = self._seq = self._seq + 1
        job = _Job(op, worker, self.t, self._base_s(op), route.gradient_only)
        self._jobs[hid] = job
        self._backlog[worker] += job.base_s
        if self._running[worker] is None:
            self._start(hid, self.t + self.cost.dispatch_s)
        else:
            self._queue[worker].append(hid)
        return hid

    def wait_any(self, handles: Sequence[int], timeout: float | None = None) -> list[int]:
        done: list[int] = []
        while self._events:
            t, kind, _, what = self._events[0]
            if done and (t > self.t or kind == _FREE):
                break
            heapq.heappop(self._events)
            self.t = max(self.t, t)
            if kind == _FREE:
                self._free(str(what), t)
            else:
                done.append(int(what))
        if not done and handles:
            raise OrchestratorError(f"simulation stalled with {len(handles)} ops in flight")
        return done

    def result(self, handle: int) -> StageResult:
        job = self._jobs.pop(handle)
        if job.result is None:  # set when the op starts, always before its completion is seen
            raise OrchestratorError(f"{job.op.name}: result asked for before the op started")
        if job.released:
            self._backlog[job.worker] = max(self._backlog[job.worker] - job.base_s, 0.0)
        return job.result

    def now(self) -> float:
        return self.t

    def worker_resources(self) -> dict[str, dict[str, float]]:
        return {w: dict(r) for w, r in self.resources.items()}

    def set_worker_resources(self, worker: str, resources: dict[str, float]) -> None:
        self.resources[worker].update(resources)

    def lost(self, exc: BaseException) -> bool:
        return False  # simulated workers do not die

    # -- scheduling ----------------------------------------------------------------------

    def _pick(self, route: Route) -> str:
        """Like Dask for a task with resource restrictions and no pinned worker: the valid
        worker whose queued work ends first."""
        need = route.resources.items()
        ok = [w for w, r in self.resources.items() if all(r.get(k, 0) >= v for k, v in need)]
        if not ok:
            raise OrchestratorError(f"no simulated worker has resources {route.resources}")
        return min(ok, key=lambda w: (self._backlog[w], w))

    def _push(self, t: float, kind: int, what: str | int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, what))

    def _start(self, hid: int, t0: float) -> None:
        job = self._jobs[hid]
        self._running[job.worker] = hid
        extra, swap = self._helper_s(job.op, job.worker) if job.gradient_only else self._prepare(job.op, job.worker)
        if self.cost.replica_release and traits(job.op.kind).placement == "instance":
            job.released = True
            free_at, end = self._release(job, t0, extra)
            job.result = self._result(job.op, job.worker, t0, end, swap)
            self._push(free_at, _FREE, job.worker)
            self._push(end + self.cost.report_s, _SEEN, hid)
            return
        if self.cost.replica_release:  # any other op needs the whole group
            t0 = max(t0, *self._rep_free[job.worker])
        secs = job.base_s + extra
        if traits(job.op.kind).steps:
            swap["swap_out_s"] = self.cost.step_s(job.op.agent)[1]
            swap["swap_out_bytes"] = self.cost.agent(job.op.agent).state_bytes
        job.result = self._result(job.op, job.worker, t0, t0 + secs, swap)
        self._push(t0 + secs, _FREE, job.worker)
        self._push(t0 + secs + self.cost.report_s, _SEEN, hid)

    def _release(self, job: _Job, t0: float, extra: float) -> tuple[float, float]:
        """A rollout on replicas released one by one: its sequences are dealt over the k
        earliest-free replicas, the k that ends it soonest (each share, longest first, to the
        replica free first); each replica is free again when its own share ends, and the worker
        takes its next op once one replica is. Returns (when the worker takes its next op, the
        op's end)."""
        op, free = job.op, self._rep_free[job.worker]
        order = sorted(range(len(free)), key=lambda j: free[j])
        prompts = self.prompts(op.agent, op.turn, op.iteration, op.mb)
        lengths = self.lengths(op.agent, op.turn, op.iteration, op.mb)
        def dealt(k: int) -> tuple[float, list[float], list[float]]:
            shares = self.cost.replica_shares(op.agent, prompts, lengths, k)
            ends = [max(t0, free[order[j]]) + extra + sh for j, sh in enumerate(shares)]
            return max(ends), ends, shares

        n = min(self.cost.agent(op.agent).replicas, len(lengths))
        last, ends, shares = min((dealt(k) for k in range(1, max(n, 1) + 1)), key=lambda d: d[0])
        for j, e in enumerate(ends):
            free[order[j]] = e
        end = last + self.cost.store_s
        self.rollout_held_s += (end - t0) * len(free)
        self.rollout_replica_busy_s += sum(shares)
        return max(t0, min(free)), end

    def _free(self, worker: str, t: float) -> None:
        hid = self._running[worker]
        if hid is not None and not self._jobs[hid].released:
            self._backlog[worker] = max(self._backlog[worker] - self._jobs[hid].base_s, 0.0)
        self._running[worker] = None
        if self._queue[worker]:  # oldest iteration first, then first queued (Dask's priority)
            q = self._queue[worker]
            nxt = min(q, key=lambda h: (self._jobs[h].op.iteration, h))
            q.remove(nxt)
            self._start(nxt, t + self.cost.gap_s)

    # -- costs ---------------------------------------------------------------------------

    def lengths(self, agent: str, turn: int, it: int, mb: int) -> np.ndarray:
        """Response tokens of each sequence of one rollout op (drawn once, by op identity)."""
        key = (agent, turn, it, mb)
        if key not in self._lengths:
            dist = self.cost.agent(agent).lengths
            self._lengths[key] = dist.sample(op_rng(self.seed, *key), self._seqs)
        return self._lengths[key]

    def prompts(self, agent: str, turn: int, it: int, mb: int) -> np.ndarray:
        """Prompt tokens per sequence: the agent's own prompt plus its parents' responses."""
        p = np.full(self._seqs, self.cost.agent(agent).prompt_tokens, dtype=np.int64)
        for parent in self.meg.parents[NodeKey(agent, turn)]:
            p = p + self.lengths(parent.agent, parent.turn, it, mb)
        return p

    def rollout_slots(self, worker: str) -> int:
        """Rollouts `worker` may hold now (`Router.rollout_slots`): a second one while one of its
        replicas is free (replicas released one by one), else one."""
        free = self._rep_free[worker]
        return 2 if self.cost.replica_release and self._replicas > 1 and min(free) <= self.t else 1

    def op_sizes(self, draws: int = 4) -> dict[str, dict[str, float]]:
        """The cost model's mean seconds of each agent's rollout (one round) and train op over
        `draws` sampled micro-batches (a rollout ends with its longest sequence, so the mean
        length would underestimate it): the control plane's warm estimates before an agent is
        measured. The draws are of iterations that never run (-1, -2, ...)."""
        rollout: dict[str, float] = {}
        train: dict[str, float] = {}
        for node in self.meg.nodes:
            a, t = node.agent, node.turn
            held = [self.cost.rollout_s(a, self.prompts(a, t, -1 - k, 0), self.lengths(a, t, -1 - k, 0))[0]
                    for k in range(draws)]
            rollout[a] = max(rollout.get(a, 0.0), sum(held) / draws)
            trained = [self.cost.train_s(a, float(self.prompts(a, t, -1 - k, 0).sum()),
                                         float(self.lengths(a, t, -1 - k, 0).sum())) for k in range(draws)]
            train[a] = train.get(a, 0.0) + sum(trained) / draws
        return {"rollout": rollout, "train": train}

    def _turns(self, agent: str) -> list[int]:
        return [n.turn for n in self.meg.nodes if n.agent == agent]

    def _base_s(self, op: Op) -> float:
        price = priced_as(traits(op.kind))
        if price is None:
            raise ValueError(f"{op.name}: the simulator has no cost model for op kind {op.kind!r}")
        c, it = self.cost, op.iteration
        if price == "rollout":
            held, busy = c.rollout_s(op.agent, self.prompts(op.agent, op.turn, it, op.mb),
                                     self.lengths(op.agent, op.turn, it, op.mb))
            if not c.replica_release:  # else priced when it starts (`_release`)
                self.rollout_held_s += held
                self.rollout_replica_busy_s += held * busy
            return held
        if price == "train":
            turns = self._turns(op.agent)
            p = sum(float(self.prompts(op.agent, t, it, op.mb).sum()) for t in turns)
            r = sum(float(self.lengths(op.agent, t, it, op.mb).sum()) for t in turns)
            return c.train_s(op.agent, p, r)
        if price == "step":
            return sum(c.step_s(op.agent))
        if price == "sync":
            return c.sync_s(op.agent)
        return c.reward_s(self._seqs)

    def _helper_s(self, op: Op, worker: str) -> tuple[float, dict[str, float]]:
        """A gradient helper's extras: the weights of the op's version where this worker's
        helper holds another, and handing on a weights-sized gradient (written here, read by
        the trainer's step)."""
        helpers = self._helpers[worker]
        extra = self.cost.load_s(op.agent) if helpers.get(op.agent) != op.iteration else 0.0
        helpers[op.agent] = op.iteration
        return extra + 2 * self.cost.load_s(op.agent), {}

    def _prepare(self, op: Op, worker: str) -> tuple[float, dict[str, float]]:
        """Seconds the worker's state adds before the op's own work, and swap figures."""
        c, kind = self.cost, traits(op.kind)
        if kind.placement == "instance":
            engines = self._engines[worker]
            version = op.iteration if self.cfg.agent(op.agent).trainable else 0
            have = engines.get(op.agent)
            extra = 0.0
            if have is None:
                extra = c.agent(op.agent).engine_init_s + c.load_s(op.agent)
                _admit(engines, op.agent, c.engines_per_worker)
            elif have != version:
                extra = c.load_s(op.agent)
            engines[op.agent] = version
            engines.move_to_end(op.agent)
            return extra, {}
        if kind.placement == "trainer":
            need = op.iteration + (1 if kind.publishes else 0)
            trainers = self._trainers[worker]
            have = trainers.get(op.agent)
            extra, swap = 0.0, {}
            if have is None or have < need:
                if have is None:
                    extra += c.agent(op.agent).trainer_init_s
                    _admit(trainers, op.agent, c.states_per_slot)
                if need > 0:
                    s = c.swap_in_s(op.agent)
                    extra += s
                    swap = {"swap_in_s": s, "swap_in_bytes": c.agent(op.agent).state_bytes}
                trainers[op.agent] = need
            trainers.move_to_end(op.agent)
            if kind.steps:
                trainers[op.agent] = op.iteration + 1
            elif kind.publishes and op.agent in self._engines[worker]:
                self._engines[worker][op.agent] = op.iteration + 1  # in-memory weight update
            return extra, swap
        return 0.0, {}

    def _result(self, op: Op, worker: str, t0: float, t1: float, swap: dict[str, float]) -> StageResult:
        res = StageResult(op, worker=worker, t_start=t0, t_end=t1, swap=swap)
        price = priced_as(traits(op.kind))
        if price == "rollout":
            n = self.lengths(op.agent, op.turn, op.iteration, op.mb)
            res.samples, res.tokens, res.version = len(n), int(n.sum()), op.iteration
            res.metrics = {agent_key(op.agent, "response_tokens"): float(n.mean())}
        elif price == "train":
            turns = self._turns(op.agent)
            res.samples = self._seqs * len(turns)
            res.tokens = int(sum(self.lengths(op.agent, t, op.iteration, op.mb).sum() for t in turns))
        elif price == "reward":
            # The simulator scores nothing: accuracy is not simulated (NaN, dropped from reports).
            res.samples, res.metrics = self._seqs, {"team/accuracy": math.nan}
        elif price in ("step", "sync"):
            res.version = op.iteration + 1
            if price == "sync":
                res.bytes = int(self.cost.agent(op.agent).weight_bytes)
        return res


def _admit(held: OrderedDict[str, int], agent: str, capacity: int | None) -> None:
    """Make room for one more engine / trainer state: the least recently used one leaves (its
    state is in the checkpoint tier after its last step; a mid-iteration eviction costs a swap
    in when it comes back, which `_prepare` charges)."""
    while capacity is not None and len(held) >= capacity:
        held.popitem(last=False)
