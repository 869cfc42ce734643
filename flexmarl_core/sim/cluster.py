"""Cluster and model descriptions for the simulator (`configs/sim/*.yaml`), and the cost model
and workers they imply.

A simulated worker is a device group, not one device: an inference instance of
`inference.group_devices` devices (engine replicas of `inference.tp` devices each) or a
training slot of `training.group_devices` devices. Instances start statically partitioned
between the agents (`rollout:<agent>` tags, round-robin), as a synchronous multi-agent trainer
places them; training slots carry `train`. The roofline of each op follows from the device
figures, the agent's model dimensions (its `model.path` config.json) and the group's devices
(`cost.py` has the formulas).

Every figure carries its source in the YAML comments; the description's `sources` travel
into the simulator's JSON output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flexmarl_core.config import ConfigError, ExperimentConfig, parse_overrides
from flexmarl_core.config.load import _set_path
from flexmarl_core.control import TRAIN_TAG, rollout_tag
from flexmarl_core.sim.cost import AgentCost, CostModel, LengthDist


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeviceSpec(_Strict):
    name: str = Field(description="What the figures describe.")
    memory_gb: float = Field(gt=0, description="Device memory (GB).")
    hbm_gbps: float = Field(gt=0, description="Memory bandwidth (GB/s).")
    bf16_tflops: float = Field(gt=0, description="Dense bf16 peak (TFLOP/s).")
    host_link_gbps: float = Field(gt=0, description="Device-host bandwidth per device (GB/s): swaps, weight loads.")
    net_gbps: float = Field(gt=0, description="Inter-node bandwidth per node (GB/s): weight sync.")


class ModelSpec(_Strict):
    """A decoder-only transformer's dimensions, as in a Hugging Face `config.json`."""

    model_config = ConfigDict(extra="ignore")
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    tie_word_embeddings: bool = False

    @classmethod
    def from_folder(cls, folder: str | Path, where: str) -> ModelSpec:
        path = Path(folder) / "config.json"
        try:
            return cls.model_validate(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, ValidationError) as exc:
            raise ConfigError(f"{where}: cannot read model dimensions from {path}: {exc}") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def params(self) -> float:
        """Parameters of a Qwen2/Llama-style block stack (q/k/v biases, SwiGLU MLP, RMSNorms)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attn = 2 * h * h + 2 * h * kv + h + 2 * kv
        block = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return float(self.num_hidden_layers * block + embed + h)

    @property
    def weight_bytes(self) -> float:  # bf16
        return self.params * 2

    @property
    def state_bytes(self) -> float:
        # Mixed-precision Adam: bf16 weights + bf16 grads + fp32 master + two fp32 moments.
        return self.params * 16

    @property
    def kv_bytes_per_token(self) -> float:  # K and V, bf16, every layer
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2


class PoolSpec(_Strict):
    nodes: int = Field(ge=1, description="Nodes in this pool.")
    group_devices: int = Field(ge=1, description="Devices per worker (instance or slot).")
    tp: int | None = Field(None, ge=1, description="Inference: tensor-parallel devices per engine "
                           "replica (default: the whole group); group_devices / tp replicas.")
    release: Literal["op", "replica"] = Field(
        "op", description="Inference: when a rollout's engine replicas take the next work. `op`: all at "
        "once, when the op's slowest replica ends; `replica`: each as its own share ends, and an "
        "instance takes a second rollout while the first's last replicas decode.")


class Efficiency(_Strict):
    decode_bw: float = Field(0.6, gt=0, le=1, description="Share of HBM bandwidth decode reaches.")
    decode_mfu: float = Field(0.4, gt=0, le=1)
    prefill_mfu: float = Field(0.5, gt=0, le=1)
    train_mfu: float = Field(0.35, gt=0, le=1)
    kv_memory_fraction: float = Field(0.9, gt=0, le=1, description="Share of group memory for weights + KV.")
    step_overhead_s: float = Field(0.001, ge=0, description="Per decode step: launches, TP all-reduces.")


class Latency(_Strict):
    dispatch_s: float = Field(0.0, ge=0)
    gap_s: float = Field(0.0, ge=0)
    report_s: float = Field(0.0, ge=0)
    store_s: float = Field(0.0, ge=0)
    reward_sample_s: float = Field(0.0, ge=0)


class LengthSpec(_Strict):
    mean: float = Field(gt=0, description="Mean response tokens (before the cap).")
    sigma: float = Field(ge=0, description="Log-sigma: the tail's weight.")


class SimCluster(_Strict):
    name: str
    nodes: int = Field(ge=1)
    devices_per_node: int = Field(ge=1)
    device: DeviceSpec
    inference: PoolSpec
    training: PoolSpec
    efficiency: Efficiency = Field(default_factory=Efficiency)
    latency: Latency = Field(default_factory=Latency)
    #: agent name (digits stripped, or `default`) -> response lengths; the cap is max_new_tokens
    lengths: dict[str, LengthSpec]
    prompt_tokens: dict[str, int] = Field(default_factory=lambda: {"default": 256})
    #: one trainer state per slot at a time: a second agent's state swaps the first out
    states_per_slot: int | None = 1
    engines_per_worker: int | None = 1
    #: where each figure comes from, echoed in the output
    sources: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _fits(self) -> SimCluster:
        used = self.inference.nodes + self.training.nodes
        if used > self.nodes:
            raise ValueError(f"inference.nodes + training.nodes = {used} exceeds nodes = {self.nodes}")
        for pool in ("inference", "training"):
            g = getattr(self, pool).group_devices
            if (getattr(self, pool).nodes * self.devices_per_node) % g:
                raise ValueError(f"{pool}.group_devices={g} does not divide its {getattr(self, pool).nodes} "
                                 f"nodes x {self.devices_per_node} devices")
        if self.inference.group_devices % self.tp:
            raise ValueError(f"inference.tp={self.tp} does not divide inference.group_devices="
                             f"{self.inference.group_devices}")
        return self

    @property
    def tp(self) -> int:
        return self.inference.tp or self.inference.group_devices

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node


def load_cluster(path: str | Path, overrides: list[str] | None = None) -> SimCluster:
    """Read a cluster description; `overrides` are `sim.<field>=value` (the prefix optional)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read cluster description: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping")
    for key, value in parse_overrides(overrides or [], source=str(p)):
        _set_path(data, key.removeprefix("sim."), value, source=str(p))
    try:
        return SimCluster.model_validate(data)
    except ValidationError as exc:
        lines = [f"{p}: {'.'.join(str(x) for x in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()]
        raise ConfigError("invalid cluster description: " + "; ".join(lines)) from None


def workers(cluster: SimCluster, agents: list[str]) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Worker tags and the pool of each worker: instances round-robin over the agents."""
    n_inf = cluster.inference.nodes * cluster.devices_per_node // cluster.inference.group_devices
    n_tr = cluster.training.nodes * cluster.devices_per_node // cluster.training.group_devices
    if n_inf < len(agents):
        raise ConfigError(f"cluster {cluster.name!r}: {n_inf} inference instances for {len(agents)} agents; "
                          "every agent needs one (more inference.nodes or smaller group_devices)")
    out: dict[str, dict[str, float]] = {}
    pools: dict[str, str] = {}
    width = len(str(max(n_inf, n_tr)))
    for i in range(n_inf):
        name = f"inf{i:0{width}d}"
        out[name], pools[name] = {rollout_tag(agents[i % len(agents)]): 1.0}, "inference"
    for i in range(n_tr):
        name = f"train{i:0{width}d}"
        out[name], pools[name] = {TRAIN_TAG: 1.0}, "training"
    return out, pools


def _pick(table: dict[str, Any], agent: str, what: str, cluster: str) -> Any:
    """An agent's entry: its name, else its name without trailing digits (`solver3` ->
    `solver`), else `default`."""
    for key in (agent, agent.rstrip("0123456789")):
        if key in table:
            return table[key]
    if "default" in table:
        return table["default"]
    raise ConfigError(f"cluster {cluster!r}: {what} has no entry for agent {agent!r} and no `default`")


def cost_model(cluster: SimCluster, cfg: ExperimentConfig) -> CostModel:
    """The roofline cost model of `cfg`'s agents on `cluster`."""
    dev, eff = cluster.device, cluster.efficiency
    d_inf, d_tr = cluster.tp, cluster.training.group_devices  # d_inf: devices of one replica
    replicas = cluster.inference.group_devices // cluster.tp
    bw, flops = dev.hbm_gbps * 1e9 * eff.decode_bw, dev.bf16_tflops * 1e12
    tr_nodes = max(d_tr / cluster.devices_per_node, 1.0)
    agents: dict[str, AgentCost] = {}
    for a in cfg.team.agents:
        where = f"team.agents[{a.name}].model.path"
        if not a.model.path:
            raise ConfigError(f"{where}: the simulator prices an agent by its model's dimensions: set "
                              "model.path to a folder with a config.json (e.g. configs/sim/models/qwen2.5-14b)")
        m = ModelSpec.from_folder(a.model.path, where)
        n = m.params
        ls = _pick(cluster.lengths, a.name, "lengths", cluster.name)
        prompt = int(_pick(cluster.prompt_tokens, a.name, "prompt_tokens", cluster.name))
        cap = a.sampling.max_new_tokens
        kv_room = d_inf * dev.memory_gb * 1e9 * eff.kv_memory_fraction - m.weight_bytes
        if kv_room <= 0:
            raise ConfigError(f"agent {a.name!r}: {a.model.path} ({m.weight_bytes / 1e9:.0f} GB of weights) does not "
                              f"fit an inference group of {d_inf} x {dev.memory_gb:g} GB")
        # vLLM allocates KV pages as sequences grow: a sequence holds its prompt plus half the
        # cap on average over its life (assumption).
        per_seq = m.kv_bytes_per_token * (prompt + min(cap, 2 * ls.mean) / 2)
        agents[a.name] = AgentCost(
            prompt_tokens=prompt, lengths=LengthDist(ls.mean, ls.sigma, cap),
            weight_bytes=m.weight_bytes, state_bytes=m.state_bytes, batching="continuous",
            replicas=replicas,
            max_concurrency=max(int(kv_room // per_seq), 1),
            prefill_token_s=2 * n / (d_inf * flops * eff.prefill_mfu),
            step_mem_s=m.weight_bytes / (d_inf * bw),
            step_seq_s=2 * n / (d_inf * flops * eff.decode_mfu),
            kv_token_s=m.kv_bytes_per_token / (d_inf * bw),
            step_over_s=eff.step_overhead_s,
            train_token_s=6 * n / (d_tr * flops * eff.train_mfu),
            train_prompt_weight=1.0,
            # The optimizer reads and writes the whole state once (HBM-bound).
            step_s=2 * m.state_bytes / (d_tr * dev.hbm_gbps * 1e9),
        )
    lat = cluster.latency
    return CostModel(
        agents=agents, dispatch_s=lat.dispatch_s, gap_s=lat.gap_s, report_s=lat.report_s,
        store_s=lat.store_s, reward_sample_s=lat.reward_sample_s,
        # Replicas load in parallel; a swap moves the state over every device's host link.
        load_gbps=d_inf * dev.host_link_gbps, swap_gbps=d_tr * dev.host_link_gbps,
        sync_gbps=tr_nodes * dev.net_gbps,
        states_per_slot=cluster.states_per_slot, engines_per_worker=cluster.engines_per_worker,
        replica_release=cluster.inference.release == "replica",
        sources=dict(cluster.sources),
    )
