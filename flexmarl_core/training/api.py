"""Training contracts: samples, collated batches, loss callables and the trainer Protocol.

The trainer knows no RL (AReaL style): it turns a micro-batch into per-token logprobs, calls a
`loss_fn`, scales, backpropagates and steps. The algorithm lives in `loss_fn` and in the
advantages already stored on each `Sample`.

Loss normalisation is one constant fixed before any backward, so early (per micro-batch)
backward is exact:

    scale = ...                                   # known before the first micro-batch
    for mb in global_batch (in any order, whenever its rewards are in):
        trainer.accumulate(mb, loss_scale=scale)  # backward(loss_fn(mb) * scale)
    trainer.step()

`loss_fn` returns a *sum* over loss tokens, so the accumulated gradient equals the gradient of
the whole global batch's loss times `scale`, however the batch is split. Which constant:

- RL: 1 / (samples per global batch x max_new_tokens), from the config alone
  (`stages/train.loss_scale`; Dr. GRPO's normaliser, see `algorithms/losses.py` for how it
  departs from GRPO's per-sequence mean). A token-count normaliser would need every rollout
  of the batch before the first backward.
- SFT: `global_loss_scale(batch, trainer.loss_weight)` = 1 / (loss tokens of the global batch),
  the data being known up front.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class Sample:
    """One agent response to train on."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  #: behaviour ("old") logprobs, one per response token
    advantage: float  #: scalar advantage of the whole response
    #: per response token: 1 = train on it, 0 = not the policy's own token (e.g. tool output);
    #: None = all ones
    loss_mask: list[int] | None = None
    #: per response token advantages (GAE per token); None: `advantage` for every token
    token_advantages: list[float] | None = None


#: A micro-batch: whole GRPO groups, trained in one forward/backward.
MicroBatch = Sequence[Sample]


@dataclass(slots=True)
class TokenBatch:
    """A collated micro-batch, right padded. B samples, T = longest prompt+response,
    R = longest response. Response token j of row b is predicted by the logits at position
    `target_index[b, j]` (= prompt_len_b - 1 + j) of `input_ids`."""

    input_ids: torch.Tensor  #: (B, T) long, padded with pad_id
    attention_mask: torch.Tensor  #: (B, T) long, 1 on real tokens
    target_index: torch.Tensor  #: (B, R) long, 0 on padding
    response_ids: torch.Tensor  #: (B, R) long
    mask: torch.Tensor  #: (B, R) fp32 loss mask, 0 on padding
    old_logprobs: torch.Tensor  #: (B, R) fp32 behaviour logprobs, 0 on padding
    advantages: torch.Tensor  #: (B,) fp32, or (B, R) when a sample has token advantages
    ref_logprobs: torch.Tensor | None = None  #: (B, R) fp32, set by a trainer with a reference
    #: packed (`collate(pack=True)`): sample b sits in row `rows[b]` of `input_ids` (N rows <= B),
    #: its tokens' positions restarting at 0 (`position_ids`, (N, T)), which confines attention
    #: to each sample; `target_index` is then in row coordinates. None: one sample per row.
    rows: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    #: token cells of `input_ids` that hold no sample's token
    padded_tokens: int = 0
    #: shared prompts (`collate(share_prefix=True)`): (N, 1, T, T) bool, query q may attend to
    #: key k; what confines each response to its prompt and itself. None: attention from
    #: `position_ids` or the causal mask alone
    attend: torch.Tensor | None = None
    #: tokens of the samples that were not computed because their prompt was shared
    shared_tokens: int = 0


#: (logprobs (B, R) with grad, batch) -> (loss, metrics). The loss is a SUM over the units the
#: matching LossWeightFn counts; metrics are sums of the same kind (the trainer scales both).
LossFn = Callable[["torch.Tensor", TokenBatch], tuple["torch.Tensor", Mapping[str, Any]]]
#: micro-batch -> how many normalisation units it holds (e.g. loss tokens); summed over the
#: global batch *before* any backward to get the normaliser.
LossWeightFn = Callable[[MicroBatch], float]


@dataclass(frozen=True)
class TrainerOptions:
    """How a policy trainer is set up, whatever its backend (plain torch, DeepSpeed, a LoRA
    adapter): its loss, the loss's normaliser, the optimizer's settings and the temperature
    its logprobs are scored at (the sampling temperature). `training.options_for(agent)`
    reads them from an agent's config."""

    loss_fn: LossFn
    loss_weight_fn: LossWeightFn
    lr: float = 1e-4
    #: steps over which the rate rises linearly from lr / n to lr (0: none)
    lr_warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    #: forward and backward under bf16 autocast (master weights stay fp32)
    bf16: bool = False
    temperature: float = 1.0
    #: None: the model config's pad token (0 if it has none)
    pad_id: int | None = None
    #: several samples per row of a micro-batch, each attending only to itself (`collate`)
    packing: bool = False
    #: samples with one prompt (a GRPO group) encode it once (`collate(share_prefix=True)`)
    share_prefix: bool = False


@dataclass(slots=True)
class StepResult:
    """What one optimizer step did."""

    version: int  #: policy version after the step
    grad_norm: float  #: total grad norm before clipping
    num_micro_batches: int
    #: loss_fn metrics summed over micro-batches, each scaled by its loss_scale (with the
    #: default token normaliser: global per-token means)
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class TrainBackend(Protocol):
    """One agent's trainer (plain torch today; DeepSpeed behind the same calls)."""

    @property
    def version(self) -> int:
        """Optimizer steps taken = policy version of the current weights (0 = initial)."""
        ...

    def loss_weight(self, micro_batch: MicroBatch) -> float:
        """Normalisation units in `micro_batch` (the trainer's LossWeightFn)."""
        ...

    def accumulate(self, micro_batch: MicroBatch, loss_scale: float) -> dict[str, float]:
        """Forward + backward of `loss_fn(mb) * loss_scale`; gradients add up until `step`."""
        ...

    def step(self) -> StepResult:
        """Clip gradients, optimizer step, zero gradients, version += 1."""
        ...

    def logprobs(self, micro_batch: MicroBatch) -> list[list[float]]:
        """Recompute response-token logprobs with the current weights (no grad)."""
        ...

    def weights(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """A detached copy of the full state dict for inference (`lm_head.weight` included);
        `copy=False` may return the trainer's own tensors (the caller copies them out before
        the trainer changes)."""
        ...

    def state(self, *, copy: bool = True) -> dict[str, Any]:
        """Everything needed to resume bit-exactly (weights, optimizer, version, grads, RNG).
        `copy=False` may return the trainer's own tensors instead of copies (the caller writes
        them out before the trainer changes); a trainer may copy anyway."""
        ...

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore a `state()`; afterwards the trainer behaves exactly like the one saved."""
        ...


@runtime_checkable
class GradientTrainer(TrainBackend, Protocol):
    """A trainer whose gradient can leave it and join another's (`codesign.gradient_helpers`):
    one process holding the whole model as one flat buffer (the plain torch trainer)."""

    def set_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Hold `weights` as version `version` (a helper that never steps follows the agent)."""
        ...

    def take_grads(self) -> torch.Tensor:
        """The flat gradient accumulated so far, and zero it."""
        ...

    def add_grads(self, flat: torch.Tensor) -> None:
        """Add a flat gradient (another process's `take_grads`) to the accumulated one."""
        ...
