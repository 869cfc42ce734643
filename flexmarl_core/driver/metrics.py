"""Per-iteration metrics from the orchestrator's op records, written as JSONL and TensorBoard.

Iterations overlap under the async pipeline, so an iteration's window is from the end of the
previous iteration's last op to the end of its own last op; busy time of every worker is the
overlap of its ops (whatever iteration they belong to) with that window.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from flexmarl_core.control import Decision, GradientHelper, MoveInstance, TrainSlot
from flexmarl_core.ops import Op, OpRecord, agent_key, traits


def _window_busy(records: Iterable[OpRecord], lo: float, hi: float) -> dict[str, float]:
    busy: dict[str, float] = defaultdict(float)
    for r in records:
        res = r.result
        for w, t0, t1 in res.busy or [(res.worker, res.t_start, res.t_end)]:
            busy[w] += max(0.0, min(t1, hi) - max(t0, lo))
    return dict(busy)


def metric_agents(per_it: list[dict[str, Any]], metric: str = "reward") -> list[str]:
    """Agents that have `agent/<name>/<metric>` in any iteration's row."""
    return sorted({k.split("/")[1] for m in per_it for k in m
                   if k.startswith("agent/") and k.endswith("/" + metric)})


#: per-op counts that an iteration sums (work skipped or wasted, stages/train.py and stages/rollout.py)
COUNTED = ("/program/policy_failed_calls", "/train/skipped_samples", "/train/skipped_tokens", "/rollout/decode_slots",
           "/rollout/wasted_decode_slots", "/rollout/decodes", "/rollout/mixed_rows", "/rollout/resumed_rows",
           "/rollout/resumed_tokens")


def _train_stats(ops: list[OpRecord]) -> dict[str, float]:
    """Per agent: token-weighted means of the train ops' per-token figures, the last step's
    gradient norm, and the mean reward over the iteration's micro-batches."""
    out: dict[str, float] = {}
    sums: dict[str, float] = defaultdict(float)
    weights: dict[str, float] = defaultdict(float)
    rewards: dict[str, list[float]] = defaultdict(list)
    for r in ops:
        res = r.result
        counts = {k: v for k, v in res.metrics.items() if k.endswith(COUNTED)}
        for k, v in counts.items():
            out[k] = out.get(k, 0.0) + v
        kind = traits(r.op.kind)
        if kind.trains and not res.skipped:
            for k, v in res.metrics.items():
                if k not in counts:
                    sums[k] += v * res.tokens
                    weights[k] += res.tokens
        elif kind.steps:
            out.update({k: v for k, v in res.metrics.items() if k.endswith(("/train/grad_norm", "/explained_var"))})
        elif kind.scores:
            for a, v in res.per_agent("reward").items():
                rewards[a].append(v)
    out.update({k: sums[k] / weights[k] for k in sums if weights[k] > 0})
    out.update({agent_key(a, "reward"): sum(v) / len(v) for a, v in rewards.items()})
    return dict(sorted(out.items()))


#: an environment team's per-op counts (`stages/episode.py`); its other `team/env/` figures are
#: per-episode means, weighted by the op's episodes
ENV_COUNTED = ("team/env/episodes", "team/env/invalid", "team/env/forfeits", "team/env/truncated")


def _env_stats(ops: list[OpRecord]) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    weights: dict[str, float] = defaultdict(float)
    for r in ops:
        n = r.result.metrics.get("team/env/episodes", 0.0)
        for k, v in r.result.metrics.items():
            if k.startswith("team/env/"):
                sums[k] += v if k in ENV_COUNTED else v * n
                weights[k] += n
    return {k: v if k in ENV_COUNTED else v / weights[k] for k, v in sums.items() if k in ENV_COUNTED or weights[k]}


