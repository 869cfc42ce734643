"""What lives in a worker process between tasks: the run's config, store handle, workload and
the agents' inference engines and trainers, loaded once and kept in memory.

Tasks carry only `run_dir`; `context(run_dir)` returns this process's state for that run,
building it on first use. Weights move between processes as versioned files in
`run_dir/weights/<agent>/v<k>.safetensors` (written atomically by the trainer's sync), so a
restarted worker rebuilds any engine from the latest published version.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from flexmarl_core.config import ExperimentConfig, load_config
from flexmarl_core.meg import MEG

CONFIG_NAME = "config.yaml"


def weights_path(run_dir: str | Path, agent: str, version: int) -> Path:
    return Path(run_dir) / "weights" / agent / f"v{version}.safetensors"


def save_state_atomic(path: Path, state: dict[str, torch.Tensor]) -> Path:
    """Write a state dict as safetensors atomically (temp + rename): readers never see half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    # Clone: tied embeddings share storage and safetensors refuses shared tensors; lm_head must
    # travel with the rest (a vLLM push without it silently keeps the old output layer).
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}, str(tmp))
    os.replace(tmp, path)
    return path


def publish_weights(run_dir: str | Path, agent: str, version: int, state: dict[str, torch.Tensor]) -> Path:
    """Publish one weights version; a retry rewrites the same bytes."""
    return save_state_atomic(weights_path(run_dir, agent, version), state)


def trainer_state_path(run_dir: str | Path, agent: str, version: int) -> Path:
    """Where the trainer state after `version` steps lives: the swap tier every worker can
    read (on-demand allocation swaps in from here) and the checkpoint `--resume` starts from."""
    return Path(run_dir) / "trainers" / agent / f"v{version}.pt"


def base_weights_path(run_dir: str | Path, key: str) -> Path:
    """The shared base of LoRA agents (`models.lora.base_key`), published once per run."""
    return Path(run_dir) / "bases" / f"{key}.safetensors"


def load_weights(run_dir: str | Path, agent: str, version: int) -> dict[str, torch.Tensor]:
    path = weights_path(run_dir, agent, version)
    if not path.exists():
        raise FileNotFoundError(f"agent {agent!r}: weights version {version} not published at {path}")
    return load_file(str(path))


