"""Data-parallel DeepSpeed trainer for ONE agent: N rank processes, one `TrainBackend` in front.

    trainer = DataParallelDeepSpeedTrainer(model, name="solver", dp=2, loss_fn=..., loss_weight_fn=...)
    scale = global_loss_scale(micro_batches, trainer.loss_weight)
    for mb in micro_batches:
        trainer.accumulate(mb, scale)      # mb split by samples: rank r backprops its share
    trainer.step()                         # every rank: reduce (SUM over ranks), clip, AdamW

Layout: the object in the caller's process (a Dask worker) is the controller; every rank,
rank 0 included, is a helper process running a plain `DeepSpeedTrainer` in its own gloo world
(MASTER_ADDR 127.0.0.1, a free port). Rank 0 is a helper too, not the caller itself, because a
process has ONE default torch.distributed world: a worker that already holds a 1-process world
(another agent's DeepSpeed trainer, an in-process vLLM engine) cannot join a 2-process one, and
a 2-process default world would capture the other trainers' collectives.

Helpers are `python -m flexmarl_core.training.dp_trainer` subprocesses (Dask worker processes
are daemonic and may not start multiprocessing children), each talking to the controller over
its end of a private socketpair; messages are pickled with plain pickle (tensors travel as
bytes, no shared-memory handles to outlive).

Same math as the 1-process trainer: each rank's share is scaled by the GLOBAL `loss_scale`, and
DeepSpeed sums (not averages) the ranks' gradients (`gradient_allreduce_op: sum`, set in
`DeepSpeedTrainer`), so the gradient is the one of the whole batch. Every rank runs one backward
per micro-batch (ZeRO-2 reduces gradient partitions inside each backward, a collective): a rank
whose share is empty backprops zeros. Only the summation order differs from one process.

Failure: every reply is awaited with a deadline (`timeout_s`) while the helpers' liveness is
polled; a helper that dies, raises or hangs stops all helpers and raises `RuntimeError` naming
the agent, the rank, and the tail of the rank's log. The ranks' collectives time out too
(`init_distributed(timeout=...)`), and a helper exits when its controller's socket closes.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from flexmarl_core.training.api import LossFn, LossWeightFn, MicroBatch, StepResult

_POLL_S = 0.2  #: how often a waiting controller checks that its helpers are alive
_LOG_TAIL = 3000  #: characters of a failed rank's log quoted in the error


def _send(conn: Connection, obj: Any) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def split_shares(micro_batch: MicroBatch, n: int) -> list[list[Any]]:
    """`micro_batch` cut into `n` contiguous shares whose sizes differ by at most one (earlier
    ranks take the extra samples; a share may be empty when there are fewer samples than ranks)."""
    q, r = divmod(len(micro_batch), n)
    out, start = [], 0
    for i in range(n):
        end = start + q + (i < r)
        out.append(list(micro_batch[start:end]))
        start = end
    return out


class DataParallelDeepSpeedTrainer:
    """`TrainBackend` on `dp` DeepSpeed ZeRO-1/2 rank processes training one agent's model."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        name: str,
        dp: int,
        loss_fn: LossFn,
        loss_weight_fn: LossWeightFn,
        ref_model: PreTrainedModel | None = None,
        zero_stage: int = 2,
        cache_dir: str | os.PathLike[str] | None = None,
        timeout_s: float = 600.0,
        start_timeout_s: float = 900.0,
        **trainer_kwargs: Any,
    ) -> None:
        """`trainer_kwargs` go to each rank's `DeepSpeedTrainer` (lr, max_grad_norm, bf16, ...).
        `start_timeout_s` covers the helpers' imports and, on a fresh machine, DeepSpeed's JIT
        compile of its ops (~1 min each here)."""
        if dp < 2:
            raise ValueError(f"agent {name!r}: dp={dp}; a data-parallel trainer needs >= 2 ranks "
                             "(backend.training_dp=1 builds the 1-process DeepSpeedTrainer)")
        if zero_stage not in (1, 2):
            raise ValueError(f"agent {name!r}: zero_stage={zero_stage}; data parallelism runs ZeRO 1 or 2")
        if torch.cuda.is_available() and torch.cuda.device_count() < dp:
            raise ValueError(f"agent {name!r}: backend.training_dp={dp} needs one GPU per rank, "
                             f"{torch.cuda.device_count()} visible")
        self.name, self.dp, self.zero_stage = name, dp, zero_stage
        self.loss_weight_fn = loss_weight_fn
        self.timeout_s = timeout_s
        self._cache_dir = cache_dir
        init = {
            "model": model, "ref_model": ref_model, "threads": torch.get_num_threads(),
            "timeout_s": timeout_s, "cache_dir": None if cache_dir is None else str(cache_dir),
            "kwargs": dict(trainer_kwargs, loss_fn=loss_fn, loss_weight_fn=loss_weight_fn,
                           zero_stage=zero_stage, cache_dir=cache_dir),
        }
        try:
            payload = pickle.dumps(init, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(
                f"agent {name!r}: backend.training_dp={dp} sends the model, loss_fn and "
                f"loss_weight_fn to helper processes, so they must pickle (module-level "
                f"functions or functools.partial, not closures/lambdas): {e}"
            ) from e
        self._version = 0
        self._pending = 0
        self._metrics: dict[str, float] = {}
        self._closed = False
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[Connection] = []
        self._logs: list[Path] = []
        # Helpers never outlive the controller, even if close() is never called.
        self._finalizer = weakref.finalize(self, _kill, self._procs, self._conns)
        self._start(payload, start_timeout_s)

    # -- process management -------------------------------------------------------------------
    def _start(self, payload: bytes, start_timeout_s: float) -> None:
        from flexmarl_core.training.deepspeed_trainer import free_port

        log_dir = Path(tempfile.mkdtemp(prefix=f"dp-{self.name}-", dir=_scratch(self._cache_dir)))
        port = free_port()
        for rank in range(self.dp):
            ours, theirs = socket.socketpair()
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(self.dp), LOCAL_RANK=str(rank), PYTHONUNBUFFERED="1")
            env["PYTHONPATH"] = os.pathsep.join(p for p in [*sys.path, env.get("PYTHONPATH", "")] if p)
            log = log_dir / f"rank{rank}.log"
            with open(log, "wb") as f:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "flexmarl_core.training.dp_trainer", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=f,
                    stderr=subprocess.STDOUT,
                )
            theirs.close()
            self._procs.append(proc)
            self._conns.append(Connection(ours.detach()))
            self._logs.append(log)
        for conn in self._conns:
            conn.send_bytes(payload)
        self._gather(range(self.dp), "start", start_timeout_s)

    def _fail(self, rank: int, what: str, op: str, *, silent: bool = False) -> None:
        """Stop every helper (peers of a failed rank may be stuck in a collective) and raise."""
        self._closed = True
        proc = self._procs[rank]
        if silent and proc.poll() is None:  # have it write its stack into its log first
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        _kill(self._procs, self._conns)
        try:
            tail = self._logs[rank].read_text(errors="replace")[-_LOG_TAIL:]
        except OSError:
            tail = "(no log)"
        raise RuntimeError(
            f"agent {self.name!r}: data-parallel DeepSpeed rank {rank} of {self.dp} {what} during "
            f"{op!r}; all {self.dp} helper processes are stopped and this trainer is closed "
            f"(rebuild it and load_state to continue). Log {self._logs[rank]}:\n{tail}"
        )

    def _gather(self, ranks: Sequence[int] | range, op: str, timeout_s: float | None = None) -> list[Any]:
        """The replies of `ranks`, in order, failing fast on a dead, raising or silent helper."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        out: list[Any] = []
        for rank in ranks:
            conn = self._conns[rank]
            while not conn.poll(_POLL_S):
                for r, proc in enumerate(self._procs):
                    if proc.poll() is not None:
                        self._fail(r, f"exited with code {proc.returncode}", op)
                if time.monotonic() > deadline:
                    self._fail(rank, f"sent no reply within {timeout_s or self.timeout_s:.0f} s", op,
                               silent=True)
            try:
                status, value = _recv(conn)
            except (EOFError, OSError):
                try:
                    self._procs[rank].wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
                self._fail(rank, f"closed its connection (exit code {self._procs[rank].poll()})", op)
            if status == "error":
                # A peer that died makes this rank's collective fail: name the root cause.
                time.sleep(0.5)
                for r, proc in enumerate(self._procs):
                    if proc.poll() is not None:
                        last = value.strip().splitlines()[-1]
                        self._fail(r, f"exited with code {proc.returncode} (rank {rank} then "
                                   f"raised: {last})", op)
                self._fail(rank, f"raised:\n{value}", op)
            out.append(value)
        return out

    def _call(self, op: str, args_per_rank: Mapping[int, tuple[Any, ...]]) -> list[Any]:
        """Run `op` on the given ranks concurrently; their results in rank order."""
        if self._closed:
            raise RuntimeError(f"agent {self.name!r}: data-parallel trainer is closed")
        for rank, args in args_per_rank.items():
            try:
                _send(self._conns[rank], (op, args))
            except OSError:
                self._fail(rank, "is unreachable", op)
        return self._gather(sorted(args_per_rank), op)

    def _all(self, op: str, *args: Any) -> list[Any]:
        return self._call(op, dict.fromkeys(range(self.dp), args))

    # -- TrainBackend -------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def loss_weight(self, micro_batch: MicroBatch) -> float:
        return float(self.loss_weight_fn(micro_batch))

    def accumulate(self, micro_batch: MicroBatch, loss_scale: float) -> dict[str, float]:
        # Every rank takes part, even with an empty share: ZeRO-2 reduces gradient partitions in
        # each backward, a collective all ranks must enter.
        shares = split_shares(micro_batch, self.dp)
        outs = self._call("accumulate", {r: (s, loss_scale) for r, s in enumerate(shares)})
        # Losses and metrics are sums over samples (scaled): the ranks' parts add up.
        merged: dict[str, float] = {}
        for out in outs:
            for k, v in out.items():
                merged[k] = merged.get(k, 0.0) + v
        for k, v in merged.items():
            self._metrics[k] = self._metrics.get(k, 0.0) + v
        self._pending += 1
        return merged

    def step(self) -> StepResult:
        if self._pending == 0:
            raise ValueError(
                "step() called with no accumulated micro-batch; call accumulate(mb, loss_scale) "
                "for the global batch first"
            )
        results = self._all("step")
        self._version = results[0].version
        # DeepSpeed's norm is global (over all ranks' partitions): rank 0's stands for all.
        result = StepResult(version=self._version, grad_norm=results[0].grad_norm,
                            num_micro_batches=self._pending, metrics=self._metrics)
        self._pending, self._metrics = 0, {}
        return result

    def logprobs(self, micro_batch: MicroBatch) -> list[list[float]]:
        shares = split_shares(micro_batch, self.dp)
        outs = self._call("logprobs", {r: (s,) for r, s in enumerate(shares) if s})
        return [row for out in outs for row in out]

    def weights(self) -> dict[str, torch.Tensor]:
        return self._call("weights", {0: ()})[0]  # ZeRO-1/2 ranks hold identical full weights

    def state(self) -> dict[str, Any]:
        if self._pending:
            raise ValueError(
                f"state() with {self._pending} accumulated micro-batch(es) not stepped: a "
                "DeepSpeed trainer's state is taken between steps (call step() first)"
            )
        states = self._all("state")
        # Rank 0 wrote the model states, each rank its optimizer partition: one checkpoint.
        files: dict[str, bytes] = {}
        for s in states:
            files.update(s["checkpoint"])
        return dict(states[0], checkpoint=files)

    def load_state(self, state: Mapping[str, Any]) -> None:
        self._all("load_state", dict(state))
        self._version = int(state["version"])
        self._pending, self._metrics = 0, {}

    def offload_states(self) -> None:
        """Every rank moves its optimizer partition and master weights to host memory."""
        self._all("offload_states")

    def reload_states(self) -> None:
        self._all("reload_states")

    def close(self) -> None:
        """Stop the helpers (idempotent); waits a little for a clean exit, then kills."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            try:
                _send(conn, ("close", ()))
            except OSError:
                pass
        deadline = time.monotonic() + 30
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        _kill(self._procs, self._conns)
        for log in self._logs:
            log.unlink(missing_ok=True)
        if self._logs:
            try:
                self._logs[0].parent.rmdir()
            except OSError:
                pass