def iteration_metrics(records: list[OpRecord], decisions: list[Decision], it: int,
                      prev_end: float, n_workers: int = 0, *, ops: list[OpRecord] | None = None,
                      workers: Iterable[str] | None = None,
                      gaps: Iterable[tuple[float, float]] = ()) -> dict[str, Any]:
    """Iteration `it`'s figures. Its window runs from `prev_end` (the end of the previous
    iteration's last op, or the run's first op) to the end of its own last op, less the `gaps`
    in it (a resumed run's downtime, `downtime_s`: no op ran then, and it is no iteration's
    time); busy time of every worker is the overlap of its ops, whatever iteration they belong
    to, with it.
    Utilisation divides by `n_workers`, or the workers seen in `records` if that is more.
    `ops` (iteration `it`'s records) and `workers` (every worker seen) spare a caller that
    keeps them a scan of every record: `records` need then hold only those that may overlap
    the window."""
    workers = sorted(workers if workers is not None else {r.result.worker for r in records})
    ops = ops if ops is not None else [r for r in records if r.op.iteration == it]
    end = max(r.result.t_end for r in ops)
    down = sum(max(0.0, min(g1, end) - max(g0, prev_end)) for g0, g1 in gaps)
    window = max(end - prev_end - down, 1e-9)
    busy = _window_busy(records, prev_end, end)
    stage_s: dict[str, float] = defaultdict(float)
    for r in ops:
        stage_s[r.op.kind] += r.result.seconds
    tokens = sum(r.result.tokens for r in ops if traits(r.op.kind).generates)
    # a retried op committed by an older version may not carry the figure; a fresh one always does
    acc = [r.result.metrics["team/accuracy"] for r in ops if traits(r.op.kind).scores
           and not (r.result.skipped and "team/accuracy" not in r.result.metrics)]
    m: dict[str, Any] = {
        "iteration": it,
        "e2e_s": window,
        "tokens": tokens,
        "tokens_per_s": tokens / window,
        "utilization": sum(busy.values()) / (window * max(len(workers), n_workers, 1)),
        "accuracy": sum(acc) / max(len(acc), 1),
        "cpu_s": sum(r.result.cpu_s for r in ops),
        "ops": len(ops),
    }
    if down > 0:
        m["downtime_s"] = down
    # Swap traffic of on-demand training allocation (checkpoint out after each step, state
    # in where a slot took an agent whose state was elsewhere).
    for key in ("swap_in_s", "swap_in_bytes", "swap_out_s", "swap_out_bytes"):
        m[key] = sum(r.result.swap.get(key, 0.0) for r in ops)
    m["balance_moves"] = sum(1 for d in decisions if isinstance(d, MoveInstance) and prev_end < d.t <= end)
    m["train_swaps"] = sum(1 for d in decisions if isinstance(d, TrainSlot) and d.iteration == it and d.swap)
    m["gradient_helpers"] = sum(1 for d in decisions if isinstance(d, GradientHelper) and d.iteration == it)
    # trajectories that train nobody: a program that raised, a reward past its deadline
    m["failed_trajectories"] = sum(r.result.metrics.get("team/program/failed", 0.0)
                                   + r.result.metrics.get("team/reward/failed", 0.0) for r in ops)
    # trajectories the policy broke: trained with the failure reward, counted by exception type
    for r in ops:
        for k, v in r.result.metrics.items():
            if k.startswith("team/program/policy_failed"):
                m[k] = m.get(k, 0.0) + v
    m.update(_env_stats(ops))
    m.update({f"stage_s/{k}": v for k, v in sorted(stage_s.items())})
    m.update({f"busy_s/{w}": busy.get(w, 0.0) for w in workers})
    m.update(_train_stats(ops))
    return m


class IterationTracker:
    """Emits each iteration's metrics as soon as they are final: the iteration's ops are all
    done and so is every op that was submitted before its last one ended (only those can
    overlap its window). Feeds `emit` in iteration order, while the run goes on.

    `n_workers()`: how many workers the run has now; utilisation divides by it (a worker with
    no finished op yet is idle, not absent)."""

    def __init__(self, sizes: dict[int, int], emit: Callable[[dict[str, Any]], None],
                 n_workers: Callable[[], int] = lambda: 0) -> None:
        self.left = dict(sizes)
        self.emit = emit
        self.n_workers = n_workers
        #: when the first op recorded started (the first window's start)
        self._first_start: float | None = None
        self.decisions: list[Decision] = []
        self.rows: list[dict[str, Any]] = []
        self._next = min(sizes, default=0)
        self._prev_end: float | None = None
        self._by_it: dict[int, list[OpRecord]] = defaultdict(list)
        #: records that may still overlap a window (the others ended before the last one
        #: emitted ended): scanning every record per iteration made metrics O(ops^2)
        self._live: list[OpRecord] = []
        self._workers: set[str] = set()
        #: when the run was down between attempts: left out of the windows that span it
        self.gaps: list[tuple[float, float]] = []

    def resume(self, earlier: list[OpRecord], emitted: list[dict[str, Any]],
               resumed_at: float | None = None) -> None:
        """An interrupted attempt's records, and the rows it already wrote (not written again).
        Iterations it completed but did not report are emitted now: nothing of this attempt
        can overlap their windows, as nothing of it has started. `resumed_at`: when this
        attempt started; from the earlier attempt's last op to then, the run was down."""
        for rec in earlier:
            self._take(rec)
        if earlier and resumed_at is not None:
            self.gaps.append((max(r.result.t_end for r in earlier), resumed_at))
        for row in emitted:
            if row.get("iteration") != self._next or self.left.get(self._next) != 0:
                break
            self.rows.append(row)
            self._prev_end = max(r.result.t_end for r in self._by_it.pop(self._next))
            self._next += 1
        self.flush(None)

    def add(self, rec: OpRecord, in_flight_since: float | None, decisions: list[Decision]) -> None:
        """`in_flight_since`: the earliest submit time of the ops still running, if any."""
        self._take(rec)
        self.decisions = decisions
        self.flush(in_flight_since)

    def _take(self, rec: OpRecord) -> None:
        if self._first_start is None or rec.result.t_start < self._first_start:
            self._first_start = rec.result.t_start
        self._live.append(rec)
        self._workers.add(rec.result.worker)
        self._by_it[rec.op.iteration].append(rec)
        self.left[rec.op.iteration] -= 1

    def flush(self, in_flight_since: float | None = None, *, final: bool = False) -> None:
        while self._next in self.left and self.left[self._next] == 0:
            end = max(r.result.t_end for r in self._by_it[self._next])
            if not final and in_flight_since is not None and in_flight_since < end:
                return  # a running op may still overlap this iteration's window
            if self._prev_end is None:
                self._prev_end = self._first_start
            row = iteration_metrics(self._live, self.decisions, self._next, self._prev_end,
                                    n_workers=self.n_workers(), ops=self._by_it.pop(self._next),
                                    workers=self._workers, gaps=self.gaps)
            self.rows.append(row)
            self.emit(row)
            self._prev_end = end
            self._live = [r for r in self._live if r.result.t_end > end]
            self._next += 1


