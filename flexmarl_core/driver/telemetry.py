"""Where a training step goes: the figures an iteration's row gets beside its op sums, and the
run summary's medians of them (docs/training.md, "Where a step goes").

Each figure is measured where it happens: a step's and a sync's seconds are their ops' own
(timed in the worker), forward+backward and the engine's prefill and decode seconds are timed
inside the train and rollout ops, and the pipeline's figures come from the ops' start and end
times: how long each agent's trainer sat free while the data of its next micro-batch was still
being made (`Pipeline`), and how many iterations of rollouts had started when an iteration's
training began.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from flexmarl_core.ops import Op, OpRecord, agent_key, traits

__all__ = ["AGENT_FIGURES", "PIPELINE_FIGURES", "Pipeline", "op_seconds", "queue_bound", "shares",
           "step_lines", "where_a_step_goes"]

#: shares an iteration derives from per-op counts it sums: (share, part, whole), per agent
SHARES = (("train/padding_share", "train/tokens_padded", "train/tokens_cells"),
          ("train/shared_share", "train/tokens_shared", "train/tokens_sample"),
          ("rollout/prefill_share", "rollout/prefill_s", "rollout/generate_s"))
#: per-agent figures of the summary's block, in the order its lines give them
AGENT_FIGURES = ("train/fwd_bwd_s", "train/step_s", "sync/weight_sync_s", "train/rollout_wait_s",
                 "train/padding_share", "train/shared_share", "rollout/prefill_share", "staleness")
#: the iteration's own figures of the block
PIPELINE_FIGURES = ("pipeline/rollout_wait_s", "pipeline/queue_depth", "pipeline/queue_bound")


def shares(sums: dict[str, float]) -> dict[str, float]:
    """Per agent, each of `SHARES` whose whole is in `sums` and positive."""
    out = {}
    for share, part, whole in SHARES:
        for k, v in sums.items():
            if k.startswith("agent/") and k.endswith("/" + whole) and v > 0:
                prefix = k[: -len(whole)]
                out[prefix + share] = sums.get(prefix + part, 0.0) / v
    return out


def op_seconds(ops: Iterable[OpRecord]) -> dict[str, float]:
    """Per agent, the seconds of its step op (`train/step_s`: the optimizer step, with any
    micro-batch it recomputed and the checkpoint when one is due) and of its sync op
    (`sync/weight_sync_s`: handing the new weights to its engines), as their workers timed them."""
    out: dict[str, float] = defaultdict(float)
    for r in ops:
        kind = traits(r.op.kind)
        if r.op.agent and kind.steps:
            out[agent_key(r.op.agent, "train/step_s")] += r.result.seconds
        elif r.op.agent and kind.publishes:
            out[agent_key(r.op.agent, "sync/weight_sync_s")] += r.result.seconds
    return dict(out)


def queue_bound(async_pipeline: bool, max_staleness: int) -> int | None:
    """How many iterations rollouts may run ahead of training (`max_staleness`), where the
    pipeline lets them start before the previous iteration's training ends; None: it never does
    (no queue to report)."""
    return max_staleness if async_pipeline or max_staleness else None


def _idle(t0: float, t1: float, gaps: Iterable[tuple[float, float]]) -> float:
    """Seconds from `t0` to `t1` less the run's downtime in them."""
    down = sum(max(0.0, min(g1, t1) - max(g0, t0)) for g0, g1 in gaps)
    return max(0.0, t1 - t0 - down)


def _data(kind: str) -> bool:
    """Ops that make the data training reads: rollouts (any decoding op) and rewards."""
    k = traits(kind)
    return k.generates or k.scores


