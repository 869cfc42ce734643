"""Data-parallel DeepSpeed trainer for ONE agent: N rank processes, one `TrainBackend` in front.

    trainer = DataParallelDeepSpeedTrainer(model, TrainerOptions(loss_fn, token_weight), name="solver", dp=2)
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
are daemonic and may not start multiprocessing children). The controller talks to them over a
second gloo process group of its own (`ProcessGroupGloo` on a `TCPStore` the controller hosts:
the controller is its member 0, rank r its member r + 1), made outside torch.distributed's
default world, so it neither needs nor disturbs the one the caller's process may hold. A call
is a point-to-point send of its pickled arguments to each rank (tensors travel as bytes, no
shared-memory handles to outlive) and a receive of each rank's pickled reply.

Same math as the 1-process trainer: each rank's share is scaled by the GLOBAL `loss_scale`, and
DeepSpeed sums (not averages) the ranks' gradients (`gradient_allreduce_op: sum`, set in
`DeepSpeedTrainer`), so the gradient is the one of the whole batch. Every rank runs one backward
per micro-batch (ZeRO-2 reduces gradient partitions inside each backward, a collective): a rank
whose share is empty backprops zeros. Only the summation order differs from one process.

Failure: every reply is awaited with a deadline (`timeout_s`), and a watcher thread polls the
helpers' liveness; a helper that dies stops all the others (their connections close, so a
receive from any of them fails at once), and one that raises or hangs does too. The error
names the agent, the rank, and the tail of the rank's log. The ranks' collectives time out too
(`init_distributed(timeout=...)`), and a helper exits when its controller's connection closes.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from flexmarl_core.runfiles.location import default_cache_dir
from flexmarl_core.training.api import MicroBatch, StepResult, TrainerOptions
from flexmarl_core.training.deepspeed_trainer import DeepSpeedTrainer, free_port, init_distributed

_POLL_S = 0.2  #: how often the watcher checks that the helpers are alive
_LOG_TAIL = 3000  #: characters of a failed rank's log quoted in the error
#: a helper waits this long for its controller's next call (between iterations: any time)
_IDLE = datetime.timedelta(days=30)


def _control_group(port: int, member: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """The controller's gloo group with its ranks (member 0: the controller, which hosts the
    store), apart from torch.distributed's default world."""
    store = dist.TCPStore("127.0.0.1", port, size, member == 0, timeout=timeout, wait_for_workers=False)
    return dist.ProcessGroupGloo(dist.PrefixStore("flexmarl-dp", store), member, size, timeout)