def critical_path(records: list[OpRecord], deps: dict[Any, list[Any]]) -> dict[str, Any]:
    """Where the run's time went on its critical path: from the op that finished last, walk
    back through the dependency that finished last. Seconds per stage kind on the path, and
    `wait_s`: time an op on the path was ready but not yet running (queued behind other work
    on its worker, or dispatch overhead)."""
    if not records:
        return {}
    by_op = {r.op: r for r in records}
    cur: OpRecord | None = max(records, key=lambda r: r.result.t_end)
    out: dict[str, Any] = defaultdict(float)
    ops = 0
    while cur is not None:
        ops += 1
        res = cur.result
        out[f"stage_s/{cur.op.kind}"] += res.seconds
        parents = [by_op[d] for d in deps.get(cur.op, []) if d in by_op]
        gate = max(parents, key=lambda r: r.result.t_end, default=None)
        ready_at = gate.result.t_end if gate else cur.submitted
        out["wait_s"] += max(res.t_start - ready_at, 0.0)
        cur = gate
    out["ops"] = ops
    return dict(out)


class CriticalPath:
    """`critical_path` kept as the run goes, in memory bounded by the plan's window: each op's
    path (the gate it waited for last, and that one's path) is folded into a summary when it is
    recorded, and the summaries of iterations no op still to come can wait for are dropped.
    `deps(op)`: the op's dependencies; `sizes`: ops per iteration; `reach`: how many
    iterations back a dependency goes (`Plan.reach`)."""

    def __init__(self, deps: Callable[[Op], list[Op]], sizes: dict[int, int], reach: int) -> None:
        self.deps, self.left, self.reach = deps, dict(sizes), reach
        #: op -> (its end, its path's summary)
        self._paths: dict[Op, tuple[float, dict[str, float]]] = {}
        self._last: tuple[float, dict[str, float]] | None = None
        self._open = min(sizes, default=0)  # the lowest iteration with an op not recorded

    def add(self, rec: OpRecord) -> None:
        """`rec`, after every record of its dependencies (the op log's order)."""
        res = rec.result
        parents = [self._paths[d] for d in self.deps(rec.op) if d in self._paths]
        gate = max(parents, key=lambda p: p[0], default=None)
        path = dict(gate[1]) if gate else {"ops": 0}
        key = f"stage_s/{rec.op.kind}"
        path[key] = path.get(key, 0.0) + res.seconds
        path["wait_s"] = path.get("wait_s", 0.0) + max(res.t_start - (gate[0] if gate else rec.submitted), 0.0)
        path["ops"] += 1
        self._paths[rec.op] = (res.t_end, path)
        if self._last is None or res.t_end > self._last[0]:
            self._last = (res.t_end, path)
        it = rec.op.iteration
        if it in self.left:
            self.left[it] -= 1
        while self.left.get(self._open) == 0:
            del self.left[self._open]
            self._open += 1
            keep = self._open - self.reach  # what an op still to come can wait for
            self._paths = {op: p for op, p in self._paths.items() if op.iteration >= keep}

    def summary(self) -> dict[str, Any]:
        """Seconds per stage kind on the path, `wait_s` and `ops` (as `critical_path`)."""
        if self._last is None:
            return {}
        out = dict(self._last[1])
        out["ops"] = out.pop("ops")  # last, as `critical_path` has it
        return out