class Pipeline:
    """The figures one iteration's records cannot give alone, kept op by op (`take`) and handed
    out once per iteration (`figures`, when the iteration's row is made):

    - `rollout_wait_s` (with `deps`, the plan's `deps_of`): per agent, for each of its train
      ops, the time its trainer was free (its last trainer op had ended) while the rollouts and
      rewards that op waits for in the plan were still running; summed per agent
      (`agent/<a>/train/rollout_wait_s`) and over agents (`pipeline/rollout_wait_s`).
    - `queue_depth` (with a `bound`, `queue_bound`): how many later iterations had a rollout
      started when the iteration's first train op started, beside the bound.

    What is kept is bounded by the iterations not yet emitted."""

    def __init__(self, deps: Callable[[Op], list[Op]] | None = None, bound: int | None = None) -> None:
        self.deps, self.bound = deps, bound
        #: agent -> (start, end, iteration it stepped or None) of its ops on its trainer
        self._trainer: dict[str, list[tuple[float, float, int | None]]] = defaultdict(list)
        #: iteration -> its train ops that ran on their agent's trainer
        self._trains: dict[int, list[OpRecord]] = defaultdict(list)
        #: the ends of the data ops (rollouts, rewards) of iterations not yet emitted
        self._data_end: dict[Op, float] = {}
        #: iteration -> when its first decoding op started
        self._gen_start: dict[int, float] = {}

    def take(self, rec: OpRecord) -> None:
        op, res, kind = rec.op, rec.result, traits(rec.op.kind)
        if self.deps is not None and _data(op.kind):
            self._data_end[op] = res.t_end
        if kind.generates:
            self._gen_start[op.iteration] = min(self._gen_start.get(op.iteration, res.t_start), res.t_start)
        # a gradient helper's train op ran away from the agent's trainer (`train_gradient`)
        if kind.placement == "trainer" and op.agent and agent_key(op.agent, "train/helper_bytes") not in res.metrics:
            self._trainer[op.agent].append((res.t_start, res.t_end, op.iteration if kind.steps else None))
            if kind.trains:
                self._trains[op.iteration].append(rec)

    def figures(self, it: int, run_start: float, gaps: Iterable[tuple[float, float]] = ()) -> dict[str, float]:
        """Iteration `it`'s figures, once every op that started before its end is taken (the
        tracker emits it only then); `run_start`: when the run's first op started (a trainer
        with no op before is free from then); `gaps`: downtime left out."""
        trains = self._trains.get(it, [])
        out: dict[str, float] = {}
        if trains and self.deps is not None:
            gaps = list(gaps)
            waits: dict[str, float] = defaultdict(float)
            for r in trains:
                a, t = r.op.agent, r.result.t_start
                ends = [self._data_end[d] for d in self.deps(r.op) if d in self._data_end]
                if not ends:  # a critic's train op waits for values, not for rollouts
                    continue
                free = max((e for _, e, _ in self._trainer[a] if e <= t), default=run_start)
                waits[a] += _idle(free, min(max(ends), t), gaps)
            out.update({agent_key(a, "train/rollout_wait_s"): w for a, w in sorted(waits.items())})
            if waits:
                out["pipeline/rollout_wait_s"] = sum(waits.values())
        if trains and self.bound is not None:
            began = min(r.result.t_start for r in trains)
            out["pipeline/queue_depth"] = float(max((j - it for j, t in self._gen_start.items()
                                                     if j > it and t <= began), default=0))
            out["pipeline/queue_bound"] = float(self.bound)
        self.forget(it)
        return out

    def forget(self, it: int) -> None:
        """Drop what only iterations up to `it` need: a later train op starts after its agent's
        step of `it` ended, so no trainer op that ended before that step can be its last one."""
        self._trains = defaultdict(list, {j: v for j, v in self._trains.items() if j > it})
        self._data_end = {op: e for op, e in self._data_end.items() if op.iteration > it}
        self._gen_start = {j: t for j, t in self._gen_start.items() if j > it}
        for a, spans in self._trainer.items():
            cut = max((e for _, e, stepped in spans if stepped is not None and stepped <= it), default=None)
            if cut is not None:
                self._trainer[a] = [s for s in spans if s[1] >= cut]


def where_a_step_goes(per_it: list[dict[str, Any]]) -> dict[str, float]:
    """The summary's block: the median over iterations of each of `AGENT_FIGURES` (per agent)
    and `PIPELINE_FIGURES`, under its iteration key; a figure no iteration has is left out."""
    keys = dict.fromkeys(k for m in per_it for k in m
                         if k in PIPELINE_FIGURES or (k.startswith("agent/") and k.split("/", 2)[2] in AGENT_FIGURES))
    return {k: float(statistics.median([m[k] for m in per_it if k in m])) for k in sorted(keys)}


def step_lines(block: dict[str, float]) -> list[str]:
    """The summary's "where a step goes" lines: one per agent, one for the pipeline."""
    if not block:
        return []
    lines = ["where a step goes (medians over iterations):"]
    fmt = {"train/fwd_bwd_s": "fwd+bwd {:.3f} s", "train/step_s": "step {:.3f} s",
           "sync/weight_sync_s": "weight sync {:.3f} s", "train/rollout_wait_s": "waited {:.2f} s for rollouts",
           "train/padding_share": "padding {:.0%}",
           "train/shared_share": "{:.0%} of tokens shared", "rollout/prefill_share": "prefill {:.0%} of decoding",
           "staleness": "staleness {:.2f}"}
    agents = dict.fromkeys(k.split("/")[1] for k in block if k.startswith("agent/"))
    for a in agents:
        parts = [fmt[f].format(block[agent_key(a, f)]) for f in AGENT_FIGURES if agent_key(a, f) in block]
        lines.append(f"  {a}: " + ", ".join(parts))
    pipe = []
    if "pipeline/rollout_wait_s" in block:
        pipe.append(f"trainers waited {block['pipeline/rollout_wait_s']:.2f} s per iteration for rollouts")
    if "pipeline/queue_depth" in block:
        pipe.append(f"rollouts {block['pipeline/queue_depth']:g} iteration(s) ahead of training "
                    f"(bound {block.get('pipeline/queue_bound', 0):g})")
    if pipe:
        lines.append("  pipeline: " + ", ".join(pipe))
    return lines
