"""What lives in a worker process between tasks: the run's config, store handle, workload and
the agents' inference engines and trainers, loaded once and kept in memory.

Tasks carry only the run's location (`run_dir`: a local path or a URI, see `runfiles/location.py`);
`context(run_dir)` returns this process's state for that run, building it on first use from
the files there, so a worker needs no folder shared with the flow process. Weights move
between processes as versioned files (`runfiles/weights.py`), so a restarted worker rebuilds any engine
from the latest published version. A cluster may also carry them from a sync to the other
processes holding an engine of the agent (`runfiles/transport.py`), so N instances do not read one
object N times.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from flexmarl_core.config import ExperimentConfig, config_from_text
from flexmarl_core.config.critic import trainer_kinds
from flexmarl_core.control import memory
from flexmarl_core.inference import InferenceBackend, make_inference_engine
from flexmarl_core.inference.api import SharedBaseBackend
from flexmarl_core.inference.coalesce import Coalescer
from flexmarl_core.inference.lora_engine import SharedBaseEngine
from flexmarl_core.inference.vllm_lora import VLLMSharedBaseEngine
from flexmarl_core.meg import MEG
from flexmarl_core.models import load_agent_model
from flexmarl_core.models.lora import SharedBase, base_key
from flexmarl_core.runfiles.location import (
    CONFIG_NAME,
    RunLocation,
    as_location,
    trainer_key,
    weights_key,
)
from flexmarl_core.runfiles.transport import WeightTransport, serving, weight_transport
from flexmarl_core.runfiles.weights import (
    State,
    from_safetensors,
    load_base,
    load_weights,
    publish_weights,
    save_state_atomic,
    trainer_state_path,
    weights_path,
)
from flexmarl_core.teams import TeamShape, team_shape
from flexmarl_core.trainers import critic as _critic  # noqa: F401  (registers the critic kind)
from flexmarl_core.trainers import policy as _policy  # noqa: F401  (registers the policy kind)
from flexmarl_core.trainers.kinds import TRAINER_KINDS, TrainerKind
from flexmarl_core.training import TrainBackend
from flexmarl_core.training.api import GradientTrainer
from flexmarl_core.training.handles import dump, load, trim_buffers
from flexmarl_core.workloads import make_workload
from flexmarl_core.workloads.api import Workload
from flexmarl_core.workloads.bounded import Deadline, RunStreak
from storage import MEGStore, Store, retry

__all__ = ["CONFIG_NAME", "WorkerContext", "as_location", "context", "load_weights", "publish_weights",
           "save_state_atomic", "trainer_state_path", "weights_path"]


@dataclass
class WorkerContext:
    loc: RunLocation
    cfg: ExperimentConfig
    #: the team's shape (`teams/`), chosen once from the config
    team: TeamShape
    engines: dict[str, InferenceBackend] = field(default_factory=dict)
    trainers: dict[str, TrainBackend] = field(default_factory=dict)
    #: per agent, a trainer that only computes gradients (`helper`)
    helpers: dict[str, GradientTrainer] = field(default_factory=dict)
    #: LoRA agents: (base key, inference backend) -> the one engine of every agent on it; base
    #: key -> the trainers' base
    shared_engines: dict[tuple[str, str], SharedBaseBackend] = field(default_factory=dict)
    shared_train_bases: dict[str, SharedBase] = field(default_factory=dict)
    #: (base key, inference backend) -> the queue that mixes concurrent rollouts in one decode
    coalescers: dict[tuple[str, str], Coalescer] = field(default_factory=dict)
    #: per agent, the (iteration, mb) already in the trainer's accumulated gradients
    accumulated: dict[str, set[tuple[int, int]]] = field(default_factory=dict)
    #: per agent, weights versions a sync made between checkpoints (no file), kept while a
    #: stale rollout may still ask for them (`keep_unpublished`)
    unpublished: dict[str, dict[int, State]] = field(default_factory=dict)
    #: iteration -> micro-batch -> input rows (meta parsed); inputs never change once written
    _inputs: dict[int, dict[int, list[dict[str, Any]]]] = field(default_factory=dict)
    _store: Store | None = None
    _workload: Workload | None = None
    _reward_deadline: Deadline | None = None
    #: re-entrant: a rollout holding it may replay its trainer (`trainer`), which takes it too
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: weights versions this process took from a sync's push instead of reading the file
    pushed_loads: int = 0

    @property
    def meg(self) -> MEG:
        return self.team.meg

    def kind(self, name: str) -> TrainerKind:
        """The kind of `name`'s trainer (an agent's policy, a critic), chosen by the config."""
        return TRAINER_KINDS.get(trainer_kinds(self.cfg)[name])

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = MEGStore(self.cfg.resolved_store_uri())
        return self._store

    @property
    def workload(self) -> Workload:
        if self._workload is None:
            self._workload = make_workload(self.cfg.workload, self.cfg.team)
        return self._workload

    @property
    def reward_deadline(self) -> Deadline:
        """The deadline of each reward call of this run in this process
        (`cluster.deadlines`), with the run's count of inputs in a row past it (every
        worker's, kept at the run's location)."""
        if self._reward_deadline is None:
            d, wl = self.cfg.cluster.deadlines, self.cfg.workload
            what = f"workload.reward {wl.reward!r}" if wl.reward else f"the {wl.kind} workload's reward"
            self._reward_deadline = Deadline(what, d.reward_s, d.reward_timeouts, RunStreak(self.loc))
        return self._reward_deadline

    @property
    def transport(self) -> WeightTransport:
        """How weights reach this process besides their files (`runfiles/transport.py`)."""
        return weight_transport()

    def inputs(self, iteration: int, mb: int) -> list[dict[str, Any]]:
        """The inputs of one micro-batch in their original order, read once per iteration."""
        if iteration not in self._inputs:
            self._inputs[iteration] = inputs_by_mb(self.store, iteration)
        rows = self._inputs[iteration].get(mb)
        if not rows:
            raise RuntimeError(f"iteration {iteration} micro-batch {mb}: no inputs in the store")
        return rows

    def fresh_model(self, agent: str) -> tuple[Any, Any]:
        """The agent's model on `cluster.device`: its engine and trainer follow the model."""
        mcfg = self.cfg.agent(agent).model
        with _MODEL_LOCK:  # transformers' loading patches torch globally: one thread at a time
            model, tok = load_agent_model(mcfg, seed=self.cfg.seed)
        if mcfg.lora is not None:  # the base the run published (a warm start's, or the preset's)
            model.load_state_dict(load_base(self.loc, base_key(mcfg, self.cfg.seed)))
        return model.to(self.cfg.cluster.device), tok

    def _shared_engine(self, agent: str) -> SharedBaseBackend:
        """The one engine this process runs for `agent`'s base (made on first use)."""
        acfg = self.cfg.agent(agent)
        backend = acfg.backend.inference
        key = base_key(acfg.model, self.cfg.seed)
        shared = self.shared_engines.get((key, backend))
        if shared is not None:
            return shared
        model, tok = self.fresh_model(agent)
        if backend == "vllm":  # one vllm.LLM per base, sized for every LoRA agent on it
            peers = [a.model.lora for a in self.cfg.team.agents if a.model.lora is not None
                     and a.backend.inference == "vllm" and base_key(a.model, self.cfg.seed) == key]
            shared = VLLMSharedBaseEngine.from_model(model, tok, dtype=acfg.model.dtype, max_loras=len(peers),
                                                     max_lora_rank=max(s.rank for s in peers))
        else:
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[acfg.model.dtype]
            shared = SharedBaseEngine(model.to(dtype), tok)
        self.shared_engines[(key, backend)] = shared
        return shared

    def _adapter_engine(self, agent: str, version: int) -> InferenceBackend:
        """`agent`'s view of the one engine this process runs for its base; an agent new to it
        brings only its adapter."""
        spec = self.cfg.agent(agent).model.lora
        if spec is None:
            raise ValueError(f"agent {agent!r} is not a LoRA agent (no model.lora)")
        shared = self._shared_engine(agent)
        shared.add(agent, spec, self.weights(agent, version), version)
        return shared.view(agent)

    def coalescer(self, agent: str) -> Coalescer | None:
        """The `inference/coalesce.py` queue shared by the LoRA agents on `agent`'s base in this
        process; None when `codesign.mixed_batch_window_s` is unset or `agent` is not LoRA."""
        window, acfg = self.cfg.codesign.mixed_batch_window_s, self.cfg.agent(agent)
        if window is None or acfg.model.lora is None:
            return None
        key = (base_key(acfg.model, self.cfg.seed), acfg.backend.inference)
        with self.lock:
            if key not in self.coalescers:
                self.coalescers[key] = Coalescer(window, self._shared_engine_at, self.lock)
            return self.coalescers[key]

    def _shared_engine_at(self, agent: str, version: int) -> tuple[SharedBaseBackend, bool]:
        """The shared-base engine holding `agent`'s adapter `version`, and whether that version
        came from a sync's push (a coalescer's `load`)."""
        pushed = self.pushed_loads
        self.engine(agent, version)
        return self._shared_engine(agent), self.pushed_loads > pushed

    def _new_trainer(self, name: str) -> TrainBackend:
        """A trainer at version 0, of the kind `name` is (`trainers/kinds.py`)."""
        return self.kind(name).new_trainer(self, name)

    @property
    def one_process(self) -> bool:
        """Every op of the run runs in this one process (a local cluster of one worker) on a
        local run folder: no other process needs a weight file or trainer state between
        checkpoints. (On object storage the op log is uploaded every few seconds, so a resume
        could not tell which steps a replay must redo: there every step is written.)"""
        return self.loc.local and self.cfg.cluster.address is None and len(self.cfg.cluster.workers) == 1

    def checkpoint_due(self, version: int) -> bool:
        """Whether the state after `version` steps is written out: every `train.checkpoint_every`
        steps and the last one; every step when other processes read it (weights for their
        rollouts, trainer states for on-demand allocation and lost workers)."""
        every = self.cfg.train.checkpoint_every
        return not self.one_process or version % every == 0 or version >= self.cfg.train.iterations

    def weights(self, agent: str, version: int) -> State:
        """Weights `version` of `agent`: the copy a sync pushed to this process, the published
        file, or (between checkpoints) this process's trainer at that version, replayed from the
        last checkpoint if need be."""
        blob = self.transport.pushed(self.loc.uri, agent, version)
        if blob is not None:
            self.pushed_loads += 1
            return from_safetensors(blob, f"weights {agent} v{version} pushed by a sync")
        key = weights_key(agent, version)
        if version == 0 or self.loc.is_file(key):
            return load_weights(self.loc, agent, version)
        kept = self.unpublished.get(agent, {}).get(version)
        if kept is not None:
            return kept
        tr, _ = self.trainer(agent, version)
        if tr.version != version:
            raise RuntimeError(
                f"agent {agent!r}: weights version {version} not published at "
                f"{self.loc.display(key)} and the trainer is at {tr.version}"
            )
        return tr.weights()

    def keep_unpublished(self, agent: str, version: int, state: State) -> None:
        """Keep a copy of `agent`'s weights `version`, which a sync made between checkpoints: a
        rollout up to `codesign.max_staleness` versions behind may ask for it after the trainer
        here has stepped on (nothing else could give it back). Older ones are dropped."""
        k = self.cfg.codesign.max_staleness
        if k <= 0:
            return
        kept = self.unpublished.setdefault(agent, {})
        kept[version] = {n: t.detach().clone() for n, t in state.items()}
        for old in [v for v in kept if v < version - k]:
            del kept[old]

    def engine(self, agent: str, version: int) -> InferenceBackend:
        """This process's inference engine for `agent`, holding weights `version`."""
        eng = self.engines.get(agent)
        if eng is None and self.cfg.agent(agent).model.lora is not None:
            eng = self.engines[agent] = self._adapter_engine(agent, version)
        elif eng is None:
            model, tok = self.fresh_model(agent)
            eng = make_inference_engine(self.cfg.agent(agent), model, tok)
            eng.update_weights(self.weights(agent, version), version)
            self.engines[agent] = eng
        elif eng.version != version:
            eng.update_weights(self.weights(agent, version), version)
        serving(self.loc.uri, agent)  # a sync may push its next weights here
        return eng

    def helper(self, agent: str, version: int) -> GradientTrainer:
        """This process's gradient helper for `agent` holding weights `version`: a trainer of
        the agent's kind that never steps, only lends its forward and backward to train ops
        that run away from the agent's own trainer (`codesign.gradient_helpers`)."""
        h = self.helpers.get(agent)
        if h is None:
            tr = self._new_trainer(agent)  # weights version 0, no grads
            if not isinstance(tr, GradientTrainer):
                raise TypeError(f"agent {agent!r}: its trainer ({type(tr).__name__}) cannot lend its "
                                "gradient (codesign.gradient_helpers needs the plain torch trainer)")
            h = self.helpers[agent] = tr
        if h.version != version:
            h.set_weights(self.weights(agent, version), version)
        return h

    def trainer(self, agent: str, version: int) -> tuple[TrainBackend, dict[str, float]]:
        """This process's trainer for `agent` at `version` (or later: a retried op finds its
        work done), and swap figures when the state had to be swapped in.

        A trainer this process holds at an older version was moved to another worker since
        (on-demand allocation): its state is swapped in from the checkpoint of `version`.
        Between scheduled checkpoints (`checkpoint_due`) there is none: the state is that of
        the last checkpoint with the steps since replayed from the store's samples.
        """
        tr = self.trainers.get(agent)
        if tr is not None and tr.version >= version:
            return tr, self._keep_resident(agent)
        # Others out first, then this one in: never one trainer state more than the limit.
        room = self._make_room(agent)
        t0 = time.perf_counter()
        if tr is None:
            tr = self._new_trainer(agent)
        key = trainer_key(agent, version)
        have: list[int] = []
        at = version if version > 0 and self.loc.is_file(key) else None
        if at is None:
            # An op rerun after its trainer moved on (a resume after `store repair`): the work
            # is done; the newest state says so (the run keeps no older one, driver/retention.py).
            have = self.loc.versions(f"trainers/{agent}")
            at = max((v for v in have if v > version), default=None)
        if version == 0 and at is None:
            self.trainers[agent] = tr
            return tr, {**room, **self._keep_resident(agent)}
        if at is not None:
            t0 = time.perf_counter()  # the state's read and load (not the trainer's making)
            nbytes = self._load_trainer_state(tr, agent, at)
            swap_in_s = time.perf_counter() - t0
            self.trainers[agent] = tr
            self.accumulated[agent] = set()  # gradients of the stale copy are not this state's
            out = {**room, **self._keep_resident(agent)}
            return tr, {**out, "swap_in_s": swap_in_s, "swap_in_bytes": float(nbytes)}
        if self.checkpoint_due(version):
            raise RuntimeError(
                f"agent {agent!r}: trainer state version {version} is neither in this worker's "
                f"memory nor checkpointed at {self.loc.display(key)}"
            )
        # Between checkpoints, in the run's one process: replay from the newest state at hand
        # (this process's trainer, or the last checkpoint after a restart).
        base = max((v for v in have if v < version), default=0)
        swap: dict[str, float] = dict(room)
        if base > tr.version:
            swap["swap_in_bytes"] = float(self._load_trainer_state(tr, agent, base))
            self.accumulated[agent] = set()
        self.trainers[agent] = tr
        swap.update(self._keep_resident(agent))
        with self.lock:
            while tr.version < version:  # the steps since the checkpoint, from the store's samples
                self.kind(agent).step(self, agent, tr, tr.version, replaying=True)
        return tr, {**swap, "swap_in_s": time.perf_counter() - t0}

    @functools.cached_property
    def resident_limit(self) -> int | None:
        """Trainer states this process keeps in memory at once (None: all): its worker's
        `resident_trainers`, else what the memory plan fits in its `memory_limit`."""
        name = os.environ.get("FLEXMARL_WORKER_NAME")
        workers = self.cfg.cluster.workers
        if name is None and len(workers) == 1:  # the run's one worker, in this process
            name = workers[0].name
        return None if name is None else memory.resident_limit(self.cfg, name)

    def _keep_resident(self, agent: str) -> dict[str, float]:
        """`agent`'s trainer is the most recently used; the least recently used beyond
        `resident_limit` are swapped out (checkpointed first if their state is not: the
        figures returned) and freed: `trainer` swaps one back in when it is needed again."""
        self.trainers[agent] = self.trainers.pop(agent)  # dict order is recency
        return self._evict(self.resident_limit, keep=agent)

    def _make_room(self, agent: str) -> dict[str, float]:
        """Before `agent`'s trainer is made or swapped in: the others down to one below the limit."""
        limit = self.resident_limit
        return {} if limit is None else self._evict(limit - (agent not in self.trainers), keep=agent)

    def _evict(self, limit: int | None, keep: str) -> dict[str, float]:
        """Swap out the least recently used trainers but `keep`'s until `limit` are resident."""
        if limit is None or len(self.trainers) <= limit:
            return {}
        out: dict[str, float] = {}
        while len(self.trainers) > limit and any(a != keep for a in self.trainers):
            old = next(a for a in self.trainers if a != keep)
            version = self.trainers[old].version
            if version > 0 and not self.loc.is_file(trainer_key(old, version)):
                for k, v in self.checkpoint_trainer(old).items():
                    out[k] = out.get(k, 0.0) + v
            del self.trainers[old]
            self.accumulated.pop(old, None)  # its gradients go with it: a step accumulates them again
        gc.collect()
        return out

    def _load_trainer_state(self, tr: TrainBackend, agent: str, version: int) -> int:
        """Load the checkpointed state `version` of `agent` into `tr`; returns its size."""
        key = trainer_key(agent, version)
        with self.loc.open_input(key) as f:
            tr.load_state(load(f, what=self.loc.display(key)))
            nbytes = f.tell()
        if self.resident_limit is not None:
            # Swapping to fit in memory: the read buffer goes back now instead of waiting in the
            # pool for the next swap-in (a 0.5B state kept 5.5 GB resident there).
            trim_buffers()
        return nbytes

    def checkpoint_trainer(self, agent: str) -> dict[str, float]:
        """Swap the trainer state out to the shared tier after a step (atomic file). The run
        deletes the older ones once its op log no longer needs them (`driver/retention.py`)."""
        tr = self.trainers[agent]
        t0 = time.perf_counter()
        with self.loc.open_output(trainer_key(agent, tr.version)) as f:
            nbytes = dump(tr.state(copy=False), f)  # under the lock: nothing steps meanwhile
        return {"swap_out_s": time.perf_counter() - t0, "swap_out_bytes": float(nbytes)}


