"""What a run needs in memory, said before it starts: per agent, the weights, gradients and
optimizer state of its trainer, its engine's copy and KV cache at the configured batch and
lengths, and one training chunk's activations; per worker, whether that fits its
`memory_limit` with every trainer state resident, only with some swapped out (on-demand
allocation then keeps at most that many resident), or not at all (refused with the figures).

A worker can come to hold every agent's engine (the balancer re-tags rollout workers) and every
trainer it may train (on-demand allocation moves them): the plan takes that worst case.

    need(worker) = BASELINE + sum(engines) + max(KV) + sum(k largest trainer states)
                   + max(chunk activations, optimizer step temporaries[, a swap-in's read buffer])

The terms are fp32 training (AdamW: weights, gradients, two moments = 16 bytes per trained
parameter), the engine in `model.dtype`, a frozen reference when `kl_coef` > 0, and a shared
LoRA base counted once per worker. The step's temporaries: torch's AdamW on CPU (one tensor
at a time) makes `sqrt(v)` and its quotient, two fp32 copies of the trained parameters, while
no activations are alive.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from flexmarl_core.config import AgentConfig, ExperimentConfig, TeamConfig
from flexmarl_core.control.tags import TRAIN_TAG, is_rollout_tag

#: a worker process's own memory: Python, torch, transformers, Dask, pyarrow (RSS measured
#: after importing them: 434 MiB), rounded up
BASELINE = 512 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class AgentMemory:
    agent: str
    params: int
    trained_params: int
    weights: int  # the trainer's fp32 weights (a LoRA agent: its adapter; the base is `base`)
    grads: int
    optimizer: int
    reference: int
    base: int  # a LoRA agent's frozen fp32 training base (shared by agents on that base)
    base_key: str | None
    engine: int
    kv_cache: int
    activations: int
    step: int  # the optimizer step's temporaries

    @property
    def trainer(self) -> int:
        return self.weights + self.grads + self.optimizer + self.reference


@dataclass(frozen=True)
class WorkerMemory:
    worker: str
    limit: int
    agents: tuple[str, ...]  # whose trainer it may hold
    all_resident: int
    one_resident: int
    resident: int | None  # trainer states that fit at once; None: all of them; 0: not even one
    planned: int  # the need at that many resident states
    asked: int | None = None  # `resident_trainers` set by hand

    @property
    def verdict(self) -> str:
        if self.resident is None:
            return "fits"
        if self.resident == 0:
            return "does not fit"
        return "fits with swap" if self.all_resident > self.limit else "swaps by choice"


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
          "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """`6GiB`, `512 MB`, `1e9` -> bytes, as Dask's `parse_bytes` reads a worker's memory_limit
    (core code does not import Dask)."""
    s = text.strip().replace(" ", "")
    i = len(s)
    while i and s[i - 1].isalpha():
        i -= 1
    unit = s[i:].lower()
    if unit not in _UNITS or not s[:i]:
        raise ValueError(f"not a memory size: {text!r} (e.g. 6GiB, 512MB)")
    return int(float(s[:i]) * _UNITS[unit])


@lru_cache(maxsize=32)
def _shape(folder: str | None, preset: str | None) -> Any:
    from transformers import AutoConfig

    from flexmarl_core.models import get_tokenizer, preset_config

    return AutoConfig.from_pretrained(folder) if folder else preset_config(preset or "", get_tokenizer())


@lru_cache(maxsize=32)
def _count(folder: str | None, preset: str | None) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: no memory, no init time
        model = AutoModelForCausalLM.from_config(_shape(folder, preset))
    return sum(p.numel() for p in model.parameters())


def _lora_params(shape: Any, a: AgentConfig) -> int:
    assert a.model.lora is not None
    h, inter = int(shape.hidden_size), int(shape.intermediate_size)
    kv = int(shape.num_key_value_heads) * (h // int(shape.num_attention_heads))
    dims = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    per_layer = sum(sum(dims[m]) for m in a.model.lora.target_modules if m in dims)
    return a.model.lora.rank * per_layer * int(shape.num_hidden_layers)


def agent_memory(cfg: ExperimentConfig, a: AgentConfig) -> AgentMemory:
    from flexmarl_core.training.memory import bytes_per_token, default_chunk_tokens

    folder = a.model.folder()
    key = (None if folder is None else str(folder), a.model.preset)
    shape, params = _shape(*key), _count(*key)
    lora = a.model.lora is not None
    trained = _lora_params(shape, a) if lora else params
    engine_bytes = 2 if a.model.dtype == "bfloat16" else 4
    rows = cfg.batch.micro_batch_inputs * cfg.batch.group_size
    seq = _prompt_tokens(cfg.team, a) + a.sampling.max_new_tokens
    head_dim = int(shape.hidden_size) // int(shape.num_attention_heads)
    kv = 2 * int(shape.num_hidden_layers) * int(shape.num_key_value_heads) * head_dim * engine_bytes * rows * seq
    ckpt = a.backend.activation_checkpointing
    worker_limit = min((parse_size(w.memory_limit) for w in cfg.cluster.workers), default=8 * GIB)
    chunk = min(rows * seq, a.backend.train_chunk_tokens or default_chunk_tokens(
        shape, activation_checkpointing=ckpt, memory_limit=worker_limit))
    trainable = a.trainable
    return AgentMemory(
        agent=a.name, params=params, trained_params=trained if trainable else 0,
        weights=4 * trained if trainable else 0, grads=4 * trained if trainable else 0,
        optimizer=8 * trained if trainable else 0,
        reference=4 * params if trainable and a.algorithm.kl_coef > 0 else 0,
        base=4 * params if lora and trainable else 0,
        base_key=f"{key}" if lora else None,
        engine=(params if not lora else params + trained) * engine_bytes,
        kv_cache=kv,
        activations=int(chunk * bytes_per_token(shape, activation_checkpointing=ckpt)) if trainable else 0,
        step=8 * trained if trainable else 0,
    )


def _prompt_tokens(team: TeamConfig, a: AgentConfig) -> int:
    # A byte-level upper bound: the template's characters and every parent's answer (a program
    # team has no template: its calls' prompts are counted as twice the answer).
    by = {x.name: x for x in team.agents}
    parents = sum(by[e.src].sampling.max_new_tokens for e in team.edges if e.dst == a.name)
    return len(a.template or "") + parents + (0 if a.template else 2 * a.sampling.max_new_tokens) + 64


def plan(cfg: ExperimentConfig) -> tuple[list[AgentMemory], list[WorkerMemory]]:
    agents = [agent_memory(cfg, a) for a in cfg.team.agents]
    by_name = {m.agent: m for m in agents}
    out = []
    for w in cfg.cluster.workers:
        limit = parse_size(w.memory_limit)
        rollout = any(is_rollout_tag(t) for t in w.resources)
        hosts = [m for m in agents if rollout and (cfg.codesign.load_balancing or "rollout" in w.resources
                                                    or f"rollout:{m.agent}" in w.resources)]
        trains = [m for m in agents if w.resources.get(TRAIN_TAG, 0) > 0 and by_name[m.agent].trainer > 0]
        engines = _engines(hosts)
        base = BASELINE + engines + max((m.kv_cache for m in hosts), default=0) + _bases(trains)
        transient = max((max(m.activations, m.step) for m in trains), default=0)
        fixed = base + transient
        # Swapping: a swap-in reads the state file (weights and moments) into a buffer beside
        # the trainer it fills.
        swapping = base + max(transient, max((m.weights + m.optimizer for m in trains), default=0))
        states = sorted((m.trainer for m in trains), reverse=True)
        all_res, one_res = fixed + sum(states), (swapping if len(states) > 1 else fixed) + (states[0] if states else 0)
        fit = 0  # how many of the largest states fit at once
        while fit < len(states) and (fixed if fit + 1 == len(states) else swapping) + sum(states[: fit + 1]) <= limit:
            fit += 1
        resident: int | None = None if fit == len(states) else fit
        asked = w.resident_trainers
        if asked is not None:  # set by hand: what it asks for, if that fits
            resident = (None if asked >= len(states) else asked) if asked <= fit else 0
        planned = (fixed if resident is None else swapping) + sum(states[: len(states) if resident is None else resident])
        out.append(WorkerMemory(w.name, limit, tuple(m.agent for m in trains), all_res, one_res, resident,
                                planned, asked))
    return agents, out


def _engines(hosts: list[AgentMemory]) -> int:
    # LoRA agents on one base share one engine (the base plus every adapter)
    shared: dict[str, int] = {}
    total = 0
    for m in hosts:
        if m.base_key is None:
            total += m.engine
        else:
            shared[m.base_key] = shared.get(m.base_key, 0) + m.engine
    return total + sum(shared.values())


def _bases(trains: list[AgentMemory]) -> int:
    return sum({m.base_key: m.base for m in trains if m.base_key is not None}.values())


def check(cfg: ExperimentConfig) -> list[str]:
    """The plan's lines; raises `ConfigError` with them when a worker cannot hold the team even
    with one trainer state resident, or needs swapping that on-demand allocation is off for."""
    from flexmarl_core.config import ConfigError

    agents, workers = plan(cfg)
    lines = report(agents, workers)
    short = [w for w in workers if w.resident == 0]
    if short and short[0].asked is not None:
        w = short[0]
        raise ConfigError(
            f"cluster.workers[{w.worker}].resident_trainers: {w.asked} trainer states do not fit its memory_limit "
            f"{w.limit / GIB:.2f} GiB: lower it, or leave it unset for what fits\n" + "\n".join(lines))
    if short:
        w = short[0]
        raise ConfigError(
            f"cluster.workers[{w.worker}]: the team does not fit its memory_limit {w.limit / GIB:.2f} GiB even "
            f"with one trainer state resident ({w.one_resident / GIB:.2f} GiB needed): raise memory_limit, "
            "use fewer agents per worker, LoRA (model.lora) or a bfloat16 engine (model.dtype)\n"
            + "\n".join(lines))
    swapping = [w for w in workers if w.verdict == "fits with swap"]
    if swapping and not cfg.codesign.on_demand_allocation:
        raise ConfigError(
            f"cluster.workers[{swapping[0].worker}]: the team fits only with trainer states swapped out "
            f"(at most {swapping[0].resident} resident), which needs codesign.on_demand_allocation: true\n"
            + "\n".join(lines))
    if all(w.resident is None for w in workers):  # the common case: one line
        return ["memory plan: every worker fits with every trainer resident (" + ", ".join(
            f"{w.worker} {w.all_resident / GIB:.2f} of {w.limit / GIB:.2f} GiB" for w in workers) + ")"]
    return lines


def resident_limit(cfg: ExperimentConfig, worker: str) -> int | None:
    """How many trainer states the worker named `worker` keeps resident (None: all)."""
    for w in plan(cfg)[1]:
        if w.worker == worker:
            return w.resident or None
    return None


def report(agents: list[AgentMemory], workers: list[WorkerMemory]) -> list[str]:
    """The plan as text lines (the run prints them at start and `flexmarl plan` alone)."""
    g = lambda n: f"{n / GIB:.2f}"  # noqa: E731
    lines = ["memory plan (GiB): agent  params  weights  grads  optimizer  engine  kv_cache  activations  step"]
    lines += [f"  {m.agent}  {m.params / 1e6:.1f}M  {g(m.weights + m.base)}  {g(m.grads)}  {g(m.optimizer)}  "
              f"{g(m.engine)}  {g(m.kv_cache)}  {g(m.activations)}  {g(m.step)}" for m in agents]
    for w in workers:
        extra = "" if w.resident is None else (
            f": at most {w.resident} of {len(w.agents)} trainer states resident, the rest swapped out"
            if w.resident else ": not even one trainer state fits")
        lines.append(f"  worker {w.worker}: {g(w.all_resident)} with every trainer resident, "
                     f"{g(w.one_resident)} with one, limit {g(w.limit)}: {w.verdict}{extra}")
    return lines
