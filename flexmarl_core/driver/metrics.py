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
from flexmarl_core.driver.critical_path import CriticalPath, critical_path
from flexmarl_core.driver.telemetry import Pipeline, op_seconds, shares, where_a_step_goes
from flexmarl_core.ops import OpRecord, agent_key, traits

__all__ = ["CriticalPath", "IterationTracker", "MetricsWriter", "critical_path", "iteration_metrics",
           "log_lines", "log_parts", "metric_agents", "rewrite_log", "run_summary"]


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


#: per-op counts and seconds that an iteration sums (stages/train.py, stages/rollout.py, driver/telemetry.py)
COUNTED = ("/program/policy_failed_calls", "/train/skipped_samples", "/train/skipped_tokens",
           "/train/tokens_padded", "/train/tokens_cells", "/train/tokens_shared",
           "/train/tokens_sample", "/rollout/decode_slots",
           "/rollout/wasted_decode_slots", "/rollout/decodes", "/rollout/mixed_rows", "/rollout/resumed_rows",
           "/rollout/resumed_tokens", "/train/fwd_bwd_s", "/rollout/prefill_s", "/rollout/generate_s")


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
    out.update(shares(out))  # what padding cost, prefill's part of decoding
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
    m.update({**_train_stats(ops), **op_seconds(ops)})
    return m


class IterationTracker:
    """Emits each iteration's metrics as soon as they are final: the iteration's ops are all
    done and so is every op that was submitted before its last one ended (only those can
    overlap its window). Feeds `emit` in iteration order, while the run goes on.

    `n_workers()`: how many workers the run has now; utilisation divides by it (a worker with
    no finished op yet is idle, not absent). `rebuilt(row)`: an iteration an earlier attempt
    reported, whose ops a repair rewound (its row says `rebuilt_ops`), has all of them done
    again; its row stands as first written and is not emitted again. `pipeline`: the figures
    that need more than an iteration's records (`telemetry.Pipeline`)."""

    def __init__(self, sizes: dict[int, int], emit: Callable[[dict[str, Any]], None],
                 n_workers: Callable[[], int] = lambda: 0,
                 rebuilt: Callable[[dict[str, Any]], None] = lambda row: None,
                 pipeline: Pipeline | None = None) -> None:
        self.pipeline = pipeline or Pipeline()
        self.left = dict(sizes)
        self.emit = emit
        self.rebuilt = rebuilt
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
        #: reported iterations whose rewound ops run again: their rows, until they are done
        self._kept: dict[int, dict[str, Any]] = {}
        #: the ends of the last iterations emitted (a window's start when one ends out of order)
        self._ends: list[float] = []
        #: the earlier attempts' share of the run's wall time (`resume`)
        self.earlier_s = 0.0

    def resume(self, earlier: list[OpRecord], emitted: list[dict[str, Any]],
               resumed_at: float | None = None) -> None:
        """An interrupted attempt's records, and the rows it already wrote (kept as they are,
        never written again; one whose iteration lacks ops, which a repair rewound, is
        `rebuilt` once they are done again). Iterations it completed but did not report are
        emitted now: nothing of this attempt can overlap their windows, as nothing of it has
        started. `resumed_at`: when this attempt started; from the earlier attempt's last op
        to then, the run was down."""
        for rec in earlier:
            self._take(rec)
        last = max((r.result.t_end for r in earlier), default=None)
        if last is not None and resumed_at is not None:
            self.gaps.append((last, resumed_at))
        for row in emitted:
            it = row.get("iteration")
            if it != self._next or it not in self.left:
                break
            self.rows.append(row)
            ops = self._by_it.pop(it, [])
            self.pipeline.forget(it)
            if self.left[it]:
                self._kept[it] = row
            if ops:
                self._prev_end = max(r.result.t_end for r in ops)
                self._ends.append(self._prev_end)
            self._next += 1
        self._ends = self._ends[-8:]
        # the earlier attempts' time: their iterations' windows (downtime left out), then
        # what ran after the last one they reported, up to their last op
        self.earlier_s = sum(float(r.get("e2e_s", 0.0)) for r in self.rows)
        if last is not None:
            self.earlier_s += max(0.0, last - (self._prev_end if self._prev_end is not None else
                                               min(r.result.t_start for r in earlier)))
        if self._prev_end is not None:
            self._prune(self._prev_end)
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
        self.pipeline.take(rec)
        self._workers.add(rec.result.worker)
        it = rec.op.iteration
        self.left[it] -= 1
        if it in self._kept:  # its row stands; only say when it is whole again
            if not self.left[it]:
                self.rebuilt(self._kept.pop(it))
            return
        self._by_it[it].append(rec)

    def _prune(self, upto: float) -> None:
        """Forget the records that ended by `upto`: no window still to come reaches back past
        it (each starts at or after the start of the last one emitted)."""
        self._live = [r for r in self._live if r.result.t_end > upto]

    def flush(self, in_flight_since: float | None = None, *, final: bool = False) -> None:
        while self._next in self.left and self.left[self._next] == 0:
            end = max(r.result.t_end for r in self._by_it[self._next])
            if not final and in_flight_since is not None and in_flight_since < end:
                return  # a running op may still overlap this iteration's window
            lo = self._first_start if self._prev_end is None else self._prev_end
            if lo is not None and end < lo:
                # it ended before the iteration before it, whose rewound ops ran again after a
                # resume: its window starts where the last one to end before it ended
                lo = max((e for e in self._ends if e <= end), default=self._first_start)
            row = iteration_metrics(self._live, self.decisions, self._next, lo,
                                    n_workers=self.n_workers(), ops=self._by_it.pop(self._next),
                                    workers=self._workers, gaps=self.gaps)
            row.update(self.pipeline.figures(self._next, self._first_start or 0.0, self.gaps))
            self.rows.append(row)
            self.emit(row)
            self._prev_end = end
            self._ends = [*self._ends[-7:], end]
            self._prune(min(lo, end))  # an iteration ended out of order may start its window at `lo`
            self._next += 1


def run_summary(per_it: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Whole-run figures: mean E2E per iteration, tokens/s and utilisation over the run, the
    trajectories that failed, where a step goes; `wall_s`: the run's time (every attempt's, downtime left out)."""
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
        # trajectories that trained nobody (a program raised, a reward ran past its deadline)
        "failed_trajectories": int(sum(m.get("failed_trajectories", 0) for m in per_it)),
        "where_a_step_goes": where_a_step_goes(per_it),
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
