"""The simulator's cost model: seconds of every op from its work (tokens, batch, bytes).

One form serves both sources of numbers: a device cluster (roofline figures of the device and
the agent's model size, `sim.cluster`) and a calibration from a real run's op log
(`sim.calibrate`). Per agent:

    rollout  = slowest of the worker's `replicas` (the micro-batch's sequences dealt
               round-robin over them) of prefill_token_s * prompt tokens + decode; + store_s
      decode: one step per generated token; step(n active, ctx tokens) =
              max(step_mem_s, n * step_seq_s) + ctx * kv_token_s + step_over_s
              (memory-bound weight read vs compute per sequence, plus the KV-cache read).
              `continuous` batching drops finished sequences and admits queued ones up to
              `max_concurrency`; `static` (HF generate) keeps every row until the longest ends.
    train    = train_fixed_s + train_token_s * (response + train_prompt_weight * prompt tokens)
    step     = step_s + checkpoint (state_bytes / swap_gbps: swap_out)
    sync     = sync_s + weight_bytes / sync_gbps
    reward   = reward_fixed_s + reward_sample_s * samples
    state in = state_bytes / swap_gbps (on-demand allocation: the trainer moved here)
    weights  = weight_bytes / load_gbps (an instance without this agent's current version)

plus `dispatch_s` (submit to start on an idle worker), `gap_s` (between queued ops on one
worker) and `report_s` (end to the orchestrator seeing it). Response lengths come from a
per-agent capped lognormal (`LengthDist`), drawn per (op, seed) so every schedule of one
config samples the same work.
"""

from __future__ import annotations

import heapq
import math
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np


@dataclass(frozen=True)
class LengthDist:
    """Response tokens per sequence: lognormal with this mean and log-sigma, capped at `cap`
    (a long tail: most answers short, a few run to the cap)."""

    mean: float
    sigma: float
    cap: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.sigma <= 0:
            return np.full(n, min(max(int(round(self.mean)), 1), self.cap), dtype=np.int64)
        mu = math.log(max(self.mean, 1.0)) - self.sigma**2 / 2  # so the uncapped mean is `mean`
        out = np.rint(rng.lognormal(mu, self.sigma, n))
        return np.clip(out, 1, self.cap).astype(np.int64)


def op_rng(seed: int, *key: object) -> np.random.Generator:
    """A generator for one op's draws, independent of the order ops run in."""
    return np.random.default_rng([seed, zlib.crc32(repr(key).encode())])


@dataclass
class AgentCost:
    prompt_tokens: int  #: input prompt tokens (parents' responses are added per trajectory)
    lengths: LengthDist
    weight_bytes: float
    state_bytes: float  #: trainer state (weights, master copy, optimizer) moved by a swap
    batching: Literal["continuous", "static"] = "continuous"
    #: engine replicas in one worker (data parallel): a micro-batch's sequences are dealt
    #: round-robin over them and the op ends with the slowest replica
    replicas: int = 1
    max_concurrency: int = 1 << 30  #: sequences one replica decodes at once (KV memory)
    prefill_token_s: float = 0.0
    step_mem_s: float = 0.0
    step_seq_s: float = 0.0
    kv_token_s: float = 0.0
    step_over_s: float = 0.0
    train_fixed_s: float = 0.0
    train_token_s: float = 0.0
    train_prompt_weight: float = 1.0
    step_s: float = 0.0
    sync_s: float = 0.0
    #: first op of this agent on a worker: building the engine / trainer there
    engine_init_s: float = 0.0
    trainer_init_s: float = 0.0