def _send(group: dist.ProcessGroup, dst: int, obj: Any) -> None:
    """`obj` pickled to member `dst`."""
    _send_pickled(group, dst, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _send_pickled(group: dist.ProcessGroup, dst: int, data: bytes) -> None:
    """A pickle's bytes to member `dst`: their length, then the bytes."""
    group.send([torch.tensor([len(data)], dtype=torch.int64)], dst, 0).wait()
    group.send([torch.frombuffer(bytearray(data), dtype=torch.uint8)], dst, 1).wait()


def _recv(group: dist.ProcessGroup, src: int, timeout: datetime.timedelta) -> Any:
    """The next object member `src` sent (`_send`); raises when it does not come within `timeout`
    or `src`'s connection closes."""
    n = torch.zeros(1, dtype=torch.int64)
    group.recv([n], src, 0).wait(timeout)
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    group.recv([buf], src, 1).wait(timeout)
    return pickle.loads(buf.numpy().tobytes())
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
        opts: TrainerOptions,
        *,
        name: str,
        dp: int,
        ref_model: PreTrainedModel | None = None,
        zero_stage: int = 2,
        cache_dir: str | os.PathLike[str] | None = None,
        timeout_s: float = 600.0,
        start_timeout_s: float = 900.0,
    ) -> None:
        """Each rank's `DeepSpeedTrainer` gets `opts` (so its loss functions must pickle).
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
        self.loss_weight_fn = opts.loss_weight_fn
        self.timeout_s = timeout_s
        self._cache_dir = cache_dir
        init = {
            "model": model, "ref_model": ref_model, "threads": torch.get_num_threads(),
            "timeout_s": timeout_s, "cache_dir": None if cache_dir is None else str(cache_dir),
            "opts": opts, "kwargs": {"zero_stage": zero_stage, "cache_dir": cache_dir},
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
        self._logs: list[Path] = []
        self._group: dist.ProcessGroup | None = None
        #: (rank, exit code) of the first helper the watcher saw exit
        self._died: tuple[int, int] | None = None
        # Helpers never outlive the controller, even if close() is never called.
        self._finalizer = weakref.finalize(self, _kill, self._procs)
        self._start(payload, start_timeout_s)

    # -- process management -------------------------------------------------------------------
    def _start(self, payload: bytes, start_timeout_s: float) -> None:
        log_dir = Path(tempfile.mkdtemp(prefix=f"dp-{self.name}-", dir=_scratch(self._cache_dir)))
        world_port, control_port = free_port(), free_port()
        for rank in range(self.dp):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(world_port), RANK=str(rank),
                       WORLD_SIZE=str(self.dp), LOCAL_RANK=str(rank), PYTHONUNBUFFERED="1")
            env["PYTHONPATH"] = os.pathsep.join(p for p in [*sys.path, env.get("PYTHONPATH", "")] if p)
            log = log_dir / f"rank{rank}.log"
            with open(log, "wb") as f:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "flexmarl_core.training.dp_trainer", str(control_port),
                     str(int(self.timeout_s))],
                    env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                )
            self._procs.append(proc)
            self._logs.append(log)
        self._group = self._join(control_port, start_timeout_s)
        # The watcher holds the trainer weakly: one dropped without close() is still collected
        # (and its finalizer stops the helpers).
        threading.Thread(target=_watch, args=(weakref.ref(self),), name=f"dp-{self.name}-watch",
                         daemon=True).start()
        for rank in range(self.dp):
            self._post(rank, payload, "start", pickled=True)
        self._gather(range(self.dp), "start", start_timeout_s)

    def _join(self, port: int, timeout_s: float) -> dist.ProcessGroup:
        """The control group, once every helper joined it; a helper that exits first fails the
        start at once (the rendezvous itself would only time out)."""
        made: list[Any] = []
        timeout = datetime.timedelta(seconds=timeout_s)
        t = threading.Thread(target=lambda: made.append(_catch(_control_group, port, 0, self.dp + 1, timeout)),
                             daemon=True)
        t.start()
        while t.is_alive():
            t.join(_POLL_S)
            for r, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    self._fail(r, f"exited with code {proc.returncode}", "start")
        if isinstance(made[0], BaseException):
            self._fail(0, f"did not join the controller's group ({made[0]})", "start")
        return made[0]

    def _fail(self, rank: int, what: str, op: str, *, silent: bool = False) -> None:
        """Stop every helper (peers of a failed rank may be stuck in a collective) and raise."""
        self._closed = True
        proc = self._procs[rank]
        if silent and proc.poll() is None:  # have it write its stack into its log first
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        _kill(self._procs)
        try:
            tail = self._logs[rank].read_text(errors="replace")[-_LOG_TAIL:]
        except OSError:
            tail = "(no log)"
        raise RuntimeError(
            f"agent {self.name!r}: data-parallel DeepSpeed rank {rank} of {self.dp} {what} during "
            f"{op!r}; all {self.dp} helper processes are stopped and this trainer is closed "
            f"(rebuild it and load_state to continue). Log {self._logs[rank]}:\n{tail}"
        )

    def _lost(self, rank: int, op: str, exc: BaseException, timeout_s: float) -> None:
        """A send to or receive from `rank` failed: name the helper that exited first, or the
        silent one."""
        if self._died is None:
            time.sleep(2 * _POLL_S)  # the watcher notices an exit within one poll
        if self._died is not None:
            r, code = self._died
            self._fail(r, f"exited with code {code}", op)
        if "Timed out" in str(exc):
            self._fail(rank, f"sent no reply within {timeout_s:.0f} s", op, silent=True)
        self._fail(rank, f"closed its connection ({exc})", op)

    def _post(self, rank: int, obj: Any, op: str, *, pickled: bool = False) -> None:
        assert self._group is not None
        try:
            if pickled:
                _send_pickled(self._group, rank + 1, obj)
            else:
                _send(self._group, rank + 1, obj)
        except RuntimeError as exc:  # gloo: the helper's connection is gone
            self._lost(rank, op, exc, self.timeout_s)

    def _gather(self, ranks: Sequence[int] | range, op: str, timeout_s: float | None = None) -> list[Any]:
        """The replies of `ranks`, in order, failing fast on a dead, raising or silent helper."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        out: list[Any] = []
        for rank in ranks:
            left = max(deadline - time.monotonic(), 0.001)
            assert self._group is not None
            try:
                status, value = _recv(self._group, rank + 1, datetime.timedelta(seconds=left))
            except RuntimeError as exc:
                self._lost(rank, op, exc, timeout_s or self.timeout_s)
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
            self._post(rank, (op, args), op)
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
        joined = bool(micro_batch)  # an empty micro-batch (an agent not called) has no backward
        outs = self._call("accumulate", {r: (s, loss_scale, joined) for r, s in enumerate(shares)})
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

    def weights(self, *, copy: bool = True) -> dict[str, torch.Tensor]:  # always copies
        return self._call("weights", {0: ()})[0]  # ZeRO-1/2 ranks hold identical full weights

    def state(self, *, copy: bool = True) -> dict[str, Any]:  # always copies
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
        for rank in range(self.dp if self._group is not None else 0):
            try:
                _send(self._group, rank + 1, ("close", ()))
            except RuntimeError:  # already gone
                pass
        deadline = time.monotonic() + 30
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        _kill(self._procs)
        for log in self._logs:
            log.unlink(missing_ok=True)
        if self._logs:
            try:
                self._logs[0].parent.rmdir()
            except OSError:
                pass


