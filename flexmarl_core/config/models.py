"""The experiment's config models: one pydantic model per component, composed into
`ExperimentConfig` (an agent's own models are in `agent.py`, the cluster's in `cluster.py`). Every field has a
description, and every model forbids unknown keys, so a typo fails at load time with the file,
the field path and what was wrong. Rules that need more than the models (the registries, the
team graph) are checked where configs are read (`load.py`); import all of it from
`flexmarl_core.config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from flexmarl_core.config import layout
from flexmarl_core.config.agent import AgentConfig, CriticConfig, _Strict
from flexmarl_core.config.checks import check_name, check_template
from flexmarl_core.config.cluster import ClusterConfig
from flexmarl_core.config.codesign import CodesignConfig
from flexmarl_core.config.environment import EnvironmentConfig


class EdgeConfig(_Strict):
    src: str = Field(description="Agent whose output is fed forward.")
    dst: str = Field(description="Agent whose prompt receives it.")
    recurrent: bool = Field(
        False, description="True: src's output in round r feeds dst in round r+1 (debate/refine)."
    )


class TeamConfig(_Strict):
    shape: str = Field(
        "graph",
        description="The kind of team (a registered team shape, `flexmarl_core/teams/`): graph (agents "
        "with templates fed along `edges`), program (`team.program` calls its agents) or environment "
        "(`team.environment` decides whose turn it is). Default: program when `team.program` is set, "
        "environment when `team.environment` is, else graph.",
    )
    agents: list[AgentConfig] = Field(description="The agents (MEG nodes).")
    edges: list[EdgeConfig] = Field(default_factory=list, description="Data flow (MEG edges).")
    rounds: int = Field(1, ge=1, le=16, description="Rounds unrolled into the DAG.")
    output: str | None = Field(
        None, description="Agent whose final output is the team's answer; default: the single sink "
        "(a program team: the agent whose score the program's returned answer is; default its last agent)."
    )
    program: str | None = Field(
        None,
        description="The team as a Python program instead of edges and templates: `module:function` or "
        "`path/to/file.py:function` (relative to the working directory), a function `(problem, client) "
        "-> answer` that calls its agents through a stock `openai` client (`async def`: an AsyncOpenAI "
        "client) pointed at flexmarl's OpenAI-compatible endpoint, `model=<agent name>`. Each call is "
        "recorded as a sample of its agent (docs/programs.md).",
    )
    program_groups: Literal["call", "trajectory"] = Field(
        "call",
        description="Program teams, where trajectories call an agent a different number of times: how an "
        "agent's GRPO groups form. call: the k-th calls of the agent in one input's trajectories form a "
        "group (AT-GRPO's agent-and-turn groups); trajectory: each trajectory's reward is normalised "
        "over the input's trajectories and every call of the trajectory gets that advantage.",
    )
    environment: EnvironmentConfig | None = Field(
        None, description="The team plays an environment (a game, a shared-state task): its spec, which "
        "agent (or scripted policy) plays each seat, and how answers become samples (docs/environments.md).",
    )
    policy_errors: list[str] = Field(
        default_factory=list,
        description="Program teams: exception types (`module.QualName`, or a bare class name) that mean a "
        "trajectory failed because of what the model said, beside the built-in ones (the Agents SDK's "
        "ModelBehaviorError and MaxTurnsExceeded, LangGraph's GraphRecursionError, LangChain's "
        "OutputParserException, pydantic's ValidationError, json's JSONDecodeError, flexmarl's PolicyFailure). "
        "Such a trajectory's calls are trained with `failure_reward`; any other exception drops it.",
    )
    failure_reward: float = Field(
        0.0, description="Program teams: the reward of a trajectory the policy broke (`policy_errors`), given to "
        "every agent through the workload's credit rule, as if the team had answered it with that reward.",
    )
    batch_window_ms: float = Field(
        20.0, ge=0.0, le=10_000.0,
        description="Program teams: an agent's queued calls decode together once every running "
        "trajectory waits on a call, or once no call has arrived for this long, or for a tenth of "
        "the agent's last decode if that is longer (at most 25 windows after the first).",
    )

    @field_validator("program")
    @classmethod
    def _program_spec(cls, v: str | None) -> str | None:
        if v is None:
            return v
        mod, sep, fn = v.rpartition(":")
        if not sep or not mod or not fn.isidentifier():
            raise ValueError(f"{v!r}: expected 'module:function' or 'path/to/file.py:function'")
        if mod.endswith(".py"):  # absolute, so every process of the run finds the same file
            path = Path(mod).expanduser()
            if not path.is_file():
                raise ValueError(f"{v!r}: no file {path.absolute()}")
            return f"{path.absolute()}:{fn}"
        return v

    @model_validator(mode="before")
    @classmethod
    def _default_shape(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("shape") is None:
            shape = ("program" if data.get("program") is not None
                     else "environment" if data.get("environment") is not None else "graph")
            data = {**data, "shape": shape}
        return data

    @model_validator(mode="after")
    def _program_team(self) -> TeamConfig:
        if (self.program is not None) != (self.shape == "program"):
            raise ValueError(f"team.shape {self.shape!r} with team.program {self.program!r}: a program "
                             "team sets both (shape: program), any other shape neither")
        if (self.environment is not None) != (self.shape == "environment"):
            raise ValueError(f"team.shape {self.shape!r} with team.environment: an environment team sets "
                             "both (shape: environment), any other shape neither")
        if self.environment is not None:
            if self.edges or self.rounds != 1:
                raise ValueError("team.environment: the environment decides who acts; remove team.edges and "
                                 "team.rounds")
            names = {a.name for a in self.agents}
            for seat, s in self.environment.seats.items():
                if s.agent is not None and s.agent not in names:
                    raise ValueError(f"team.environment.seats.{seat}: agent {s.agent!r} is not an agent of the "
                                     f"team; agents: {sorted(names)}")
            idle = sorted(names - set(self.environment.agents()))
            if idle:
                raise ValueError(f"team.agents: {idle} play no seat of team.environment.seats")
        if self.program is not None and (self.edges or self.rounds != 1):
            raise ValueError("team.program: a program team calls its agents itself; remove team.edges and "
                             "team.rounds (the program decides who is called, and how often)")
        return self

    @field_validator("edges", mode="before")
    @classmethod
    def _edge_shorthand(cls, v: Any) -> Any:
        # Allow "planner -> solver" and [planner, solver] as shorthand in YAML.
        out = []
        for e in v or []:
            if isinstance(e, str) and "->" in e:
                src, dst = (s.strip() for s in e.split("->", 1))
                out.append({"src": src, "dst": dst})
            elif isinstance(e, list | tuple) and len(e) == 2:
                out.append({"src": e[0], "dst": e[1]})
            else:
                out.append(e)
        return out


class WorkloadConfig(_Strict):
    kind: Literal["arithmetic", "gsm8k", "dataset", "callable", "code", "longtail", "calculator"] = Field(
        "arithmetic", description="Problem source."
    )
    path: str | None = Field(None, description="JSONL/Parquet file for kind=dataset or gsm8k.")
    fields: dict[str, str] = Field(
        default_factory=lambda: {"input": "question", "answer": "answer"},
        description="Dataset column for each problem field (input, answer, optional id).",
    )
    callable: str | None = Field(
        None, description="`module:function` yielding problems, for kind=callable."
    )
    reward: str | None = Field(
        None, description="`module:function` team reward override (default: the workload's own)."
    )
    agent_rewards: dict[str, str] = Field(
        default_factory=dict, description="Per-agent `module:function` reward overrides."
    )
    credit: Literal["team", "per_agent", "step_discount"] = Field(
        "team", description="team: every agent gets the team reward; per_agent: each its own; "
        "step_discount: call i of a trajectory's N gets credit_gamma^(N-1-i) x the team reward."
    )
    credit_gamma: float = Field(0.9, gt=0.0, le=1.0, description="The discount of credit: step_discount.")
    format_weight: float = Field(
        0.1, ge=0.0, description="Weight of per-agent format terms added to the reward."
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description="Workload-specific knobs (e.g. arithmetic depth)."
    )
    heldout_size: int = Field(128, ge=1, description="Held-out problems for evaluation.")


class BatchConfig(_Strict):
    inputs_per_iteration: int = Field(8, ge=1, description="Problems per training iteration.")
    group_size: int = Field(4, ge=1, description="Trajectories per input (GRPO group size G).")
    micro_batch_inputs: int = Field(
        2, ge=1, description="Inputs per micro-batch; micro-batches are whole GRPO groups."
    )

    @model_validator(mode="after")
    def _divides(self) -> BatchConfig:
        if self.inputs_per_iteration % self.micro_batch_inputs:
            raise ValueError(
                f"micro_batch_inputs={self.micro_batch_inputs} must divide "
                f"inputs_per_iteration={self.inputs_per_iteration}"
            )
        return self

    @property
    def num_micro_batches(self) -> int:
        return self.inputs_per_iteration // self.micro_batch_inputs


class StoreRetryConfig(_Strict):
    """How reads and writes of an object store (the MEG Store and the run location) retry a
    transient failure: a 503, a dropped connection, a timeout (`storage/retry.py`)."""

    attempts: int = Field(6, ge=1, description="Tries in all before the operation fails.")
    base_delay_s: float = Field(0.2, ge=0.0, description="Backoff before try k+1: a random "
                                "wait up to base_delay_s * 2**k (full jitter) ...")
    max_delay_s: float = Field(8.0, gt=0.0, description="... and never above this.")

    @model_validator(mode="after")
    def _order(self) -> StoreRetryConfig:
        if self.max_delay_s < self.base_delay_s:
            raise ValueError(f"max_delay_s={self.max_delay_s} is below base_delay_s={self.base_delay_s}")
        return self


class StoreConfig(_Strict):
    uri: str = Field(
        "{run_dir}/store", description="MEG Store location: a path or a pyarrow.fs URI (s3://...)."
    )
    retries: StoreRetryConfig = Field(default_factory=StoreRetryConfig,
                                      description="Retries of object-store reads and writes.")
    compact: bool = Field(
        True, description="Fold each iteration's partitions into one fragment each once the "
        "iteration is final (a thread of the flow process; readers are never disturbed): the "
        "store then holds a few files per iteration instead of a dozen per agent.",
    )

    @field_validator("uri")
    @classmethod
    def _template(cls, v: str) -> str:
        return check_template(v, ("run_dir", "name"))


class TrainConfig(_Strict):
    iterations: int = Field(4, ge=1, description="Training iterations.")
    checkpoint_every: int = Field(
        10, ge=1, description="Optimizer steps between full checkpoints (trainer state and weight "
        "file; the last step always). A resumed run replays the steps since the last one from the "
        "samples in the MEG Store. On a cluster of more than one worker these files are also how "
        "weights and trainer states move between processes, so they are written every step there.",
    )
    keep_every: int | None = Field(
        None, ge=1, description="Also keep every N-th version's weights and trainer state. Otherwise a "
        "run keeps, per agent, the initial weights, the `codesign.max_staleness` + 1 newest versions "
        "(what rollouts still read), the newest full checkpoint and the trainer state a resume starts "
        "from, and deletes the rest as the run goes (docs/operations.md, 'What a run keeps'). "
        "1 keeps every version.",
    )
    evaluate: bool = Field(True, description="Measure greedy held-out team accuracy after training.")
    evaluate_initial: bool = Field(
        False, description="Also measure it before training (the starting point, e.g. SFT-only)."
    )
    eval_batch: int | None = Field(
        None, ge=1, description="Held-out problems decoded at once, grouped by question length "
        "(held-out and SFT evaluations): a batch decodes until its longest answer ends, so "
        "where answer length follows the question this saves the short ones' wasted steps. "
        "Unset: all in one batch.",
    )
    sft_target_accuracy: float = Field(
        0.3, ge=0.0, le=1.0, description="`flexmarl sft` stops once held-out accuracy reaches this."
    )
    sft_max_steps: int = Field(2000, ge=1, description="Upper bound on SFT optimizer steps.")
    sft_lr: float = Field(1e-3, gt=0.0, description="SFT learning rate (models start from scratch).")
    sft_batch: int = Field(64, ge=1, description="Problems per SFT step (one demonstration chain each).")
    sft_eval_every: int = Field(25, ge=1, description="SFT steps between held-out evaluations.")
    sft_eval_size: int = Field(64, ge=1, description="Held-out problems per SFT evaluation.")
    sft_chunk_tokens: int | None = Field(
        None, ge=1, description="SFT's training chunk budget (padded tokens per forward/backward; "
        "see backend.train_chunk_tokens, which it replaces during SFT only). A small budget splits "
        "demonstrations of very different lengths into chunks sorted by length, so each pads only "
        "to its own longest: the same gradient for less compute. Unset: the agent's own budget.",
    )
    sft_perturb: float = Field(
        0.2, ge=0.0, le=1.0,
        description="Chance that a child sees a plausible upstream mistake instead of the demonstration.",
    )
    init_from: str | None = Field(
        None, description="Folder of per-agent starting checkpoints (e.g. the output of `flexmarl sft`)."
    )
    warm_start: Literal["none", "sft"] = Field(
        "none", description="sft: start RL from `flexmarl sft` checkpoints of this config, made on "
        "first use and cached under $FLEXMARL_CACHE/warm-start (ignored when init_from is set).",
    )


class ExperimentConfig(_Strict):
    name: str = Field("flexmarl", description="Experiment name (run folders and Prefect names).")
    seed: int = Field(0, description="Seed for problems, models, sampling and training.")
    run_dir: str = Field(
        "runs/{name}",
        description="Run folder: metrics, checkpoints, default store. A local path, or a pyarrow.fs URI "
        "(s3://bucket/runs/{name}) that every machine of the run reaches: nothing is then shared by path.",
    )
    team: TeamConfig = Field(description="The multi-agent team (MEG).")
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig, description="Problems and rewards.")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="Batch sizes.")
    codesign: CodesignConfig = Field(default_factory=CodesignConfig, description="Co-design switches.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Where it runs.")
    store: StoreConfig = Field(default_factory=StoreConfig, description="MEG Store.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training loop.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Value model (agents with gae).")

    @model_validator(mode="before")
    @classmethod
    def _auto_layout(cls, data: Any) -> Any:
        return layout.resolve(data)

    @model_validator(mode="after")
    def _mixing_needs_lora(self) -> ExperimentConfig:
        if self.codesign.mixed_batch_window_s is None:
            return self
        if not any(a.model.lora for a in self.team.agents):
            raise ValueError("codesign.mixed_batch_window_s mixes LoRA adapters in one decode, but no "
                             "agent has model.lora; set model.base and model.lora, or leave it unset")
        if self.cluster.address is None and all(w.nthreads == 1 for w in self.cluster.workers):
            raise ValueError("codesign.mixed_batch_window_s: every worker in cluster.workers has nthreads 1, "
                             "so no two rollouts run at once to share a decode; give a worker nthreads > 1 "
                             "(and room for two rollouts in its tags), or leave it unset")
        return self

    @model_validator(mode="after")
    def _partial_rollouts_take_effect(self) -> ExperimentConfig:
        if self.codesign.partial_rollouts and not any(
                a.trainable and a.model.lora is None and a.backend.inference == "hf" for a in self.team.agents):
            raise ValueError("codesign.partial_rollouts=true has no effect: no trainable agent rolls out on "
                             "the HF engine without model.lora (the engine that resumes a decode under new "
                             "weights); set partial_rollouts: false")
        return self

    @model_validator(mode="after")
    def _helpers_take_effect(self) -> ExperimentConfig:
        if not self.codesign.gradient_helpers:
            return self
        if not any(a.trainable and a.model.lora is None and a.backend.training == "torch" for a in self.team.agents):
            raise ValueError("codesign.gradient_helpers=true has no effect: no agent can lend a gradient "
                             "(a helper needs a trainable agent on backend.training=torch without "
                             "model.lora); set gradient_helpers: false")
        slots = [w.name for w in self.cluster.workers if w.resources.get("train", 0) > 0]
        if self.cluster.address is None and len(slots) < 2:
            raise ValueError(f"codesign.gradient_helpers=true has no effect with {len(slots)} training slot(s) "
                             f"in cluster.workers ({slots}): a helper runs on another idle one; give a "
                             "second worker the 'train' tag or set gradient_helpers: false")
        return self

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        # The run folder is runs/<name> by default: '../../x' must not put it elsewhere.
        return check_name(v, "run name")

    @field_validator("run_dir")
    @classmethod
    def _run_dir_template(cls, v: str) -> str:
        return check_template(v, ("name",))

    def resolved_run_dir(self) -> Path:
        """The run folder on local disk (a URI `run_dir` has none: use `run_location`)."""
        text = self.run_dir.format(name=self.name)
        if "://" in text and not text.startswith("file://"):
            raise ValueError(f"run_dir {text!r} is a URI, not a local folder: use run_location()")
        return Path(text.removeprefix("file://"))

    def run_location(self) -> Any:
        """Where the run's files live (`location.RunLocation`): a local folder or a URI."""
        from flexmarl_core.runfiles.location import RunLocation

        return RunLocation(self.run_dir.format(name=self.name))

    def resolved_store_uri(self) -> str:
        run_dir = self.run_dir.format(name=self.name)
        local = "://" not in run_dir or run_dir.startswith("file://")
        return self.store.uri.format(run_dir=self.resolved_run_dir() if local else run_dir.rstrip("/"),
                                     name=self.name)

    def agent(self, name: str) -> AgentConfig:
        for a in self.team.agents:
            if a.name == name:
                return a
        raise KeyError(f"unknown agent {name!r}; agents: {[a.name for a in self.team.agents]}")
