"""Plain PyTorch trainer (CPU default, one GPU works too): AdamW, grad accumulation, bf16 autocast.

    trainer = TorchTrainer(model, TrainerOptions(make_loss_fn(algo), token_weight, lr=algo.lr,
                                                 temperature=agent.sampling.temperature))
    scale = global_loss_scale(micro_batches, trainer.loss_weight)
    for mb in micro_batches:
        trainer.accumulate(mb, scale)
    trainer.step()
    engine.update_weights(trainer.weights(), trainer.version)

Master weights stay fp32; `bf16=True` runs forward/backward under bf16 autocast.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

from flexmarl_core.training.api import (
    LossFn,
    LossWeightFn,
    MicroBatch,
    StepResult,
    TokenBatch,
    TrainerOptions,
)
from flexmarl_core.training.collate import collate
from flexmarl_core.training.memory import chunk_rows, default_chunk_tokens
from flexmarl_core.training.scoring import (
    EXPLICIT_MASK_ATTENTION,
    attention_impl,
    response_logprobs,
)

#: 2: flat buffers (one tensor each for weights, grads, Adam moments); 1 still loads.
STATE_FORMAT = 2


def clone_tree(obj: Any) -> Any:
    """Deep copy of nested dicts/lists/tuples whose tensors are cloned (detached)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, Mapping):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


class PolicyGradientSteps(ABC):
    """The micro-batch and step bookkeeping every trainer backend shares: collate, reference and
    policy logprobs, the loss scaled by the caller's fixed normaliser, metrics summed over the
    global batch, one version per step. A backend provides the abstract methods below plus the
    attributes annotated here."""

    pad_id: int
    ref_model: torch.nn.Module | None
    loss_fn: LossFn
    loss_weight_fn: LossWeightFn
    max_grad_norm: float
    bf16: bool
    #: logprobs are scored at the sampling temperature (flexmarl_core/models/logprobs.py)
    temperature: float
    _pending: int
    #: micro-batches since the last step that had a backward (not all empty)
    _filled: int = 0
    _metrics: dict[str, float]
    _version: int
    optimizer: torch.optim.Optimizer
    #: AdamW's rate and its warm-up (`lr_at`), from the options
    lr: float
    lr_warmup_steps: int
    #: several samples per row (`collate(pack=True)`), from the options
    packing: bool = False
    #: a group's prompt encoded once (`collate(share_prefix=True)`), from the options where the
    #: model's attention takes an explicit mask
    share_prefix: bool = False

    def _set_options(self, model: PreTrainedModel, opts: TrainerOptions,
                     ref_model: PreTrainedModel | None) -> None:
        """What every backend keeps of its options and reference model."""
        self.loss_fn, self.loss_weight_fn = opts.loss_fn, opts.loss_weight_fn
        self.max_grad_norm, self.bf16, self.temperature = opts.max_grad_norm, opts.bf16, opts.temperature
        self.lr, self.lr_warmup_steps = opts.lr, opts.lr_warmup_steps
        self.packing = opts.packing
        self.share_prefix = opts.share_prefix and attention_impl(model) in EXPLICIT_MASK_ATTENTION
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
        cfg_pad = getattr(model.config, "pad_token_id", None)
        self.pad_id = opts.pad_id if opts.pad_id is not None else (cfg_pad if isinstance(cfg_pad, int) else 0)

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def _logprobs(self, model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
        """(B, R) fp32 logprobs of the response tokens (grad flows if enabled)."""

    @abstractmethod
    def _policy(self) -> torch.nn.Module:
        """The module to differentiate."""

    @abstractmethod
    def _backward(self, loss: torch.Tensor) -> None:
        """Add `loss`'s gradients to the accumulated ones."""

    @abstractmethod
    def _optimizer_step(self) -> float:
        """Apply the accumulated gradients (clip, optimizer, zero); returns the gradient norm."""

    #: token budget of one forward/backward (`training/memory.py`); None: the whole micro-batch
    chunk_tokens: int | None = None

    def accumulate(self, micro_batch: MicroBatch, loss_scale: float) -> dict[str, float]:
        if not micro_batch:  # no sample (a program that never called this agent): counts, adds nothing
            self._pending += 1
            return {}
        self._filled += 1
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in micro_batch]
        out: dict[str, float] = {}
        # The loss is a token sum, so the chunks' gradients add up to the micro-batch's.
        for rows in chunk_rows(lengths, self.chunk_tokens):
            part = micro_batch if len(rows) == len(micro_batch) else [micro_batch[i] for i in rows]
            for k, v in self._accumulate_chunk(part, loss_scale).items():
                out[k] = out.get(k, 0.0) + v
        self._pending += 1
        for k, v in out.items():
            self._metrics[k] = self._metrics.get(k, 0.0) + v
        return out

    def _accumulate_chunk(self, micro_batch: MicroBatch, loss_scale: float) -> dict[str, float]:
        batch = collate(micro_batch, self.pad_id, pack=self.packing, share_prefix=self.share_prefix)
        if self.ref_model is not None:
            with torch.no_grad():
                batch.ref_logprobs = self._logprobs(self.ref_model, batch)
        dev = self.device
        batch.mask, batch.old_logprobs = batch.mask.to(dev), batch.old_logprobs.to(dev)
        batch.advantages = batch.advantages.to(dev)
        logprobs = self._logprobs(self._policy(), batch)
        loss, metrics = self.loss_fn(logprobs, batch)
        self._backward(loss * loss_scale)
        out = {"loss": float(loss.detach()) * loss_scale}
        out.update({k: float(v) * loss_scale for k, v in metrics.items()})
        # counts, not loss terms: summed over the step as they are (padding share = padded / cells)
        out["tokens_padded"] = float(batch.padded_tokens)
        out["tokens_cells"] = float(batch.input_ids.numel())
        out["tokens_shared"] = float(batch.shared_tokens)
        # every sample's tokens, computed or shared: what the layout holds, less padding, plus what it shared
        out["tokens_sample"] = out["tokens_cells"] - out["tokens_padded"] + out["tokens_shared"]
        return out

    def lr_at(self, version: int) -> float:
        """The rate of the step that makes `version + 1`: linear warm-up, then `lr`. Adam's
        first steps move every weight by about the rate whatever its gradient, so a warm-up keeps
        a noisy first RL gradient from undoing a warm start."""
        if self.lr_warmup_steps <= 0:
            return self.lr
        return self.lr * min(1.0, (version + 1) / self.lr_warmup_steps)

    def step(self) -> StepResult:
        if self._pending == 0:
            raise ValueError(
                "step() called with no accumulated micro-batch; call accumulate(mb, loss_scale) "
                "for the global batch first"
            )
        # A global batch without a sample is no update (momentum alone would still move the
        # weights); the version advances all the same, one per iteration.
        grad_norm = 0.0
        if self._filled:
            # The rate follows the version (restored with the state), so a resumed or swapped-in
            # trainer continues the warm-up where it was.
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_at(self._version)
            grad_norm = self._optimizer_step()
        self._version += 1
        result = StepResult(
            version=self._version, grad_norm=grad_norm, num_micro_batches=self._pending,
            metrics=self._metrics,
        )
        self._pending, self._filled, self._metrics = 0, 0, {}
        return result


