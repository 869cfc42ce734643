"""An agent's model at a weights version of its run, as the run's engines hold it: the agent's
architecture and tokenizer (its preset, folder or hub snapshot), the published weights loaded
in; a LoRA agent's adapter merged into the base the run published for it (which a warm start
may have trained), or kept apart with that base (`adapter`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flexmarl_core.config import AgentConfig, LoraSpec
from flexmarl_core.export.versions import RunReadError, TrainedRun
from flexmarl_core.models import load_agent_model
from flexmarl_core.models.lora import base_key, merged_state
from flexmarl_core.runfiles.weights import State, load_base, load_weights


@dataclass
class AgentWeights:
    """One agent at one version: `model` (fp32, eval mode) holds its full weights (a LoRA
    agent's merged); a LoRA agent also keeps its `adapter` state, `base` state and `spec`."""

    agent: AgentConfig
    version: int
    model: Any
    tokenizer: Any
    adapter: State | None = None
    base: State | None = None
    spec: LoraSpec | None = None

    def base_is_source(self) -> bool:
        """A LoRA agent whose base is its model folder's weights as they are (no warm start
        trained it): an adapter folder can then name that folder or hub id as its base."""
        if self.base is None or self.agent.model.folder() is None:
            return False
        source, _ = load_agent_model(self.agent.model, seed=0)  # a folder's weights do not depend on the seed
        own = source.state_dict()
        return own.keys() == self.base.keys() and all(torch.equal(own[k], v) for k, v in self.base.items())


def _load_into(model: Any, state: State, what: str) -> None:
    own = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = [k for k in set(own) - set(state) if not (tied and k == "lm_head.weight")]
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise RunReadError(f"{what} does not match the agent's model: missing {sorted(missing)[:3]}, "
                           f"unexpected {unexpected[:3]}")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)


def agent_weights(run: TrainedRun, agent: AgentConfig, version: int) -> AgentWeights:
    """`agent`'s model at `version` of `run` (checked to exist by `TrainedRun.resolve`)."""
    model, tok = load_agent_model(agent.model, seed=run.cfg.seed)
    what = run.loc.display(f"weights/{agent.name}/v{version}.safetensors")
    spec = agent.model.lora
    try:  # missing: deleted between the listing and the read; malformed: a damaged file
        state = load_weights(run.loc, agent.name, version)
        base = None if spec is None else load_base(run.loc, base_key(agent.model, run.cfg.seed))
    except (FileNotFoundError, ValueError) as exc:
        raise RunReadError(str(exc)) from None
    if spec is None or base is None:
        _load_into(model, state, what)
        return AgentWeights(agent, version, model.eval(), tok)
    _load_into(model, merged_state(base, state, spec), f"{what} merged into its base")
    return AgentWeights(agent, version, model.eval(), tok, adapter=state, base=base, spec=spec)
