"""Plain PyTorch trainer (CPU default, one GPU works too): AdamW, grad accumulation, bf16 autocast.

    trainer = TorchTrainer(model, loss_fn=make_loss_fn(algo), loss_weight_fn=token_weight,
                           lr=algo.lr, temperature=agent.sampling.temperature)
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

from flexmarl_core.models.logprobs import token_logprobs
from flexmarl_core.training.api import LossFn, LossWeightFn, MicroBatch, StepResult, TokenBatch
from flexmarl_core.training.collate import collate

STATE_FORMAT = 1


def clone_tree(obj: Any) -> Any:
    """Deep copy of nested dicts/lists/tuples whose tensors are cloned (detached)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, Mapping):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def response_logprobs(
    model: torch.nn.Module,
    batch: TokenBatch,
    *,
    device: torch.device,
    temperature: float,
    bf16: bool,
    keep_ok: bool,
) -> torch.Tensor:
    """(B, R) fp32 logprobs of the response tokens of `batch` under `model` (grad flows if
    enabled); shared by every trainer so they score tokens identically.

    `keep_ok`: the model's forward takes `logits_to_keep` (lm_head then runs only over the
    response span)."""
    dev = device
    input_ids = batch.input_ids.to(dev)
    # No attention mask: with RIGHT padding a causal mask already hides every pad from every
    # real token (pads come after it), and attention keeps its fast is_causal path. Logits at
    # pad positions are garbage but never gathered into a real (mask = 1) entry.
    # Logits are needed only on [lo, hi): from the earliest first-response-token predictor to
    # the last predictor. Every row has >= 1 response token, so column 0 of target_index
    # holds each row's first target position.
    lo = int(batch.target_index[:, 0].min())
    hi = int(batch.target_index.max()) + 1
    kwargs: dict[str, Any] = {}
    if keep_ok:  # lm_head runs only over the span
        kwargs["logits_to_keep"] = torch.arange(lo, hi, device=dev)
    with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=input_ids, **kwargs).logits  # (B, T' = hi - lo, V)
    if not keep_ok:
        logits = logits[:, lo:hi]
    # Score every position in the span against the next input token, then pick the response
    # positions: gathering (B, R, V) logit rows instead would cost a V-wide scatter in backward.
    next_tokens = input_ids[:, lo + 1 : hi + 1]  # (B, T')
    per_pos = token_logprobs(logits, next_tokens, temperature)  # (B, T')
    index = (batch.target_index.to(dev) - lo).clamp_(min=0)  # padding entries were 0
    return per_pos.gather(1, index)  # (B, R)


class PolicyGradientSteps(ABC):
    """The micro-batch and step bookkeeping every trainer backend shares: collate, reference and
    policy logprobs, the loss scaled by the caller's fixed normaliser, metrics summed over the
    global batch, one version per step. A backend provides the abstract methods below plus the
    attributes annotated here."""

    pad_id: int
    ref_model: torch.nn.Module | None
    loss_fn: LossFn
    _pending: int
    _metrics: dict[str, float]
    _version: int

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

    def accumulate(self, micro_batch: MicroBatch, loss_scale: float) -> dict[str, float]:
        batch = collate(micro_batch, self.pad_id)
        if self.ref_model is not None:
            with torch.no_grad():
                batch.ref_logprobs = self._logprobs(self.ref_model, batch)
        dev = self.device
        batch.mask, batch.old_logprobs = batch.mask.to(dev), batch.old_logprobs.to(dev)
        batch.advantages = batch.advantages.to(dev)
        logprobs = self._logprobs(self._policy(), batch)
        loss, metrics = self.loss_fn(logprobs, batch)
        self._backward(loss * loss_scale)
        self._pending += 1
        out = {"loss": float(loss.detach()) * loss_scale}
        out.update({k: float(v) * loss_scale for k, v in metrics.items()})
        for k, v in out.items():
            self._metrics[k] = self._metrics.get(k, 0.0) + v
        return out

    def step(self) -> StepResult:
        if self._pending == 0:
            raise ValueError(
                "step() called with no accumulated micro-batch; call accumulate(mb, loss_scale) "
                "for the global batch first"
            )
        grad_norm = self._optimizer_step()
        self._version += 1
        result = StepResult(
            version=self._version, grad_norm=grad_norm, num_micro_batches=self._pending,
            metrics=self._metrics,
        )
        self._pending, self._metrics = 0, {}
        return result


class TorchTrainer(PolicyGradientSteps):
    """`TrainBackend` on one torch module: policy, optional frozen reference, AdamW."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        loss_fn: LossFn,
        loss_weight_fn: LossWeightFn,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        betas: tuple[float, float] = (0.9, 0.999),
        bf16: bool = False,
        temperature: float = 1.0,
        ref_model: PreTrainedModel | None = None,
        pad_id: int | None = None,
    ) -> None:
        self.model = model.float().train()
        self.loss_fn = loss_fn
        self.loss_weight_fn = loss_weight_fn
        self.max_grad_norm = max_grad_norm
        self.bf16 = bf16
        #: logprobs are scored at the sampling temperature (flexmarl_core/models/logprobs.py)
        self.temperature = temperature
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
        cfg_pad = getattr(model.config, "pad_token_id", None)
        self.pad_id = pad_id if pad_id is not None else (cfg_pad if isinstance(cfg_pad, int) else 0)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self._params, lr=lr, betas=betas, weight_decay=weight_decay)
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
        grad_norm = torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def logprobs(self, micro_batch: MicroBatch) -> list[list[float]]:
        batch = collate(micro_batch, self.pad_id)
        with torch.no_grad():
            lp = self._logprobs(self.model, batch).cpu()
        return [lp[b, : len(s.response_ids)].tolist() for b, s in enumerate(micro_batch)]

    def weights(self) -> dict[str, torch.Tensor]:
        sd = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        # Tied embeddings: inference engines must get lm_head too (FACTS.md, vLLM trap).
        out_emb = self.model.get_output_embeddings()
        if "lm_head.weight" not in sd and out_emb is not None:
            sd["lm_head.weight"] = out_emb.weight.detach().clone()
        return sd

    def state(self) -> dict[str, Any]:
        grads = {
            n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None
        }
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "model": clone_tree(self.model.state_dict()),
            "optimizer": clone_tree(self.optimizer.state_dict()),
            "version": self._version,
            "pending": self._pending,
            "metrics": dict(self._metrics),
            "grads": grads,
            "rng": torch.get_rng_state(),
        }
        if self.ref_model is not None:
            state["ref_model"] = clone_tree(self.ref_model.state_dict())
        return state

    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"trainer state format {state.get('format')!r}, expected {STATE_FORMAT}; "
                "was it written by TorchTrainer.state()?"
            )
        if ("ref_model" in state) != (self.ref_model is not None):
            raise ValueError(
                "trainer state and trainer disagree on the KL reference model: build the trainer "
                "with the same algorithm.kl_coef (> 0 keeps a reference) as the saved one"
            )
        with torch.no_grad():
            self.model.load_state_dict(state["model"])
            if self.ref_model is not None:
                self.ref_model.load_state_dict(state["ref_model"])
        # Clone: torch's load_state_dict keeps references to the given tensors and Adam updates
        # them in place, which would corrupt the caller's copy.
        self.optimizer.load_state_dict(clone_tree(state["optimizer"]))
        grads = state["grads"]
        for n, p in self.model.named_parameters():
            p.grad = grads[n].clone().to(p.device) if n in grads else None
        self._version = int(state["version"])
        self._pending = int(state["pending"])
        self._metrics = dict(state["metrics"])
        torch.set_rng_state(state["rng"])