@dataclass
class WorkerContext:
    run_dir: Path
    cfg: ExperimentConfig
    meg: MEG
    engines: dict[str, Any] = field(default_factory=dict)
    trainers: dict[str, Any] = field(default_factory=dict)
    #: LoRA agents: base key -> the one engine of every agent on it / the trainers' base
    shared_engines: dict[str, Any] = field(default_factory=dict)
    shared_train_bases: dict[str, Any] = field(default_factory=dict)
    #: per agent, the (iteration, mb) already in the trainer's accumulated gradients
    accumulated: dict[str, set[tuple[int, int]]] = field(default_factory=dict)
    #: iteration -> micro-batch -> input rows (meta parsed); inputs never change once written
    _inputs: dict[int, dict[int, list[dict[str, Any]]]] = field(default_factory=dict)
    _store: Any = None
    _workload: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def store(self) -> Any:
        if self._store is None:
            from storage import MEGStore

            self._store = MEGStore(self.cfg.resolved_store_uri())
        return self._store

    @property
    def workload(self) -> Any:
        if self._workload is None:
            from flexmarl_core.workloads import make_workload

            self._workload = make_workload(self.cfg.workload, self.cfg.team)
        return self._workload

    def inputs(self, iteration: int, mb: int) -> list[dict[str, Any]]:
        """The inputs of one micro-batch in their original order, read once per iteration."""
        if iteration not in self._inputs:
            by_mb: dict[int, list[dict[str, Any]]] = {}
            for r in self.store.read_inputs(iteration).to_pylist():
                r["meta"] = json.loads(r["meta"] or "{}")
                by_mb.setdefault(r["meta"]["mb"], []).append(r)
            for rows in by_mb.values():
                rows.sort(key=lambda r: r["meta"]["pos"])
            self._inputs[iteration] = by_mb
        rows = self._inputs[iteration].get(mb)
        if not rows:
            raise RuntimeError(f"iteration {iteration} micro-batch {mb}: no inputs in the store")
        return rows

    def _fresh_model(self, agent: str) -> tuple[Any, Any]:
        """The agent's model on `cluster.device`: its engine and trainer follow the model."""
        from flexmarl_core.models import load_agent_model

        mcfg = self.cfg.agent(agent).model
        model, tok = load_agent_model(mcfg, seed=self.cfg.seed)
        if mcfg.lora is not None:  # the base the run published (a warm start's, or the preset's)
            from flexmarl_core.models.lora import base_key

            model.load_state_dict(load_file(str(base_weights_path(self.run_dir, base_key(mcfg, self.cfg.seed)))))
        return model.to(self.cfg.cluster.device), tok

    def _adapter_engine(self, agent: str, version: int) -> Any:
        """`agent`'s view of the one engine this process runs for its base (made on first use);
        an agent new to it brings only its adapter."""
        from flexmarl_core.inference.lora_engine import SharedBaseEngine
        from flexmarl_core.models.lora import base_key

        acfg = self.cfg.agent(agent)
        key = base_key(acfg.model, self.cfg.seed)
        shared = self.shared_engines.get(key)
        if shared is None:
            model, tok = self._fresh_model(agent)
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[acfg.model.dtype]
            shared = self.shared_engines[key] = SharedBaseEngine(model.to(dtype), tok)
        assert acfg.model.lora is not None
        shared.add(agent, acfg.model.lora, load_weights(self.run_dir, agent, version), version)
        return shared.view(agent)

    def _new_trainer(self, agent: str) -> Any:
        """A trainer at version 0; LoRA agents on one base share this process's copy of it."""
        from flexmarl_core.training import make_trainer

        acfg = self.cfg.agent(agent)
        if acfg.model.lora is None:
            model, _ = self._fresh_model(agent)
            model.load_state_dict(load_weights(self.run_dir, agent, 0))
            return make_trainer(acfg, model)
        from flexmarl_core.models.lora import SharedBase, base_key
        from flexmarl_core.training.factory import make_lora_trainer

        key = base_key(acfg.model, self.cfg.seed)
        shared = self.shared_train_bases.get(key)
        if shared is None:
            model, _ = self._fresh_model(agent)
            shared = self.shared_train_bases[key] = SharedBase(model)
        shared.add(agent, acfg.model.lora)
        shared.load_adapter_state(agent, load_weights(self.run_dir, agent, 0))
        return make_lora_trainer(acfg, shared)

    def engine(self, agent: str, version: int) -> Any:
        """This process's inference engine for `agent`, holding weights `version`."""
        eng = self.engines.get(agent)
        if eng is None and self.cfg.agent(agent).model.lora is not None:
            eng = self.engines[agent] = self._adapter_engine(agent, version)
        elif eng is None:
            from flexmarl_core.inference import make_inference_engine

            model, tok = self._fresh_model(agent)
            eng = make_inference_engine(self.cfg.agent(agent), model, tok)
            eng.update_weights(load_weights(self.run_dir, agent, version), version)
            self.engines[agent] = eng
        elif eng.version != version:
            eng.update_weights(load_weights(self.run_dir, agent, version), version)
        return eng

    def trainer(self, agent: str, version: int) -> tuple[Any, dict[str, float]]:
        """This process's trainer for `agent` at `version` (or later: a retried op finds its
        work done), and swap figures when the state had to be swapped in.

        A trainer this process holds at an older version was moved to another worker since
        (on-demand allocation): its state is swapped in from the checkpoint of `version`.
        """
        tr = self.trainers.get(agent)
        if tr is not None and tr.version >= version:
            return tr, {}
        from flexmarl_core.training.handles import StateHandle, get

        t0 = time.perf_counter()
        if tr is None:
            tr = self._new_trainer(agent)
        if version == 0:
            self.trainers[agent] = tr
            return tr, {}
        path = trainer_state_path(self.run_dir, agent, version)
        if not path.exists():
            raise RuntimeError(
                f"agent {agent!r}: trainer state version {version} is neither in this worker's "
                f"memory nor checkpointed at {path}"
            )
        tr.load_state(get(StateHandle("file", str(path), 0)))
        self.trainers[agent] = tr
        self.accumulated[agent] = set()  # gradients of the stale copy are not this state's
        return tr, {"swap_in_s": time.perf_counter() - t0, "swap_in_bytes": float(path.stat().st_size)}

    def checkpoint_trainer(self, agent: str) -> dict[str, float]:
        """Swap the trainer state out to the shared tier after a step (atomic file), keeping
        the previous version (a resumed run may need it) and deleting older ones."""
        from flexmarl_core.training.handles import put

        tr = self.trainers[agent]
        t0 = time.perf_counter()
        path = trainer_state_path(self.run_dir, agent, tr.version)
        h = put(tr.state(), str(path))
        for old in path.parent.glob("v*.pt"):
            if int(old.stem[1:]) < tr.version - 1:
                old.unlink(missing_ok=True)
        return {"swap_out_s": time.perf_counter() - t0, "swap_out_bytes": float(h.nbytes)}


_CONTEXTS: dict[str, WorkerContext] = {}
_LOCK = threading.Lock()


def context(run_dir: str | Path) -> WorkerContext:
    key = str(Path(run_dir).resolve())
    with _LOCK:
        ctx = _CONTEXTS.get(key)
        if ctx is None:
            threads = os.environ.get("FLEXMARL_TORCH_THREADS")
            if threads:
                torch.set_num_threads(int(threads))
            cfg = load_config(Path(key) / CONFIG_NAME)
            ctx = WorkerContext(run_dir=Path(key), cfg=cfg, meg=MEG.from_config(cfg.team))
            _CONTEXTS[key] = ctx
        return ctx