@dataclass
class CostModel:
    agents: dict[str, AgentCost]
    dispatch_s: float = 0.0
    gap_s: float = 0.0
    report_s: float = 0.0
    store_s: float = 0.0
    reward_fixed_s: float = 0.0
    reward_sample_s: float = 0.0
    load_gbps: float = 1.0
    swap_gbps: float = 1.0
    sync_gbps: float = 1.0
    #: trainer states one training slot holds at once (None: no limit, as on a CPU worker)
    states_per_slot: int | None = None
    #: engines one inference group holds at once (None: no limit)
    engines_per_worker: int | None = None
    #: a rollout's replicas are released one by one as their shares end (`SimExecutor`)
    replica_release: bool = False
    #: where each figure comes from: "measured: ...", "published: ...", "assumption: ..."
    sources: dict[str, str] = field(default_factory=dict)

    def agent(self, name: str) -> AgentCost:
        try:
            return self.agents[name]
        except KeyError:
            raise KeyError(f"cost model has no agent {name!r}; agents: {sorted(self.agents)}") from None

    # -- op costs --------------------------------------------------------------------------

    def rollout_s(self, agent: str, prompts: np.ndarray, lengths: np.ndarray) -> tuple[float, float]:
        """(seconds the op holds its worker, mean busy share of the worker's replicas): the op
        ends with its slowest replica; the others idle meanwhile."""
        a = self.agent(agent)
        r = max(min(a.replicas, len(lengths)), 1)
        per = [_replica_s(prompts[i::r], lengths[i::r], a) for i in range(r)]
        held = max(per) + self.store_s
        return held, (sum(per) + r * self.store_s) / (a.replicas * held) if held > 0 else 1.0

    def replica_shares(self, agent: str, prompts: np.ndarray, lengths: np.ndarray, replicas: int) -> list[float]:
        """Decode seconds of each of `replicas` shares of a micro-batch (its sequences dealt
        round-robin), longest first."""
        a = self.agent(agent)
        r = max(min(replicas, len(lengths)), 1)
        return sorted((_replica_s(prompts[i::r], lengths[i::r], a) for i in range(r)), reverse=True)

    def train_s(self, agent: str, prompt_tokens: float, response_tokens: float) -> float:
        a = self.agent(agent)
        return a.train_fixed_s + a.train_token_s * (response_tokens + a.train_prompt_weight * prompt_tokens) + self.store_s

    def step_s(self, agent: str) -> tuple[float, float]:
        """(optimizer step seconds, checkpoint swap-out seconds)."""
        a = self.agent(agent)
        return a.step_s, a.state_bytes / (self.swap_gbps * 1e9)

    def sync_s(self, agent: str) -> float:
        a = self.agent(agent)
        return a.sync_s + a.weight_bytes / (self.sync_gbps * 1e9)

    def reward_s(self, samples: int) -> float:
        return self.reward_fixed_s + self.reward_sample_s * samples + self.store_s

    def swap_in_s(self, agent: str) -> float:
        return self.agent(agent).state_bytes / (self.swap_gbps * 1e9)

    def load_s(self, agent: str) -> float:
        return self.agent(agent).weight_bytes / (self.load_gbps * 1e9)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for a in d["agents"].values():
            a["lengths"] = dict(a["lengths"])
        return d


def _replica_s(prompts: np.ndarray, lengths: np.ndarray, a: AgentCost) -> float:
    prefill = a.prefill_token_s * float(prompts.sum())
    if a.batching == "static":
        steps = int(lengths.max(initial=0))
        n = len(lengths)
        ctx = float(prompts.sum()) * steps + n * steps * (steps - 1) / 2
        return prefill + steps * (max(a.step_mem_s, n * a.step_seq_s) + a.step_over_s) + a.kv_token_s * ctx
    return prefill + continuous_decode_s(prompts, lengths, a)


def continuous_decode_s(prompts: np.ndarray, lengths: np.ndarray, a: AgentCost) -> float:
    """Decode time of one micro-batch under continuous batching: sequences run `max_concurrency`
    at a time, a finished one frees its place for the next; between two finishes the active
    count is constant and each sequence's context grows by one token per step."""
    n = len(lengths)
    if n == 0:
        return 0.0
    if n <= a.max_concurrency:
        order = np.argsort(lengths, kind="stable")
        L = lengths[order].astype(np.float64)
        P = prompts[order].astype(np.float64)
        starts = np.concatenate(([0.0], L[:-1]))
        d = L - starts  # steps of segment k, during which sequences k..n-1 are active
        active = n - np.arange(n, dtype=np.float64)
        p_active = np.cumsum(P[::-1])[::-1]
        step = np.maximum(a.step_mem_s, active * a.step_seq_s) + a.step_over_s
        ctx = p_active * d + active * (starts + L - 1) * d / 2
        return float((d * step).sum() + a.kv_token_s * ctx.sum())
    return _queued_decode_s(prompts, lengths, a)


def _queued_decode_s(prompts: np.ndarray, lengths: np.ndarray, a: AgentCost) -> float:
    """More sequences than places: an event loop over finishes (O(n log n))."""
    c = max(int(a.max_concurrency), 1)
    todo = list(range(len(lengths)))
    step_now, t = 0, 0.0
    active: list[tuple[int, int]] = []  # (finish step, seq)
    ctx_at: dict[int, float] = {}  # context of each active sequence at `step_now`
    while todo or active:
        while todo and len(active) < c:
            i = todo.pop(0)
            heapq.heappush(active, (step_now + int(lengths[i]), i))
            ctx_at[i] = float(prompts[i])
        end, _ = active[0]
        d = end - step_now
        n = len(active)
        ctx_sum = sum(ctx_at.values())
        t += d * (max(a.step_mem_s, n * a.step_seq_s) + a.step_over_s)
        t += a.kv_token_s * (ctx_sum * d + n * d * (d - 1) / 2)
        for i in ctx_at:
            ctx_at[i] += d
        step_now = end
        while active and active[0][0] == step_now:
            _, i = heapq.heappop(active)
            del ctx_at[i]
    return t
