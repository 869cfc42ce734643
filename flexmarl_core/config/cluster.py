"""The cluster's config models: where the workers are (a local cluster's processes and their
resource tags, or an existing scheduler), how the connection is secured, when a running op
counts as hung, and how the run reports to Prefect. Part of `ExperimentConfig` (`models.py`);
`ClusterConfig` and `WorkerConfig` are also exported by `flexmarl_core.config`.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from flexmarl_core.config.agent import _Strict
from flexmarl_core.ops import KINDS

#: a reward call's deadline when `cluster.deadlines.per_kind_s` sets none for `reward`
DEFAULT_REWARD_S = 60.0


class WorkerConfig(_Strict):
    name: str = Field(description="Worker name (shows in the Dask dashboard and metrics).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Dask resource tags, e.g. {'rollout:solver': 1, 'train': 1}."
    )
    nthreads: int = Field(1, ge=1, description="Threads per worker process.")
    memory_limit: str = Field("6GiB", description="Dask worker memory limit.")
    resident_trainers: int | None = Field(
        None, ge=1,
        description="Trainer states this worker keeps in memory at once; the least recently used "
        "beyond it is swapped out to the run folder and back in when needed (on-demand allocation). "
        "None: as many as the memory plan fits in memory_limit (every one when all fit).",
    )


class DeadlineConfig(_Strict):
    """When a running op counts as hung (it neither ends nor fails): it is then cancelled, its
    worker restarted and the op run again (`orchestrator.loop.Orchestrator`, decision `hung_op`)."""

    factor: float = Field(
        10.0, gt=1.0,
        description="Hung after this many times its estimate: the moving average of its kind's "
        "finished ops for its agent, times the ops queued ahead of it on its worker.",
    )
    floor_s: float = Field(300.0, gt=0.0, description="Never hung sooner than this.")
    per_kind_s: dict[str, float] = Field(
        default_factory=dict,
        description="Fixed deadlines in seconds by op kind (rollout, train, step, sync, program), used "
        "instead of factor and floor_s. `reward` bounds each reward call (one trajectory's scoring, "
        "in a reward or program op, default 60): past it that input's trajectories fail and train "
        "nobody, and the run goes on.",
    )
    reward_timeouts: int = Field(
        3, ge=1,
        description="Inputs in a row whose reward ran past its deadline that stop the run (the "
        "reward function is broken or too slow), with an error naming it and the input; counted "
        "across the run's workers, and an input scored in time on any of them starts the count again.",
    )

    @property
    def reward_s(self) -> float:
        """One reward call's deadline."""
        return self.per_kind_s.get("reward", DEFAULT_REWARD_S)

    @field_validator("per_kind_s")
    @classmethod
    def _kinds(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(set(v) - set(KINDS))
        if bad:
            raise ValueError(f"unknown op kind(s) {bad}; kinds: {list(KINDS)}")
        low = sorted(k for k, s in v.items() if not s > 0)
        if low:
            raise ValueError(f"deadline(s) of {low} must be > 0 seconds")
        return v


class TLSFilesConfig(_Strict):
    """This process's certificate for a Dask cluster secured with TLS (`flexmarl cluster certs`
    makes a set). Each value is a file path, or a `${env:NAME}` / `${secret:BLOCK}` reference
    holding the PEM text itself."""

    ca_file: str = Field(description="The cluster's CA certificate (PEM): peers must be signed by it.")
    cert_file: str = Field(description="This process's certificate (PEM): the flow's client "
                           "certificate at `address`; every role's for a local cluster.")
    key_file: str | None = Field(None, description="Its private key (PEM); None: appended to cert_file.")


class ClusterConfig(_Strict):
    address: str | None = Field(
        None, description="Existing Dask scheduler address; None starts a local cluster."
    )
    workers: list[WorkerConfig] = Field(
        default_factory=lambda: [
            WorkerConfig(name="w0", resources={"rollout": 1, "train": 1}),
            WorkerConfig(name="w1", resources={"rollout": 1, "train": 1}),
        ],
        description="Local worker processes and their resource tags, or `auto`: chosen from the "
        "machine's cores and the team when the config loads (config/layout.py; `cluster.layout` "
        "says what and why).",
    )

    torch_threads: int = Field(1, ge=1, description="torch.set_num_threads in each worker, or `auto`: the "
                               "cores over the workers' threads.")
    layout: str | None = Field(
        None, description="Set when `workers` or `torch_threads` is auto: the layout chosen and why "
        "(printed at the start of a run, kept in the run folder's config so a resume keeps it).",
    )
    security: Literal["auto", "none"] | TLSFilesConfig = Field(
        "auto",
        description="TLS on every Dask connection (cluster/security.py). auto: a local cluster gets "
        "certificates made for the run, in memory; at a tls:// `address` the flow uses Dask's own "
        "TLS settings (distributed.comm.tls.*), and a tcp:// one is refused. A {ca_file, cert_file, "
        "key_file} mapping: those files. none: plain tcp, which anyone who reaches the scheduler "
        "can use to run code as you.",
    )
    dashboard_address: str | None = Field(
        "127.0.0.1:0", description="Where a local cluster's dashboard listens (host:port, port 0 "
        "any free one); None: no dashboard. Bind it beyond 127.0.0.1 only behind your own access control.",
    )
    worker_env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment variables of the local worker processes (e.g. OpenMP's "
        "GOMP_SPINCOUNT); not applied to a cluster at `address`. A value may be (or contain) a "
        "secret reference, resolved when the workers start and never written anywhere: "
        "`${env:NAME}` (the flow process's variable NAME) or `${secret:BLOCK}` (the Prefect Secret "
        "block BLOCK), e.g. `AWS_SECRET_ACCESS_KEY: ${secret:s3-key}` (docs/operations.md).",
    )
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$",
                        description="torch device of the workers' engines and trainers: cpu, cuda, cuda:N.")
    prefect_api_url: str | None = Field(
        None, description="Prefect API to report to; None uses PREFECT_API_URL or starts one."
    )
    upload: list[str] = Field(
        default_factory=list,
        description="Local folders (their .py files, zipped) or .py/.zip files shipped to every Dask "
        "worker before the run, joining workers too (Dask's upload_file): code the workers lack, e.g. "
        "your reward module's folder, or the project root where flexmarl is not installed.",
    )
    look_ahead: bool = Field(
        True,
        description="Submit an op whose route is already fixed as soon as its dependencies are "
        "submitted, chained on them in Dask, so it starts when they end without a round trip "
        "through the flow process (orchestrator/policies.py).",
    )
    fuse_chains: bool = Field(
        True,
        description="Run a chain of ops that would all run on one worker anyway (one agent's "
        "rollout -> reward -> train -> step -> sync when its routes are fixed) as one Dask task: "
        "one dispatch instead of one per op; each op keeps its record, task run and retries "
        "(orchestrator/policies.py).",
    )
    pending_after_s: float = Field(
        2.0, ge=0.0,
        description="An op's Prefect task run shows Pending once the op has been submitted this "
        "long; a shorter op sends only its final state (one event instead of two). 0: Pending at "
        "submission (tasks/task_runs.py).",
    )
    task_run_flush_s: float = Field(
        2.0, ge=0.0,
        description="The final states of ops that went well are sent to the Prefect API together "
        "this often, so the API server records them in bursts instead of waking for every op (the "
        "UI lags by at most this); retries, failures and Pending go at once. 0: each as it "
        "happens (tasks/task_runs.py).",
    )
    deadlines: DeadlineConfig = Field(default_factory=DeadlineConfig,
                                      description="When a running op counts as hung.")
    prefect_nested: bool = Field(
        True, description="Each iteration is a flow run of its own (`flexmarl-iteration`) nested "
        "under the training run's, holding that iteration's op task runs: the Prefect UI draws a "
        "graph of at most 10,000 task runs, so a flat run stops drawing past a few hundred "
        "iterations (tasks/iteration_runs.py). false: every op in the training run's flow run.",
    )
    iterations_per_flow_run: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="How many iterations one nested flow run holds (with `prefect_nested`). auto: "
        "one each until the run's pace is known, then as many as the run makes in 5 s (at most "
        "100), so a run of short iterations costs the Prefect server a few calls per 5 s instead "
        "of per iteration (tasks/iteration_runs.py).",
    )
    prefect_lean: bool | Literal["auto"] = Field(
        "auto",
        description="Workers read cheap Prefect settings from their own environment (tasks/lean.py), "
        "for code in them that talks to Prefect (stage ops do not). auto: on for a cluster "
        "flexmarl starts, off for `address`; true: the remote workers' env has PREFECT_API_URL.",
    )

    @model_validator(mode="after")
    def _workers(self) -> ClusterConfig:
        names = [w.name for w in self.workers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate worker name(s) {dupes} in workers; names must be unique")
        if self.address is None and not self.workers:
            raise ValueError(
                "no workers: a local cluster needs at least one in cluster.workers (or set "
                "cluster.address to use an existing scheduler)"
            )
        if self.address is not None:
            # no scheme is Dask's tcp; what does not parse is left to check_address, which names it
            scheme = self.address.split("://", 1)[0] if "://" in self.address else \
                "tcp" if re.fullmatch(r"[^:/]+:\d+", self.address) else "?"
            if scheme == "tcp" and self.security == "auto":
                raise ValueError(
                    f"address {self.address!r} is plain tcp: anyone who reaches that scheduler runs "
                    "code as you. Use a tls:// scheduler (docs/cluster.md, Security) with Dask's TLS "
                    "settings or cluster.security: {ca_file, cert_file, key_file}, or set "
                    "cluster.security: none to accept an unencrypted cluster"
                )
            if scheme != "tls" and isinstance(self.security, TLSFilesConfig):
                raise ValueError(f"security names certificates but address {self.address!r} is not "
                                 "tls://; use the scheduler's tls:// address")
        if self.address is not None and self.worker_env:
            raise ValueError(
                f"worker_env has no effect with address={self.address!r} (it is the environment of "
                "the worker processes flexmarl starts, not of an existing cluster's); set it where "
                "that cluster's workers start, or remove it"
            )
        return self