class TorchTrainer(PolicyGradientSteps):
    """`TrainBackend` on one torch module: policy, optional frozen reference, AdamW."""

    def __init__(
        self,
        model: PreTrainedModel,
        opts: TrainerOptions,
        *,
        ref_model: PreTrainedModel | None = None,
        chunk_tokens: int | None = None,
        activation_checkpointing: bool = False,
    ) -> None:
        self.model = model.float().train()
        if activation_checkpointing:
            # Non-reentrant: works with the flat-buffer parameters and needs no grad on inputs.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.chunk_tokens = chunk_tokens if chunk_tokens is not None else default_chunk_tokens(
            model.config, activation_checkpointing=activation_checkpointing)
        self._set_options(model, opts, ref_model)
        self._flatten_params()
        # AdamW is elementwise, so one flat tensor gives the per-parameter update; the optimizer
        # state is then 2 tensors instead of 3 per parameter (see `_flatten_params`). One
        # difference: a parameter that got no gradient in a step is still stepped (zero grad,
        # so only momentum and weight decay move it), where per-parameter AdamW skips it.
        # Fused: one pass over the buffer instead of seven elementwise ops (3x faster on CPU,
        # where the unfused sqrt over a second moment full of denormals costs the most).
        self.optimizer = torch.optim.AdamW([self._flat], lr=opts.lr, betas=opts.betas,
                                           weight_decay=opts.weight_decay,
                                           fused=self._flat.device.type in ("cpu", "cuda"))
        self._version = 0
        self._pending = 0  # micro-batches accumulated since the last step
        self._metrics: dict[str, float] = {}
        # logits_to_keep lets us run lm_head only over the response span.
        self._keep_ok = "logits_to_keep" in inspect.signature(model.forward).parameters

    # -- properties ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- forward ------------------------------------------------------------------------------
    def _logprobs(self, model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
        """(B, R) fp32 logprobs of the response tokens (grad flows if enabled)."""
        return response_logprobs(model, batch, device=self.device, temperature=self.temperature,
                                 bf16=self.bf16, keep_ok=self._keep_ok)

    # -- TrainBackend -------------------------------------------------------------------------
    def loss_weight(self, micro_batch: MicroBatch) -> float:
        return float(self.loss_weight_fn(micro_batch))

    def _policy(self) -> torch.nn.Module:
        return self.model

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _optimizer_step(self) -> float:
        self._check_views()
        self._adopt_grads()
        # One norm over the flat buffer, accumulated in fp64: an fp32 sum over millions of
        # elements drifts by ~1e-4 relative (per-tensor norms, as clip_grad_norm_ takes them
        # over a parameter list, drift less; fp64 is exact to fp32 precision).
        grad_norm = torch.linalg.vector_norm(self._flat_grad, dtype=torch.float64).to(torch.float32)
        # clip_grad_norm_'s rule: scale by max_norm / (norm + 1e-6) when that is below 1.
        coef = self.max_grad_norm / (float(grad_norm) + 1e-6)
        if coef < 1.0:
            self._flat_grad.mul_(coef)
        self.optimizer.step()
        self._flat_grad.zero_()  # in place: the parameters' .grad stay views of it
        return float(grad_norm)

    # -- gradient helpers (codesign.gradient_helpers) ------------------------------------------
    def set_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Become a copy of the policy at `version` (its published weights), with no gradient
        accumulated: a gradient helper, which never steps, only `take_grads`."""
        with torch.no_grad():
            self.model.load_state_dict(dict(weights))
        self._check_views()
        self._flat_grad.zero_()
        self._version, self._pending, self._metrics = version, 0, {}

    def take_grads(self) -> torch.Tensor:
        """The gradient accumulated since the last `take_grads` / step, as one flat fp32
        tensor in this trainer's layout (a copy), and zero it here."""
        self._adopt_grads()
        out = self._flat_grad.clone()
        self._flat_grad.zero_()
        self._pending, self._filled, self._metrics = 0, 0, {}
        return out

    def add_grads(self, flat: torch.Tensor) -> None:
        """Add a gradient that a helper took (`take_grads`, same layout) to the accumulated one,
        as one more micro-batch of this step."""
        if flat.shape != self._flat_grad.shape or flat.dtype != self._flat_grad.dtype:
            raise ValueError(f"gradient of shape {tuple(flat.shape)} {flat.dtype} does not fit this "
                             f"trainer's flat buffer {tuple(self._flat_grad.shape)} {self._flat_grad.dtype}")
        self._adopt_grads()
        self._flat_grad.add_(flat.to(self._flat_grad.device))
        self._pending += 1
        self._filled += 1

    # -- flat buffers -------------------------------------------------------------------------
    def _flatten_params(self) -> None:
        """Lay the trainable parameters end to end in one fp32 buffer (`_flat`) and their
        gradients in another (`_flat_grad`); each parameter's `.data` and `.grad` become views.

        Why: a trainer state is swapped whenever on-demand allocation moves an agent's training,
        and hundreds of per-tensor copies (weights, grads, two Adam moments and a step counter
        per parameter) cost more than the bytes themselves (bench/swap.py). With flat buffers a
        state is a handful of tensors, each saved and restored by one copy."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        numel = sum(p.numel() for p in self._params)
        dev = self._params[0].device if self._params else torch.device("cpu")
        flat = torch.empty(numel, dtype=torch.float32, device=dev)
        self._flat_grad = torch.zeros_like(flat)
        self._grad_views: list[torch.Tensor] = []
        off = 0
        with torch.no_grad():
            for p in self._params:
                k = p.numel()
                flat[off : off + k].copy_(p.reshape(-1))
                p.data = flat[off : off + k].view_as(p)
                p.grad = self._flat_grad[off : off + k].view_as(p)
                self._grad_views.append(p.grad)
                off += k
        self._flat = torch.nn.Parameter(flat)
        self._flat.grad = self._flat_grad
        # Everything else the model's state_dict holds (frozen weights, persistent buffers),
        # minus entries that alias a trainable parameter (tied embeddings).
        trainable = {id(p) for p in self._params}
        self._others = [k for k, v in self.model.state_dict(keep_vars=True).items() if id(v) not in trainable]

    def _adopt_grads(self) -> None:
        """Backward adds into each existing `.grad` in place; should autograd ever hand back
        a new tensor instead, copy it into the flat buffer (a few id checks otherwise). A
        `.grad` set to None (`model.zero_grad()`) means zero; `optimizer.zero_grad()` drops
        the flat buffer's own `.grad`, which is put back."""
        self._flat.grad = self._flat_grad
        for p, view in zip(self._params, self._grad_views, strict=True):
            if p.grad is not view:
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view

    def _check_views(self) -> None:
        """Each parameter must still be a view of the flat buffer: a `model.to(...)`, `.half()`
        or `load_state_dict(assign=True)` after the trainer was built would give it new
        storage that the optimizer never updates."""
        lo = self._flat.data_ptr()
        hi = lo + self._flat.numel() * self._flat.element_size()
        for n, p in zip(self._names, self._params, strict=True):
            if p.dtype != self._flat.dtype or not lo <= p.data_ptr() < hi:
                raise RuntimeError(
                    f"parameter {n!r} no longer lives in the trainer's flat buffer (was the model "
                    f"cast or moved after the trainer was built?); give an inference engine a copy"
                )

    def _layout(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, tuple(p.shape)) for n, p in zip(self._names, self._params, strict=True)]

    def logprobs(self, micro_batch: MicroBatch) -> list[list[float]]:
        batch = collate(micro_batch, self.pad_id, pack=self.packing, share_prefix=self.share_prefix)
        with torch.no_grad():
            lp = self._logprobs(self.model, batch).cpu()
        return [lp[b, : len(s.response_ids)].tolist() for b, s in enumerate(micro_batch)]

    def weights(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        own = (lambda t: t.detach().clone()) if copy else (lambda t: t.detach())
        sd = {k: own(v) for k, v in self.model.state_dict().items()}
        # Tied embeddings: engines must get lm_head too (state_dict() of a tied model may omit
        # it, and a vLLM push without it silently keeps the old output layer).
        out_emb = self.model.get_output_embeddings()
        if "lm_head.weight" not in sd and out_emb is not None:
            sd["lm_head.weight"] = own(out_emb.weight)
        return sd

    def state(self, *, copy: bool = True) -> dict[str, Any]:
        """Flat: weights, pending gradients and both Adam moments are one tensor each.
        `copy=False`: the trainer's own tensors (a swap-out writing them before anything steps
        again: a copy would need the state's size again in memory at the moment of the swap)."""
        self._adopt_grads()
        opt = self.optimizer.state.get(self._flat, {})
        others = self.model.state_dict()

        def own(t: torch.Tensor) -> torch.Tensor:
            return t.detach().clone() if copy else t.detach()

        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "layout": self._layout(),
            "params": own(self._flat),
            "others": {k: own(others[k]) for k in self._others},
            "grads": own(self._flat_grad) if self._pending else None,
            "adam": {k: own(v) for k, v in opt.items()} if opt else None,
            "version": self._version,
            "pending": self._pending,
            "filled": self._filled,
            "metrics": dict(self._metrics),
            "rng": torch.get_rng_state(),
        }
        if self.ref_model is not None:
            state["ref_model"] = clone_tree(self.ref_model.state_dict())
        return state

    def load_state(self, state: Mapping[str, Any]) -> None:
        fmt = state.get("format")
        if fmt != STATE_FORMAT:
            raise ValueError(
                f"trainer state format {fmt}, expected {STATE_FORMAT}; "
                "was it written by TorchTrainer.state() of this version?"
            )
        if ("ref_model" in state) != (self.ref_model is not None):
            raise ValueError(
                "trainer state and trainer disagree on the KL reference model: build the trainer "
                "with the same algorithm.kl_coef (> 0 keeps a reference) as the saved one"
            )
        with torch.no_grad():
            self._load_flat(state)
            if self.ref_model is not None:
                self.ref_model.load_state_dict(state["ref_model"])
        self._version = int(state["version"])
        self._pending = int(state["pending"])
        # A state from before empty micro-batches were told apart: every one had samples.
        self._filled = int(state.get("filled", self._pending))
        self._metrics = dict(state["metrics"])
        torch.set_rng_state(state["rng"])

    def _load_flat(self, state: Mapping[str, Any]) -> None:
        saved = [(str(n), tuple(int(d) for d in shape)) for n, shape in state["layout"]]
        if saved != self._layout():
            diff = next((f"{a} vs {b}" for a, b in zip(saved, self._layout(), strict=False) if a != b),
                        f"{len(saved)} vs {len(self._params)} parameters")
            raise ValueError(f"trainer state is for a different model: parameters differ ({diff})")
        self._flat.copy_(state["params"])
        if self._others:
            self.model.load_state_dict(state["others"], strict=False)
        self._adopt_grads()
        if state["grads"] is None:
            self._flat_grad.zero_()
        else:
            self._flat_grad.copy_(state["grads"])
        self._set_adam(state["adam"])

    def _set_adam(self, adam: Mapping[str, torch.Tensor] | None) -> None:
        """Adam moments into the optimizer, by copy: they are updated in place later, and the
        state given to `load_state` must stay the caller's."""
        if adam is None:
            self.optimizer.state.pop(self._flat, None)
            return
        mine = self.optimizer.state.get(self._flat)
        if mine and mine.keys() == adam.keys():
            for k, v in adam.items():
                mine[k].copy_(v)
        else:
            # Moments live with the weights; AdamW keeps its step counter on the CPU.
            dev = self._flat.device
            self.optimizer.state[self._flat] = {
                k: v.detach().to("cpu" if k == "step" else dev, copy=True) for k, v in adam.items()}
