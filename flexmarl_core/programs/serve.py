"""A trained team behind the endpoint it was trained through (`gateway.py`), for the user's own
programs and harnesses after training: `flexmarl serve RUN` (the run's engines at a kept
version) or `flexmarl serve OUT` (an export, `export/folder.py`, or any one Hugging Face folder).

Every route of the training endpoint is served (chat, completions, Responses, tools, streaming,
`response_format`), one model name per agent, each agent's training sampling as the defaults a
request overrides. All requests share one long-lived trajectory (what the endpoint keys calls
by during training), whose records are dropped as it goes: nothing is stored or trained. A call
without `seed` is seeded by its prompt and how often that prompt came before, so a restarted
server answers a replayed session alike.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request

from flexmarl_core.config import SamplingConfig
from flexmarl_core.export.versions import RunReadError, TrainedRun
from flexmarl_core.inference.hf import HFInferenceEngine
from flexmarl_core.models import load_model, load_tokenizer
from flexmarl_core.programs.api import Dispatcher
from flexmarl_core.programs.chat import PLAIN
from flexmarl_core.programs.engines import LocalDispatcher
from flexmarl_core.programs.gateway import AgentSpec, Gateway, Session, Trajectory
from flexmarl_core.programs.protocol import ApiError
from flexmarl_core.programs.team import agent_spec
from flexmarl_core.programs.tools import TOOL_PARSERS

#: the export's manifest (`export/folder.py` MANIFEST; named here so serving needs no exporter)
MANIFEST = "flexmarl-export.json"
#: entries a trajectory keeps of what later calls refer back to (tool call ids, response ids)
KEEP = 4096


@dataclass
class ServedTeam:
    """What is served: each agent's endpoint spec, who decodes, and the versions."""

    source: str
    agents: dict[str, AgentSpec]
    dispatcher: Dispatcher
    versions: dict[str, int]


def team_of_run(run: TrainedRun, versions: dict[str, int]) -> ServedTeam:
    """The run's agents on this process's engines (`runtime/worker.py`), at `versions`."""
    from flexmarl_core.runtime.worker import context

    ctx = context(run.where)
    pinned = dict(versions)
    specs = {a.name: agent_spec(a, run.cfg.seed) for a in run.agents() if a.name in pinned}
    return ServedTeam(run.where, specs, LocalDispatcher(lambda agent, _v: ctx.engine(agent, pinned[agent]), ctx.lock),
                      pinned)


def _spec(name: str, model: Any, tok: Any, sampling: SamplingConfig, parser: str) -> AgentSpec:
    max_ctx = int(getattr(model.config, "max_position_embeddings", 2048))
    return AgentSpec(name, sampling, tok.chat_template or PLAIN, tok, max_ctx, parser=TOOL_PARSERS.get(parser))


def _adapter_model(folder: Path) -> tuple[Any, Any]:
    """An exported adapter folder merged into the base it names (a folder or a hub id)."""
    from safetensors.torch import load_file

    from flexmarl_core.config import LoraSpec, ModelConfig
    from flexmarl_core.models.lora import merged_state

    conf = json.loads((folder / "adapter_config.json").read_text())
    base = ModelConfig(path=conf["base_model_name_or_path"], preset=None).folder()
    assert base is not None
    model, _ = load_model(base)
    spec = LoraSpec(rank=conf["r"], alpha=conf["lora_alpha"], target_modules=sorted(conf["target_modules"]))
    state = merged_state(model.state_dict(), load_file(str(folder / "adapter_model.safetensors")), spec)
    model.load_state_dict(state)
    return model.eval(), load_tokenizer(folder)


def _engine(engine: str, folder: Path, model: Any, tok: Any, version: int, adapter: bool) -> Any:
    """The HF engine on `model`, or vLLM on the folder (an adapter's merge: on a private copy)."""
    if engine == "hf":
        return HFInferenceEngine(model, tok, version=version)
    from flexmarl_core.inference.vllm_engine import VLLMInferenceEngine

    if adapter:
        return VLLMInferenceEngine.from_model(model, tok)
    return VLLMInferenceEngine(folder, tok, version=version)


def team_of_folder(folder: str, engine: str = "hf") -> ServedTeam:
    """An export's agents (its manifest), or one Hugging Face model folder as one agent named
    by the folder (its tokenizer's chat template, default sampling); decoded by `engine`
    (`hf`, or `vllm` where it is installed)."""
    root = Path(folder).expanduser().absolute()
    entries: dict[str, dict[str, Any]]
    if (root / MANIFEST).is_file():
        entries = json.loads((root / MANIFEST).read_text())["agents"]
    elif (root / "config.json").is_file() or (root / "adapter_config.json").is_file():
        # One agent of an export (its entry there: sampling, version), or any model folder.
        team = json.loads((root.parent / MANIFEST).read_text())["agents"] if (root.parent / MANIFEST).is_file() else {}
        kind = "full" if (root / "config.json").is_file() else "adapter"
        entries = {root.name: {**team.get(root.name, {"version": 0, "kind": kind, "config": {}}), "folder": "."}}
    else:
        raise RunReadError(f"{folder}: neither a run folder, nor a flexmarl export ({MANIFEST}), "
                           "nor a Hugging Face model folder (config.json)")
    engines, specs = {}, {}
    for name, e in entries.items():
        sub = root / e["folder"]
        adapter = e.get("kind") == "adapter"
        model, tok = _adapter_model(sub) if adapter else load_model(sub)
        conf = e.get("config", {})
        engines[name] = _engine(engine, sub, model, tok, int(e.get("version", 0)), adapter)
        specs[name] = _spec(name, model, tok, SamplingConfig(**conf.get("sampling", {})), conf.get("tool_parser", "hermes"))
    return ServedTeam(str(root), specs, LocalDispatcher.of_engines(engines),
                      {n: int(e.get("version", 0)) for n, e in entries.items()})


def _seed(input_id: str, traj: int, agent: str, tag: str) -> int:
    return int.from_bytes(hashlib.sha256(f"serve:{agent}:{tag}".encode()).digest()[:4], "little")


class ServingGateway(Gateway):
    """The endpoint on `host:port` answering for `team`; with `api_key`, only requests that
    carry it (`Authorization: Bearer <key>`)."""

    def __init__(self, team: ServedTeam, *, host: str, port: int, api_key: str | None) -> None:
        super().__init__(host, port)
        self.team, self.api_key = team, api_key
        session = Session(secrets.token_urlsafe(16), team.agents, team.versions, team.dispatcher, _seed)
        self.trajectory = self.open(session, "served", 0, 0)

    def _trajectory(self, request: Request) -> Trajectory:
        if self.api_key is not None:
            key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not secrets.compare_digest(key.encode(), self.api_key.encode()):
                raise ApiError(401, "Incorrect API key provided: this endpoint was started with --api-key",
                               type_="invalid_request_error", code="invalid_api_key")
        t = self.trajectory
        t.records.clear()  # what training would store: nothing is here
        for kept in (t.seen, t.answers, t.conversations):
            while len(kept) > KEEP:
                kept.pop(next(iter(kept)))
        return t

    def close(self) -> None:
        self._server.should_exit = True