def inputs_by_mb(store: Store, iteration: int) -> dict[int, list[dict[str, Any]]]:
    """An iteration's inputs per micro-batch, in their original order (`meta` parsed: the run
    wrote each input's micro-batch and position there, `driver/run.py`)."""
    by_mb: dict[int, list[dict[str, Any]]] = {}
    for r in store.read_inputs(iteration).to_pylist():
        r["meta"] = json.loads(r["meta"] or "{}")
        by_mb.setdefault(r["meta"]["mb"], []).append(r)
    for rows in by_mb.values():
        rows.sort(key=lambda r: r["meta"]["pos"])
    return by_mb


_CONTEXTS: dict[str, WorkerContext] = {}
_LOCK = threading.Lock()
_MODEL_LOCK = threading.Lock()


def context(run_dir: str | os.PathLike[str] | RunLocation) -> WorkerContext:
    loc = as_location(run_dir)
    with _LOCK:
        ctx = _CONTEXTS.get(loc.uri)
        if ctx is None:
            threads = os.environ.get("FLEXMARL_TORCH_THREADS")
            if threads:
                torch.set_num_threads(int(threads))
            try:
                text = loc.read_text(CONFIG_NAME)
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"{loc.display(CONFIG_NAME)}: no run config there (is run_dir the same "
                    "location on this worker as in the flow process?)") from None
            cfg = config_from_text(text, source=loc.display(CONFIG_NAME))
            retry.configure(retry.RetryPolicy(**cfg.store.retries.model_dump()))
            ctx = WorkerContext(loc=loc, cfg=cfg, team=team_shape(cfg))
            _CONTEXTS[loc.uri] = ctx
        return ctx
