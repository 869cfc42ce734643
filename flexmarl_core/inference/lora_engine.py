"""One rollout instance for every LoRA agent on a base: batches mix agents' adapters.

    shared = SharedBaseEngine(base_model, tokenizer)
    shared.add("planner", spec, adapter_state, version=0)
    shared.add("solver", spec, adapter_state, version=0)
    gens = shared.generate_mixed(prompts, ["planner", "solver", ...], sampling, seed)
    eng = shared.view("solver")            # an `InferenceBackend` for one agent

Each row of a batch runs through the base once and through its own agent's adapter (PEFT's
`adapter_names` forward: the base layers see the whole batch, each adapter its sub-batch), so
an instance serves any agent on its base without loading anything but that agent's adapter
(a few hundred KiB for the tiny presets), and a weight sync replaces adapter tensors only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from flexmarl_core.config import LoraSpec, SamplingConfig
from flexmarl_core.inference.api import DecodeClock, Generation
from flexmarl_core.inference.hf import HFInferenceEngine
from flexmarl_core.models.lora import SharedBase


class SharedBaseEngine(HFInferenceEngine):
    """The HF engine's sampling loop on a `SharedBase`, a weights version per adapter."""

    def __init__(self, base: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__(base, tokenizer)
        self.shared = SharedBase(base)
        self.versions: dict[str, int] = {}

    def add(self, agent: str, spec: LoraSpec, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.shared.add(agent, spec)
        self.shared.activate(agent, trainable=False)
        self.model = self.shared.model.eval()
        self.update_adapter(agent, state, version)

    def update_adapter(self, agent: str, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.shared.load_adapter_state(agent, state)
        self.versions[agent] = int(version)

    def generate_mixed(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        agents: Sequence[str],
        sampling: SamplingConfig,
        seed: int,
    ) -> list[Generation]:
        """One batch, row i through agent `agents[i]`'s adapter; each generation carries its
        agent's version. Rows share `sampling` (one decode loop)."""
        if len(agents) != len(prompts):
            raise ValueError(f"generate_mixed: {len(prompts)} prompts but {len(agents)} agent names")
        unknown = sorted(set(agents) - set(self.versions))
        if unknown:
            raise KeyError(f"no adapter for agent(s) {unknown} on this instance (have {sorted(self.versions)})")
        return self._generate(prompts, sampling, seed, forward_kwargs={"adapter_names": list(agents)},
                              versions=[self.versions[a] for a in agents])

    def generate_requests(
        self, requests: Sequence[tuple[str, Sequence[str] | Sequence[Sequence[int]], SamplingConfig, int]]
    ) -> list[list[Generation]]:
        """One decode for several requests (agent, prompts, sampling, seed): each row through
        its request's agent's adapter, each request sampled with its own seed and sampling
        (`HFInferenceEngine._generate_groups`), so it gets the tokens it would get alone."""
        agents = [a for a, prompts, _, _ in requests for _ in prompts]
        unknown = sorted(set(agents) - set(self.versions))
        if unknown:
            raise KeyError(f"no adapter for agent(s) {unknown} on this instance (have {sorted(self.versions)})")
        gens = self._generate_groups([(p, s, seed) for _, p, s, seed in requests],
                                     forward_kwargs={"adapter_names": agents},
                                     versions=[self.versions[a] for a in agents])
        out, at = [], 0
        for _, prompts, _, _ in requests:
            out.append(gens[at : at + len(prompts)])
            at += len(prompts)
        return out

    def view(self, agent: str) -> AdapterEngine:
        if agent not in self.versions:
            raise KeyError(f"no adapter for agent {agent!r} on this instance")
        return AdapterEngine(self, agent)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        raise TypeError("a shared-base engine takes adapters per agent: use update_adapter(agent, ...)")


class AdapterEngine:
    """`InferenceBackend` of one agent on a `SharedBaseEngine` (what the worker hands a stage)."""

    def __init__(self, shared: SharedBaseEngine, agent: str) -> None:
        self.shared = shared
        self.agent = agent

    @property
    def version(self) -> int:
        return self.shared.versions[self.agent]

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.shared.tokenizer

    @property
    def clock(self) -> DecodeClock:
        """The base engine's: its decodes serve every agent on it (one at a time, under the
        worker's lock)."""
        return self.shared.clock

    @property
    def eos_ids(self) -> list[int]:
        """The base's end tokens (a tool loop continues from token ids and needs them)."""
        return self.shared.eos_ids

    def generate(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], sampling: SamplingConfig, seed: int
    ) -> list[Generation]:
        return self.shared.generate_mixed(prompts, [self.agent] * len(prompts), sampling, seed)

    def generate_groups(
        self, groups: Sequence[tuple[Sequence[str] | Sequence[Sequence[int]], SamplingConfig, int]]
    ) -> list[list[Generation]]:
        """`HFInferenceEngine.generate_groups` through this agent's adapter."""
        return self.shared.generate_requests([(self.agent, p, s, seed) for p, s, seed in groups])

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.shared.update_adapter(self.agent, state_dict, version)