def _watch(ref: weakref.ref[DataParallelDeepSpeedTrainer]) -> None:
    """Stop every helper once one exits: its peers may be stuck in a collective with it, and a
    receive from a stopped helper fails at once (the controller then names the first)."""
    while (tr := ref()) is not None and not tr._closed:
        for r, proc in enumerate(tr._procs):
            if proc.poll() is not None:
                tr._died = (r, int(proc.returncode))
                _kill(tr._procs)
                return
        del tr
        time.sleep(_POLL_S)


def _catch(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # handed to the thread that waits for it
        return exc


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _scratch(cache_dir: str | os.PathLike[str] | None) -> str:
    d = default_cache_dir(cache_dir) / "deepspeed"
    d.mkdir(parents=True, exist_ok=True)
    return str(d)


# -- rank process ------------------------------------------------------------------------------
def _rank_main(control_port: int, timeout_s: int) -> int:
    """One rank: join the controller's group, build a `DeepSpeedTrainer` in the world the
    environment describes, then serve the controller's calls until "close" or until its
    connection closes."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the controller's "where are you?"
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        group = _control_group(control_port, rank + 1, size + 1, datetime.timedelta(seconds=timeout_s))
    except RuntimeError:
        return 1  # the controller is gone
    try:
        init = _recv(group, 0, _IDLE)
    except RuntimeError:
        return 1
    try:
        torch.set_num_threads(init["threads"])
        init_distributed(init["cache_dir"], timeout=datetime.timedelta(seconds=init["timeout_s"]))
        trainer = DeepSpeedTrainer(init["model"], init["opts"], ref_model=init["ref_model"], **init["kwargs"])
        del init
    except Exception:
        _send(group, 0, ("error", traceback.format_exc()))
        return 1
    _send(group, 0, ("ok", None))

    def accumulate(share: list[Any], loss_scale: float, joined: bool) -> dict[str, float]:
        if not share and joined:  # fewer samples than ranks: join the backward's collectives
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
            op, args = _recv(group, 0, _IDLE)
        except RuntimeError:  # the controller is gone
            return 0
        if op == "close":
            trainer.close()
            return 0
        try:
            reply = ("ok", ops[op](*args))
        except Exception:
            reply = ("error", traceback.format_exc())
        try:
            _send(group, 0, reply)
        except RuntimeError:
            return 0


if __name__ == "__main__":
    sys.exit(_rank_main(int(sys.argv[1]), int(sys.argv[2])))
