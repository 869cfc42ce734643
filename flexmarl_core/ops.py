"""The types every layer passes: an op (one node of the iteration graph), where it runs, and
what it measured. Nothing else crosses the boundary between the orchestrator, the executors
(threads, Prefect-on-Dask, the simulator) and the stages.

    Plan ──► Op ──► control.Router ──► Route ──► Executor.submit(op, route, deps)
                                                    │ in a worker: stages.run_stage(run_dir, op)
    Orchestrator ◄── OpRecord(op, submitted, finished, StageResult) ◄┘
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

#: an op kind's name: one of `KINDS` (the built-in ones, or one a plugin registered)
OpKind = str
Placement = Literal["instance", "trainer", "host", "anywhere"]
#: whose rows an op kind writes to a table of the store: its own agent's, every agent's, none
Reach = Literal["own", "all", ""]


@dataclass(frozen=True, slots=True)
class KindTraits:
    """What the shared path knows of an op kind: the router places it by `placement`, the
    metrics, the balancer, the simulator, the audit and the repair read the rest; none of them
    asks for a kind by name. A new kind declares its traits here (`register_kind`) and its
    stage in `stages/` (`stages.registry.stage`).

    placement: `instance` runs on one of its agent's rollout instances (by tag, balanced);
    `trainer` on its agent's trainer slot, one such op at a time (its state lives in one
    process); `host` anywhere, at most one per rollout instance at once, its decodes going to
    the agents' instances; `anywhere` is cheap and runs on any worker."""

    placement: Placement
    generates: bool = False  #: decodes: its tokens are the iteration's, balancing runs before it
    scores: bool = False  #: reports `team/accuracy` and each agent's `reward`
    trains: bool = False  #: a gradient for its agent's step; final only once that step is logged
    steps: bool = False  #: makes its agent's next weights version
    publishes: bool = False  #: hands a weights version to the agent's engines
    samples: Reach = ""  #: whose sample rows it writes (a repair rewinds it for their damage)
    status: Reach = ""  #: whose status rows (rewards, advantages, values) it writes
    retries: int = 2  #: task retries in its worker (a worker that dies is Dask's to rerun)
    #: seconds assumed before an op of the kind was measured (what placement and deadlines
    #: start from; a train micro-batch ~ 2 rollouts on CPU)
    guess_s: float = 1.0


KINDS: dict[str, KindTraits] = {
    "rollout": KindTraits("instance", generates=True, samples="own", guess_s=1.0),
    "reward": KindTraits("anywhere", scores=True, status="all", guess_s=0.05),
    "train": KindTraits("trainer", trains=True, status="own", retries=1, guess_s=2.0),
    "step": KindTraits("trainer", steps=True, retries=1, guess_s=0.05),
    "sync": KindTraits("trainer", publishes=True, guess_s=0.05),
    "program": KindTraits("host", generates=True, scores=True, samples="all", status="all", guess_s=3.0),
    #: an environment team's episodes of a micro-batch (`teams/environment.py`)
    "episode": KindTraits("host", generates=True, scores=True, samples="all", status="all", guess_s=3.0),
    #: a critic's forward over a micro-batch (`flexmarl_core/config/critic.py`)
    "value": KindTraits("trainer", status="all", guess_s=0.5),
}


def register_kind(name: str, traits: KindTraits) -> None:
    """Add op kind `name` (a second registration of a name is an error)."""
    if name in KINDS:
        raise ValueError(f"op kind {name!r} is already registered")
    KINDS[name] = traits


def traits(kind: str) -> KindTraits:
    """The traits of op kind `kind`; an unknown kind is an error naming the known ones."""
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown op kind {kind!r}; kinds: {list(KINDS)}") from None


def on_trainer(kind: str) -> bool:
    """Whether ops of `kind` run on their agent's trainer (one at a time); False for a kind
    without traits (the router refuses it)."""
    return kind in KINDS and KINDS[kind].placement == "trainer"


def reaches(reach: Reach, mine: bool) -> bool:
    """Whether rows written with `reach` include those of an agent (`mine`: the op's own)."""
    return reach == "all" or (reach == "own" and mine)


@dataclass(frozen=True, slots=True, order=True)
class Op:
    """One node of the iteration task graph: `rollout` of an agent's turn on a micro-batch,
    `reward` of a micro-batch (every agent), `train` of an agent on a micro-batch, its
    `step` and its weight `sync` once per iteration. `mb = -1`: not per micro-batch."""

    iteration: int
    kind: OpKind
    agent: str = ""
    turn: int = 0
    mb: int = -1

    @property
    def name(self) -> str:
        """The op's one name: task runs, fault markers and the op log all use it."""
        who = f"[{self.agent}]" if self.agent else ""
        turn = f"@{self.turn}" if self.kind == "rollout" and self.turn else ""
        mb = f" mb={self.mb}" if self.mb >= 0 else ""
        return f"{self.kind}{who}{turn} it={self.iteration}{mb}"


@dataclass(frozen=True, slots=True)
class Route:
    """Where an op runs: Dask resources it needs and, optionally, one worker it is pinned to.
    `gradient_only`: a train op run away from its agent's trainer (`codesign.gradient_helpers`):
    the worker computes the micro-batch's gradient and leaves it for the trainer's step."""

    resources: dict[str, float]
    worker: str | None = None
    gradient_only: bool = False