def _kill(procs: list[subprocess.Popen[bytes]], conns: list[Connection]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()


def _scratch(cache_dir: str | os.PathLike[str] | None) -> str:
    from flexmarl_core.models.tokenizer import default_cache_dir

    d = default_cache_dir(cache_dir) / "deepspeed"
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


# -- rank process ------------------------------------------------------------------------------
def _rank_main(fd: int) -> int:
    """One rank: build a `DeepSpeedTrainer` in the world the environment describes, then serve
    the controller's calls until "close" or until its socket closes."""
    from flexmarl_core.training.deepspeed_trainer import DeepSpeedTrainer, init_distributed

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the controller's "where are you?"
    conn = Connection(fd)
    try:
        init = pickle.loads(conn.recv_bytes())
        torch.set_num_threads(init["threads"])
        init_distributed(init["cache_dir"], timeout=datetime.timedelta(seconds=init["timeout_s"]))
        trainer = DeepSpeedTrainer(init["model"], ref_model=init["ref_model"], **init["kwargs"])
        del init
    except EOFError:
        return 1
    except Exception:
        _send(conn, ("error", traceback.format_exc()))
        return 1
    _send(conn, ("ok", None))

    def accumulate(share: list[Any], loss_scale: float) -> dict[str, float]:
        if not share:  # fewer samples than ranks: join the backward's collectives with zeros
            trainer.accumulate_nothing()
            return {}
        return trainer.accumulate(share, loss_scale)

    ops = {
        "accumulate": accumulate, "step": trainer.step, "logprobs": trainer.logprobs,
        "weights": trainer.weights, "state": trainer.state, "load_state": trainer.load_state,
        "offload_states": trainer.offload_states, "reload_states": trainer.reload_states,
    }
    while True:
        try:
            op, args = _recv(conn)
        except (EOFError, OSError):  # the controller is gone
            return 0
        if op == "close":
            trainer.close()
            return 0
        try:
            _send(conn, ("ok", ops[op](*args)))
        except Exception:
            _send(conn, ("error", traceback.format_exc()))


if __name__ == "__main__":
    sys.exit(_rank_main(int(sys.argv[1])))