def run_summary(per_it: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Whole-run figures: mean E2E per iteration, tokens/s and utilisation over the run."""
    if not per_it:
        return {"iterations": 0, "wall_s": wall_s}
    span = sum(m["e2e_s"] for m in per_it)
    return {
        "iterations": len(per_it),
        "wall_s": wall_s,
        "e2e_s_per_iteration": span / len(per_it),
        "tokens_per_s": sum(m["tokens"] for m in per_it) / span,
        "utilization": sum(m["utilization"] * m["e2e_s"] for m in per_it) / span,
        "final_accuracy": per_it[-1]["accuracy"],
        "final_reward": {a: per_it[-1][agent_key(a, "reward")] for a in metric_agents(per_it[-1:])},
    }


#: a run log's part on object storage is rewritten while it grows, up to this size, then the
#: next part starts: an upload costs at most this much, at any run length
PART_BYTES = 64 << 10
_PART = re.compile(r"\d{6}\.jsonl")


def log_parts(loc: Any, name: str) -> list[str]:
    """The keys of the parts of run log `name` (`ops.jsonl`) at `loc`, in order."""
    stem = name.removesuffix(".jsonl")
    return [f"metrics/{stem}/{p}" for p in loc.list(f"metrics/{stem}") if _PART.fullmatch(p)]


def log_lines(loc: Any, name: str) -> list[str]:
    """The lines of run log `name` (`ops.jsonl`, `iterations.jsonl`, `decisions.jsonl`) at the
    run's location `loc`: its whole file (a local run's), then its parts (a run on object
    storage, `MetricsWriter`)."""
    lines: list[str] = []
    for key in [f"metrics/{name}", *log_parts(loc, name)]:
        try:
            lines += loc.read_text(key).splitlines()
        except FileNotFoundError:
            continue
    return lines


def rewrite_log(loc: Any, name: str, lines: list[str]) -> None:
    """Replace run log `name` at `loc` by `lines` (`flexmarl store repair`): in its one file, or
    in its first part with the later parts deleted first (a crash between loses a tail of the
    log, whose ops a resume runs again, never duplicates a line)."""
    text = "".join(f"{x}\n" for x in lines)
    parts = log_parts(loc, name)
    if not parts:
        loc.write_text(f"metrics/{name}", text)
        return
    for key in [f"metrics/{name}", *parts[1:]]:
        loc.delete(key)
    loc.write_text(parts[0], text)


class MetricsWriter:
    """Appends op records, iteration metrics and decisions under `run_dir/metrics/`, and writes
    each iteration's scalars to TensorBoard as it is emitted (live: open `tensorboard --logdir
    RUN/metrics/tensorboard` while the run goes on).

    `mirror`: the run's remote location (`location.RunLocation`). `run_dir` is then the flow
    process's scratch folder: the JSONL files start as the location's copies (a resume goes on
    from them), and what each gains goes up as it grows (the op log at most every
    `MIRROR_EVERY_S`, which only makes a resume rerun an op or two: stages are idempotent) and
    when the writer closes. An object store has no append, so each log is a series of parts
    (`metrics/ops/000000.jsonl`, ...): the newest part is uploaded again as it grows, up to
    `PART_BYTES`, and then left alone. An upload's bytes are bounded, whatever the run's length.
    """

    MIRROR_EVERY_S = 2.0
    FILES = ("ops.jsonl", "iterations.jsonl", "decisions.jsonl")

    def __init__(self, run_dir: Path, mirror: Any = None) -> None:
        self.dir = Path(run_dir) / "metrics"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.mirror = mirror
        #: per log: the part being written (index) and where it starts in the local file
        self._part: dict[str, tuple[int, int]] = {}
        #: bytes uploaded to the mirror by this writer, per log
        self.uploaded_bytes: dict[str, int] = dict.fromkeys(self.FILES, 0)
        for name in self.FILES:
            if mirror is not None:
                (self.dir / name).write_text("".join(f"{x}\n" for x in log_lines(mirror, name)))
            _cut_torn_line(self.dir / name)
            if mirror is not None:  # a resumed writer goes on in a part of its own
                parts = log_parts(mirror, name)
                after = int(parts[-1].rsplit("/", 1)[1][:6]) + 1 if parts else 0
                self._part[name] = (after, (self.dir / name).stat().st_size)
        self._ops = open(self.dir / "ops.jsonl", "a")  # noqa: SIM115 - closed in close()
        self._tb: Any = None
        self._mirrored = 0.0
        self._written = 0  # op records written by this writer
        self._synced = 0  # of them, fsynced (local)
        self._uploaded = 0  # of them, in the mirror's copy

    def durable(self) -> int:
        """How many of this writer's op records a resume would read (local: those on disk, synced
        here; mirrored: those uploaded). Retention deletes nothing an op not yet durable may need."""
        if self.mirror is not None:
            return self._uploaded
        if self._synced < self._written:
            with _naming(self.dir / "ops.jsonl"):
                os.fsync(self._ops.fileno())
            self._synced = self._written
        return self._synced

    def _upload(self, name: str) -> None:
        """The current part of log `name`: what it gained since the part began."""
        if self.mirror is None:
            return
        index, start = self._part[name]
        with open(self.dir / name, "rb") as f:
            f.seek(start)
            data = f.read()
        if not data:
            return
        stem = name.removesuffix(".jsonl")
        self.mirror.write_bytes(f"metrics/{stem}/{index:06d}.jsonl", data)
        self.uploaded_bytes[name] += len(data)
        if len(data) >= PART_BYTES:
            self._part[name] = (index + 1, start + len(data))

    def op(self, rec: OpRecord) -> None:
        row = {**rec.result.to_row(), "submitted": rec.submitted, "finished": rec.finished}
        with _naming(self.dir / "ops.jsonl"):
            self._ops.write(json.dumps(row, default=str) + "\n")
            self._ops.flush()
        self._written += 1
        if self.mirror is not None and time.monotonic() - self._mirrored >= self.MIRROR_EVERY_S:
            self._upload("ops.jsonl")
            self._mirrored, self._uploaded = time.monotonic(), self._written

    def decisions(self, decisions: list[Decision]) -> None:
        """Every control-plane decision (instance moves, training slots) as JSONL."""
        _append(self.dir / "decisions.jsonl", "".join(json.dumps(d.as_row(), default=str) + "\n" for d in decisions))
        self._upload("decisions.jsonl")

    def iteration(self, m: dict[str, Any]) -> None:
        _append(self.dir / "iterations.jsonl", json.dumps(m) + "\n")
        self._upload("iterations.jsonl")
        if self._tb is None:
            self._tb = _tensorboard(self.dir / "tensorboard")
        if self._tb is False:
            return
        with _naming(self.dir / "tensorboard"):  # its writer thread's error surfaces here
            for k, v in m.items():
                if k != "iteration" and isinstance(v, int | float):
                    self._tb.add_scalar(k, v, m["iteration"])

    def close(self) -> None:
        with _naming(self.dir / "ops.jsonl"):
            self._ops.close()
        self._upload("ops.jsonl")
        self._uploaded = self._written
        if self._tb:
            with _naming(self.dir / "tensorboard"):
                self._tb.close()


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """A failed write names its file (a full disk's OSError from write() carries no filename,
    and the operator's one-line failure must say where)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise


def _append(path: Path, text: str) -> None:
    with _naming(path), open(path, "a") as f:
        f.write(text)


def _cut_torn_line(path: Path) -> None:
    """Drop a last line an earlier attempt died writing (a full disk, a kill): appended to, it
    would swallow the next line too."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            keep = size
            while keep > 0:  # back to the last newline, in blocks
                start = max(0, keep - 65536)
                f.seek(start)
                block = f.read(keep - start)
                nl = block.rfind(b"\n")
                if nl >= 0:
                    keep = start + nl + 1
                    break
                keep = start
            f.truncate(keep)
    except FileNotFoundError:
        return


def _tensorboard(folder: Path) -> Any:
    """A TensorBoard writer, or False when TensorBoard cannot be imported: the run's metrics are
    all in the JSONL files, so a broken TensorBoard install (a package installed after flexmarl
    that downgraded protobuf below what tensorboard was built with) costs the scalars only."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception as exc:  # protobuf's VersionError, an ImportError: the same remedy
        print(f"warning: no TensorBoard scalars this run ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); "
              "the metrics are in metrics/*.jsonl. A package installed after flexmarl likely changed protobuf: "
              "install it together with flexmarl (pip resolves a tensorboard that agrees) or run "
              "`pip install 'tensorboard<2.21'` (docs/programs.md, 'Frameworks tried')", flush=True)
        return False
    # Its writer thread flushes every 2 s (and on close): a flush per iteration cost a file
    # write per iteration on the flow's main thread for fine-grained runs.
    return SummaryWriter(str(folder), flush_secs=2)