def agent_key(agent: str, metric: str) -> str:
    """The namespaced key of one agent's metric: `agent/<name>/<metric>`."""
    return f"agent/{agent}/{metric}"


@dataclass(slots=True)
class StageResult:
    """What one stage did, measured in the worker that ran it.

    Scalars that belong to an agent are in `metrics` under `agent/<name>/<metric>` (e.g.
    `agent/solver/reward`, `agent/solver/train/loss`); team-wide ones under `team/<metric>`.
    """

    op: Op
    samples: int = 0  #: samples written (rollout), scored (reward) or trained on (train)
    tokens: int = 0  #: sampled response tokens (rollout); loss tokens (train)
    version: int | None = None  #: policy version used (rollout) or produced (step, sync)
    skipped: bool = False  #: a retry that found its work already done
    bytes: int = 0  #: bytes of weights published (sync)
    metrics: dict[str, float] = field(default_factory=dict)
    #: on-demand allocation traffic: swap_in_s, swap_in_bytes, swap_out_s, swap_out_bytes
    swap: dict[str, float] = field(default_factory=dict)
    worker: str = ""
    t_start: float = 0.0
    t_end: float = 0.0
    cpu_s: float = 0.0
    #: attempts that failed before this one: `[t_start, t_end, "Error: message"]` each
    retries: list[list[Any]] = field(default_factory=list)
    #: the worker process's peak resident memory so far (bytes; 0 where not measured)
    peak_rss: int = 0
    #: where the op's work ran when not on its own worker: `[worker, t_start, t_end]` each (a
    #: program op's decodes on its agents' instances); empty: the op's own span
    busy: list[list[Any]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.t_end - self.t_start

    def per_agent(self, metric: str) -> dict[str, float]:
        """`{agent: value}` of one namespaced metric, e.g. `per_agent("reward")`."""
        out = {}
        for k, v in self.metrics.items():
            if k.startswith("agent/") and k.endswith("/" + metric):
                agent = k[len("agent/") : -len(metric) - 1]
                if "/" not in agent:
                    out[agent] = v
        return out

    def to_row(self) -> dict[str, Any]:
        """A flat JSON-able row for the op log (`metrics/ops.jsonl`)."""
        row = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("op", "metrics", "swap")}
        return {**asdict(self.op), "op": self.op.name, **row, **self.swap, **self.metrics}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> StageResult:
        """Back from an op-log row (resume reads the log of an interrupted attempt)."""
        op = Op(row["iteration"], row["kind"], row.get("agent", ""), row.get("turn", 0), row.get("mb", -1))
        plain = {f.name for f in fields(cls)} - {"op", "metrics", "swap"}
        return cls(
            op=op,
            **{k: row[k] for k in plain if k in row},
            swap={k: float(v) for k, v in row.items() if k.startswith("swap_")},
            metrics={k: float(v) for k, v in row.items() if k.startswith(("agent/", "team/"))},
        )


#: Environment variable through which `cluster.workers` tells a worker process its memory limit
#: (bytes); the trainer sizes its chunks from it (`training/memory.py`).
MEMORY_ENV = "FLEXMARL_WORKER_MEMORY_BYTES"


@dataclass(frozen=True, slots=True)
class MemoryRestart:
    """A worker that Dask's Nanny restarted for crossing its memory limit."""

    worker: str  #: its name (`w1`)
    rss: int  #: resident bytes when it was restarted
    limit: int  #: its memory limit in bytes (0: unknown)
    t: float  #: when (seconds, the scheduler's clock)

    def describe(self) -> str:
        gib = 1024**3
        limit = f"{self.limit / gib:.2f} GiB" if self.limit else "an unknown"
        return f"worker {self.worker} at {self.rss / gib:.2f} GiB resident (memory limit {limit})"


@dataclass(slots=True)
class FusedResult:
    """What one fused run of a chain of ops did (`stages.run_fused`): the results of the ops
    that ran, in chain order, and the error of the one that failed for good (its retries
    spent); the ops after it did not run."""

    results: list[StageResult]
    error: BaseException | None = None

    @classmethod
    def run(cls, ops: Sequence[Op], fn: Callable[[Op], StageResult]) -> FusedResult:
        """`fn` on each op in order, stopping at the first that raises (what every executor
        that fuses does in its worker)."""
        out = cls([])
        for op in ops:
            try:
                out.results.append(fn(op))
            except Exception as exc:
                out.error = exc
                break
        return out


class ConsistencyError(RuntimeError):
    """A sample would train a policy version it may not: on-policy (`max_staleness` 0), one
    other than the one that produced it; with staleness k, one more than k versions newer."""


class DependencyFailed(RuntimeError):
    """An op chained on a fused run started after an op of that run failed: it does not run."""


def check_after(op: Op, after: Sequence[Any]) -> None:
    """Before `op` starts, chained on `after` (its dependencies' results): a fused run ends
    well even when one of its ops failed (its other results must reach the flow), so such a
    dependency is refused here."""
    for res in after:
        if isinstance(res, FusedResult) and res.error is not None:
            raise DependencyFailed(f"{op.name} not run: an op it was chained on failed ({res.error!r})")


@dataclass(slots=True)
class OpRecord:
    """One finished op as the orchestrator saw it: client-side times around the stage's own."""

    op: Op
    submitted: float
    finished: float
    result: StageResult
