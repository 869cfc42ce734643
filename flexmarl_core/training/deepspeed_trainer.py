"""DeepSpeed ZeRO-1/2 trainer (`deepspeed` extra) behind the `TrainBackend` calls; CPU + gloo.

    trainer = DeepSpeedTrainer(model, TrainerOptions(loss_fn, token_weight, lr=1e-4), zero_stage=2)
    scale = global_loss_scale(micro_batches, trainer.loss_weight)
    for mb in micro_batches:               # the pipeline's micro-batches, whenever they are ready
        trainer.accumulate(mb, scale)      # engine.backward(loss_fn(mb) * scale)
    trainer.step()                         # clip + AdamW step + zero grads, version += 1

Same math as `TorchTrainer`: the same token scoring (`response_logprobs`), the same loss
normalisation (`loss_scale` multiplies each micro-batch's summed loss, DeepSpeed's own division by
`gradient_accumulation_steps` is off, and so is its averaging over data-parallel ranks:
`gradient_allreduce_op: sum`), the same torch AdamW (passed to DeepSpeed as the client
optimizer, so ZeRO partitions its state), clipping at `max_grad_norm` by DeepSpeed. The pipeline
decides how many micro-batches make a step, not the DeepSpeed config:
`managed_gradient_accumulation: false` makes `engine.backward` only accumulate and `engine.step`
the boundary (reduce into the ZeRO partitions, clip, update).

World: one process by default (`init_distributed`: gloo, world size 1, a free port on
127.0.0.1), so several agents' trainers share it. DeepSpeed is imported lazily, with
`DS_ACCELERATOR=cpu` unless a CUDA device is present, and JIT-compiled ops are cached in
`TORCH_EXTENSIONS_DIR` (default `$FLEXMARL_CACHE/torch_extensions`): the first run on a machine
compiles DeepSpeed's shm op (~30 s here), later runs reuse it.

State: `state()` is DeepSpeed's own checkpoint (`save_checkpoint`, which restores bit-exactly)
packed as file bytes plus version/metrics/RNG, so it travels through `handles.put`/`get` like a
`TorchTrainer` state; `load_state` writes it back and runs `load_checkpoint`. Taken between steps
only (the pipeline checkpoints after `step`): accumulated gradients live inside ZeRO's buffers
and are not part of DeepSpeed's checkpoint. `offload_states`/`reload_states` swap the
optimizer state and fp32 master weights out of / back into device memory in place (ZeRO-1/2; on
CPU they stay in host memory).
"""

from __future__ import annotations

import datetime
import inspect
import io
import os
import pickle
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from flexmarl_core.runfiles.location import default_cache_dir
from flexmarl_core.training.api import MicroBatch, TrainerOptions
from flexmarl_core.training.collate import collate
from flexmarl_core.training.scoring import response_logprobs
from flexmarl_core.training.torch_trainer import PolicyGradientSteps

