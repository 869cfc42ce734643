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
    #: per agent, the (iteration, mb) already in the trainer's accumulated gradients
    accumulated: dict[str, set[tuple[int, int]]] = field(default_factory=dict)
    #: iteration -> micro-batch -> input rows (meta parsed); inputs never change once written
    _inputs: dict[int, dict[int, list[dict[str, Any]]]] = field(default_factory=dict)
    _store: Any = None
    _workload: Any = None
    #: re-entrant: a rollout holding it may replay its trainer (`trainer`), which takes it too
    lock: threading.RLock = field(default_factory=threading.RLock)

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

        model, tok = load_agent_model(self.cfg.agent(agent).model, seed=self.cfg.seed)
        return model.to(self.cfg.cluster.device), tok

    @property
    def one_process(self) -> bool:
        """Every op of the run runs in this one process (a local cluster of one worker): no
        other process needs a weight file or trainer state between checkpoints."""
        return self.cfg.cluster.address is None and len(self.cfg.cluster.workers) == 1

    def checkpoint_due(self, version: int) -> bool:
        """Whether the state after `version` steps is written out: every `train.checkpoint_every`
        steps and the last one; every step when other processes read it (weights for their
        rollouts, trainer states for on-demand allocation and lost workers)."""
        every = self.cfg.train.checkpoint_every
        return not self.one_process or version % every == 0 or version >= self.cfg.train.iterations

    def weights(self, agent: str, version: int) -> dict[str, torch.Tensor]:
        """Weights `version` of `agent`: the published file, or (between checkpoints) this
        process's trainer at that version, replayed from the last checkpoint if need be."""
        if weights_path(self.run_dir, agent, version).exists() or version == 0:
            return load_weights(self.run_dir, agent, version)
        tr, _ = self.trainer(agent, version)
        if tr.version != version:
            raise RuntimeError(
                f"agent {agent!r}: weights version {version} not published at "
                f"{weights_path(self.run_dir, agent, version)} and the trainer is at {tr.version}"
            )
        return tr.weights()

    def engine(self, agent: str, version: int) -> Any:
        """This process's inference engine for `agent`, holding weights `version`."""
        eng = self.engines.get(agent)
        if eng is None:
            from flexmarl_core.inference import make_inference_engine

            model, tok = self._fresh_model(agent)
            eng = make_inference_engine(self.cfg.agent(agent), model, tok)
            eng.update_weights(self.weights(agent, version), version)
            self.engines[agent] = eng
        elif eng.version != version:
            eng.update_weights(self.weights(agent, version), version)
        return eng

    def trainer(self, agent: str, version: int) -> tuple[Any, dict[str, float]]:
        """This process's trainer for `agent` at `version` (or later: a retried op finds its
        work done), and swap figures when the state had to be swapped in.

        A trainer this process holds at an older version was moved to another worker since
        (on-demand allocation): its state is swapped in from the checkpoint of `version`.
        Between scheduled checkpoints (`checkpoint_due`) there is none: the state is that of
        the last checkpoint with the steps since replayed from the store's samples.
        """
        tr = self.trainers.get(agent)
        if tr is not None and tr.version >= version:
            return tr, {}
        from flexmarl_core.training import make_trainer
        from flexmarl_core.training.handles import StateHandle, get

        t0 = time.perf_counter()
        if tr is None:
            model, _ = self._fresh_model(agent)
            model.load_state_dict(load_weights(self.run_dir, agent, 0))
            tr = make_trainer(self.cfg.agent(agent), model)
        if version == 0:
            self.trainers[agent] = tr
            return tr, {}
        path = trainer_state_path(self.run_dir, agent, version)
        if path.exists():
            tr.load_state(get(StateHandle("file", str(path), 0)))
            self.trainers[agent] = tr
            self.accumulated[agent] = set()  # gradients of the stale copy are not this state's
            return tr, {"swap_in_s": time.perf_counter() - t0, "swap_in_bytes": float(path.stat().st_size)}
        if self.checkpoint_due(version):
            raise RuntimeError(
                f"agent {agent!r}: trainer state version {version} is neither in this worker's "
                f"memory nor checkpointed at {path}"
            )
        # Between checkpoints, in the run's one process: replay from the newest state at hand
        # (this process's trainer, or the last checkpoint after a restart).
        base = max((v for v in checkpointed_versions(self.run_dir, agent) if v < version), default=0)
        swap: dict[str, float] = {}
        if base > tr.version:
            path = trainer_state_path(self.run_dir, agent, base)
            tr.load_state(get(StateHandle("file", str(path), 0)))
            swap = {"swap_in_bytes": float(path.stat().st_size)}
            self.accumulated[agent] = set()
        self.trainers[agent] = tr
        from flexmarl_core.stages.train import replay

        with self.lock:
            replay(self, agent, tr, version)
        return tr, {**swap, "swap_in_s": time.perf_counter() - t0}

    def checkpoint_trainer(self, agent: str) -> dict[str, float]:
        """Swap the trainer state out to the shared tier after a step (atomic file), keeping
        the previous checkpoint (a resumed run may need it) and deleting older ones."""
        from flexmarl_core.training.handles import put

        tr = self.trainers[agent]
        t0 = time.perf_counter()
        path = trainer_state_path(self.run_dir, agent, tr.version)
        h = put(tr.state(), str(path))
        for old in checkpointed_versions(self.run_dir, agent)[:-2]:
            trainer_state_path(self.run_dir, agent, old).unlink(missing_ok=True)
        return {"swap_out_s": time.perf_counter() - t0, "swap_out_bytes": float(h.nbytes)}


def checkpointed_versions(run_dir: str | Path, agent: str) -> list[int]:
    """Versions of `agent`'s trainer state on disk, oldest first."""
    folder = trainer_state_path(run_dir, agent, 0).parent
    return sorted(int(p.stem[1:]) for p in folder.glob("v*.pt") if p.stem[1:].isdigit())


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
