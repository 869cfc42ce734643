"""LoRA agents on a shared base model (PEFT): one base per process, one adapter per agent.

    key = base_key(agent.model, seed)                 # agents with equal keys share a base
    shared = SharedBase(base_model)                   # wraps it in a PeftModel, no adapter yet
    shared.add(agent.name, agent.model.lora, init=state)
    shared.adapter_state("solver")                    # the adapter only: what syncs and swaps move

An adapter's state is its `lora_A` / `lora_B` tensors keyed by the module path with the
adapter's name taken out (`...q_proj.lora_A.weight`), so one agent's state loads into another
process's copy of the same base under the same agent name. The base's own weights never move
after a worker has loaded them: a weight sync and a trainer swap carry adapter bytes only.

Initial adapters are made by `initial_adapter_state` from (seed, agent) alone: PEFT's init
(`lora_A` Kaiming-uniform, `lora_B` zero, so a fresh adapter leaves the base's outputs as
they are) runs in a forked RNG, never touching the caller's.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Mapping
from typing import Any

import torch

from flexmarl_core.config import LoraSpec, ModelConfig

#: the module path infix of an adapter's tensors, e.g. `q_proj.lora_A.<agent>.weight`
_LORA_PARTS = ("lora_A", "lora_B")


def base_key(cfg: ModelConfig, seed: int) -> str:
    """What a base model's weights depend on: the preset and seed, or the folder."""
    if cfg.hub_id is not None:  # the same snapshot has a different folder on each machine
        src = f"hub={cfg.hub_id}@{cfg.revision}"
    elif cfg.path is not None:
        src = f"path={os.path.abspath(os.path.expanduser(cfg.path))}"
    else:
        src = f"preset={cfg.preset}:seed={seed}"
    return hashlib.sha256(src.encode()).hexdigest()[:12]


def peft_config(spec: LoraSpec) -> Any:
    from peft import LoraConfig

    # Dropout 0: the trainer's forward must score the same logprobs as the engine's.
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules),
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


def _adapter_key(param_name: str, adapter: str) -> str | None:
    """`...q_proj.lora_A.solver.weight` -> `...q_proj.lora_A.weight` for `solver`, else None."""
    for part in _LORA_PARTS:
        infix = f".{part}.{adapter}."
        if infix in param_name:
            return param_name.replace(infix, f".{part}.")
    return None


class SharedBase:
    """A base model with any number of agents' LoRA adapters (a PEFT `PeftModel`).

    The inference engine and the trainers of one process each hold their own `SharedBase`
    (the engine's may be bf16, trainers keep fp32 masters), so a process has at most two copies
    of a base however many agents run on it."""

    def __init__(self, base: torch.nn.Module) -> None:
        self.model: Any = None  # the PeftModel, made with the first adapter
        self._base = base
        self.specs: dict[str, LoraSpec] = {}

    @property
    def base(self) -> torch.nn.Module:
        return self._base

    def __contains__(self, agent: object) -> bool:
        return agent in self.specs

    def add(self, agent: str, spec: LoraSpec, *, seed: int = 0) -> None:
        """Attach a fresh adapter for `agent` (init seeded by (seed, agent), the caller's RNG kept)."""
        from peft import get_peft_model

        if agent in self.specs:
            raise ValueError(f"agent {agent!r} already has an adapter on this base")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_adapter_seed(seed, agent))
            if self.model is None:
                self.model = get_peft_model(self._base, peft_config(spec), adapter_name=agent)
            else:
                self.model.add_adapter(agent, peft_config(spec))
        self.specs[agent] = spec
        # Adapters are created on the CPU in fp32; follow the base's device and dtype.
        ref = next(self._base.parameters())
        for name, p in self.model.named_parameters():
            if _adapter_key(name, agent) is not None:
                p.data = p.data.to(device=ref.device, dtype=ref.dtype)

    def adapter_params(self, agent: str) -> list[tuple[str, torch.nn.Parameter]]:
        """(state key, parameter) of `agent`'s adapter, in module order."""
        self._known(agent)
        out = []
        for name, p in self.model.named_parameters():
            key = _adapter_key(name, agent)
            if key is not None:
                out.append((key, p))
        return out

    def adapter_state(self, agent: str) -> dict[str, torch.Tensor]:
        """A copy of `agent`'s adapter tensors (what a sync publishes and a trainer swaps)."""
        return {k: p.detach().clone() for k, p in self.adapter_params(agent)}

    def load_adapter_state(self, agent: str, state: Mapping[str, torch.Tensor]) -> None:
        """Copy an adapter state in (cast to this copy's dtype and device); keys must match."""
        own = dict(self.adapter_params(agent))
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"agent {agent!r}: adapter state does not match its LoRA config; missing "
                f"{missing[:3]}, unexpected {unexpected[:3]} (a full-model state for a LoRA agent?)"
            )
        with torch.no_grad():
            for k, v in state.items():
                own[k].copy_(v)

    def activate(self, agent: str, *, trainable: bool) -> None:
        """Make `agent`'s adapter the one a plain forward uses; `trainable` gives its tensors
        (only its) requires_grad, every other adapter and the base stay frozen."""
        self._known(agent)
        self.model.base_model.set_adapter(agent, inference_mode=not trainable)

    def _known(self, agent: str) -> None:
        if agent not in self.specs:
            raise KeyError(f"agent {agent!r} has no adapter on this base (have {sorted(self.specs)})")


def _adapter_seed(seed: int, agent: str) -> int:
    h = hashlib.sha256(f"lora:{seed}:{agent}".encode()).digest()
    return int.from_bytes(h[:4], "little")


def initial_adapter_state(base: torch.nn.Module, spec: LoraSpec, *, seed: int, agent: str) -> dict[str, torch.Tensor]:
    """The adapter `agent` starts from (version 0): PEFT's init seeded by (seed, agent), made
    on a throwaway copy so `base` is left unwrapped."""
    shared = SharedBase(copy.deepcopy(base))
    shared.add(agent, spec, seed=seed)
    return shared.adapter_state(agent)


def merged_state(base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor],
                 spec: LoraSpec) -> dict[str, torch.Tensor]:
    """`base`'s state with an adapter state folded in: W + (alpha / rank) * B @ A for every
    adapted linear layer, in fp32 (PEFT's merge, done on tensors so a folder can be written
    without building a PeftModel). Keys of `adapter` are PEFT's saved names
    (`base_model.model.<module>.lora_A.weight`)."""
    out = {k: v.detach().clone() for k, v in base.items()}
    scale = spec.alpha / spec.rank
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").rsplit(".lora_A.", 1)[0]
        b = adapter.get(key.replace(".lora_A.", ".lora_B."))
        w = out.get(f"{module}.weight")
        if b is None or w is None:
            raise ValueError(f"adapter tensor {key!r} has no lora_B or no base weight {module}.weight")
        delta = scale * (b.double() @ a.double())  # fp64 product: the merge adds no rounding of its own
        out[f"{module}.weight"] = (w.double() + delta).to(w.dtype)
    return out