STATE_FORMAT = "deepspeed-1"
_TAG = "state"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def import_deepspeed(cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """Import DeepSpeed with flexmarl's defaults (CPU accelerator without CUDA, cached JIT ops)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(default_cache_dir(cache_dir) / "torch_extensions"))
    try:
        import deepspeed
    except ImportError as e:  # the config validator normally catches this first
        raise ImportError(
            "backend.training='deepspeed' needs DeepSpeed: DS_BUILD_OPS=0 pip install "
            f"'flexmarl[deepspeed]' (or `make setup-scale`): {e}"
        ) from e
    return deepspeed


def init_distributed(
    cache_dir: str | os.PathLike[str] | None = None, *, timeout: datetime.timedelta | None = None
) -> Any:
    """Join (or create) this process's torch.distributed world; default a 1-process gloo world.

    Respects MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK already set (torchrun, or a
    spawned data-parallel group); otherwise sets up rank 0 of 1 on a free local port. `timeout`
    bounds every collective (a data-parallel rank whose peer died fails instead of waiting for
    DeepSpeed's 30 min default).
    """
    deepspeed = import_deepspeed(cache_dir)
    dist = torch.distributed
    if dist.is_initialized():
        # Someone else made the world (an in-process vLLM engine makes a 1-process gloo one):
        # DeepSpeed joins it, but reads its rank from the environment.
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    elif not all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
        # Not only WORLD_SIZE: the branch above leaves RANK/WORLD_SIZE behind without MASTER_*,
        # and once that world is gone (vLLM closed) DeepSpeed would fall back to MPI discovery.
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    deepspeed.init_distributed(dist_backend=backend, verbose=False, **kwargs)
    _forget_stale_world_clone(dist)
    return deepspeed


def _forget_stale_world_clone(dist: Any) -> None:
    """DeepSpeed caches a clone of the world group once per process. When that world is gone
    (an in-process vLLM engine that made it was closed) and a new one took its place, the clone
    is unregistered and every engine built afterwards fails ("Group ... is not registered"):
    drop it so DeepSpeed clones the current world."""
    from deepspeed.utils import groups

    clone = getattr(groups, "_WORLD_GROUP", None)
    if clone is None:
        return
    try:
        dist.get_global_rank(clone, 0)
    except (ValueError, RuntimeError):
        groups._WORLD_GROUP = None


def _safe_globals() -> list[Any]:
    """The DeepSpeed value types a ZeRO checkpoint's optimizer file holds (seen with deepspeed
    0.19.8: `get_unsafe_globals_in_checkpoint`), allowed to torch's weights-only unpickler."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [fragment_address, LossScaler, ZeroStageEnum]


def plain_checkpoint(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """The files of a DeepSpeed checkpoint in a trainer state, checked to be plain data before
    DeepSpeed reads them: its `load_checkpoint` unpickles with `weights_only=False`, which runs
    whatever a crafted file names. Each `.pt` file must load with torch's weights-only
    unpickler (tensors, containers, scalars and the few DeepSpeed value types of
    `_safe_globals`); `latest` is the tag's text; the helper scripts DeepSpeed writes beside
    (its zero_to_fp32.py) are not needed to load and are left out.

    Raises:
        ValueError: a file that is not plain data, named.
    """
    out: dict[str, bytes] = {}
    for rel, data in files.items():
        if rel.endswith(".py"):
            continue
        if rel.endswith(".pt"):
            try:
                with torch.serialization.safe_globals(_safe_globals()):
                    torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
            except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise ValueError(
                    f"trainer state: DeepSpeed checkpoint file {rel!r} is not plain tensors and "
                    f"containers ({first}); refused, since loading it could run code"
                ) from None
        elif rel != "latest" or len(data) > 256:
            raise ValueError(f"trainer state: unexpected file {rel!r} in its DeepSpeed checkpoint")
        out[rel] = data
    return out


class DeepSpeedTrainer(PolicyGradientSteps):
    """`TrainBackend` on a DeepSpeed engine (ZeRO stage 1 or 2) wrapping one torch module."""

    def __init__(
        self,
        model: PreTrainedModel,
        opts: TrainerOptions,
        *,
        ref_model: PreTrainedModel | None = None,
        zero_stage: int = 2,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if zero_stage not in (1, 2):
            raise ValueError(
                f"zero_stage={zero_stage}: DeepSpeedTrainer supports ZeRO stages 1 and 2 "
                "(stage 3 shards parameters, which the in-process weight push does not gather)"
            )
        deepspeed = init_distributed(cache_dir)
        self._cache_dir = cache_dir
        self._set_options(model, opts, ref_model)
        self.zero_stage = zero_stage
        model = model.float().train()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=opts.lr, betas=opts.betas, weight_decay=opts.weight_decay)
        config = {
            "train_micro_batch_size_per_gpu": 1,  # nominal: batches come whole from the pipeline
            "gradient_accumulation_steps": 1,
            # The caller owns the boundary: backward() only accumulates, step() reduces + updates.
            "managed_gradient_accumulation": False,
            "gradient_clipping": opts.max_grad_norm,
            # Each rank's loss is already scaled by the GLOBAL normaliser (fixed before any
            # backward), so the full gradient is the sum over data-parallel ranks, not the mean.
            # No-op in a 1-process world.
            "gradient_allreduce_op": "sum",
            "zero_optimization": {"stage": zero_stage},
            "zero_allow_untested_optimizer": True,  # torch AdamW: same update as TorchTrainer
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config
        )
        self._version = 0
        self._pending = 0
        self._metrics: dict[str, float] = {}
        self._keep_ok = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.dp_world = int(self.engine.dp_world_size)

    # -- properties ---------------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def version(self) -> int:
        return self._version

    @property
    def device(self) -> torch.device:
        return next(self.engine.module.parameters()).device

    def _logprobs(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        return response_logprobs(model, batch, device=self.device, temperature=self.temperature,
                                 bf16=self.bf16, keep_ok=self._keep_ok)

    # -- TrainBackend -------------------------------------------------------------------------
    def loss_weight(self, micro_batch: MicroBatch) -> float:
        return float(self.loss_weight_fn(micro_batch))

    def _policy(self) -> torch.nn.Module:
        return self.engine

    def _backward(self, loss: torch.Tensor) -> None:
        # Unmanaged accumulation: gradients add up (in ZeRO-2's partitions) until step().
        self.engine.backward(loss, scale_wrt_gas=False)

    def accumulate_nothing(self) -> None:
        """Backprop zeros: a data-parallel rank with an empty share of a micro-batch (fewer
        samples than ranks) still enters the backward's gradient collectives (ZeRO-2 reduces
        partitions in every backward, not only at step())."""
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        self.engine.backward(sum(p.sum() for p in params) * 0.0, scale_wrt_gas=False)
        self._pending += 1
        self._filled += 1  # the other ranks step: this one must too

    def _optimizer_step(self) -> float:
        self.engine.step()  # the boundary: reduce, clip, AdamW, zero grads
        grad_norm = self.engine.get_global_grad_norm()
        return float(grad_norm) if grad_norm is not None else float("nan")

    def logprobs(self, micro_batch: MicroBatch) -> list[list[float]]:
        batch = collate(micro_batch, self.pad_id, pack=self.packing, share_prefix=self.share_prefix)
        with torch.no_grad():
            lp = self._logprobs(self.engine.module, batch).cpu()
        return [lp[b, : len(s.response_ids)].tolist() for b, s in enumerate(micro_batch)]

    def weights(self, *, copy: bool = True) -> dict[str, torch.Tensor]:  # always copies
        module = self.engine.module
        sd = {k: v.detach().clone() for k, v in module.state_dict().items()}
        out_emb = module.get_output_embeddings()
        if "lm_head.weight" not in sd and out_emb is not None:
            sd["lm_head.weight"] = out_emb.weight.detach().clone()
        return sd

    def state(self, *, copy: bool = True) -> dict[str, Any]:  # always copies
        if self._pending:
            raise ValueError(
                f"state() with {self._pending} accumulated micro-batch(es) not stepped: a "
                "DeepSpeed trainer's state is taken between steps (call step() first)"
            )
        with tempfile.TemporaryDirectory(prefix="ds-state-", dir=self._scratch()) as d:
            self.engine.save_checkpoint(d, tag=_TAG)
            files = {
                str(p.relative_to(d)): p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file()
            }
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "zero_stage": self.zero_stage,
            "dp_world": self.dp_world,
            "checkpoint": files,
            "version": self._version,
            "rng": torch.get_rng_state(),
        }
        if self.ref_model is not None:
            state["ref_model"] = {k: v.detach().clone() for k, v in self.ref_model.state_dict().items()}
        return state

    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"trainer state format {state.get('format')!r}, expected {STATE_FORMAT!r}; was it "
                "written by DeepSpeedTrainer.state()? (a TorchTrainer state does not load here)"
            )
        if state["zero_stage"] != self.zero_stage:
            raise ValueError(
                f"trainer state is ZeRO stage {state['zero_stage']}, this trainer runs stage "
                f"{self.zero_stage}; build it with the same stage"
            )
        if state.get("dp_world", 1) != self.dp_world:
            raise ValueError(
                f"trainer state was saved by {state.get('dp_world', 1)} data-parallel rank(s), "
                f"this trainer runs {self.dp_world}: ZeRO partitions the optimizer state per "
                "rank; build the trainer with the same backend.training_dp"
            )
        if ("ref_model" in state) != (self.ref_model is not None):
            raise ValueError(
                "trainer state and trainer disagree on the KL reference model: build the trainer "
                "with the same algorithm.kl_coef (> 0 keeps a reference) as the saved one"
            )
        with tempfile.TemporaryDirectory(prefix="ds-state-", dir=self._scratch()) as d:
            for rel, data in plain_checkpoint(state["checkpoint"]).items():
                path = Path(d) / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
            load_path, _ = self.engine.load_checkpoint(
                d, tag=_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        if load_path is None:
            raise ValueError("DeepSpeed found no checkpoint in the trainer state")
        if self.ref_model is not None:
            with torch.no_grad():
                self.ref_model.load_state_dict(state["ref_model"])
        self._version = int(state["version"])
        self._pending, self._filled, self._metrics = 0, 0, {}
        torch.set_rng_state(state["rng"])

    # -- swap ---------------------------------------------------------------------------------
    def offload_states(self) -> None:
        """Move optimizer state, fp32 master weights and gradient buffers to host memory."""
        self.engine.offload_states()

    def reload_states(self) -> None:
        """Bring back what `offload_states` moved out."""
        self.engine.reload_states()

    def _scratch(self) -> str:
        d = default_cache_dir(self._cache_dir) / "deepspeed"
        d.mkdir(parents=True, exist_ok=True)
        return str(d)

    def close(self) -> None:
        """Release the engine (the process's distributed world stays for other trainers)."""
        self.engine.destroy()
