"""Inference contracts: what a rollout engine takes and returns. Protocols and data types only.

Boundary: an engine takes prompt strings (or prompt token ids) and returns token ids + text.
Prompt formatting (templates, chat turns) is the caller's job, not the engine's.

Logprob contract (shared with the trainer, see `flexmarl_core.models.logprobs`): `logprobs[i]`
is log softmax(logits / T)[response_ids[i]] in fp32, with T the sampling temperature (1 for
greedy) and no top-p truncation. A trainer holding the same weights recomputes the same values
(fp32: within 1e-4), so PPO ratios start at 1 on-policy. A bf16 engine (`model.dtype`) scores
with bf16 logits: expect ~1e-2 differences from an fp32 trainer.

Stop strings: `text` is the decoded response cut *before* the first stop string (as vLLM does);
`response_ids`/`logprobs` keep the sampled tokens up to and including the token that completed
the stop string, so the policy is trained to emit the stop. A final EOS token is likewise kept in
`response_ids` (finish_reason "eos") and left out of `text`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from flexmarl_core.config import LoraSpec, SamplingConfig

#: why a response ended: EOS token, a stop string, or max_new_tokens
FinishReason = Literal["eos", "stop", "length"]


@dataclass(slots=True)
class Generation:
    """One sampled response."""

    prompt_ids: list[int]  #: the prompt as the model saw it (no padding)
    response_ids: list[int]  #: sampled tokens, see the stop-string rule in the module docstring
    text: str  #: decoded response, cut before the first stop string, without the final EOS
    logprobs: list[float]  #: one per response token (module docstring gives the definition)
    finish_reason: FinishReason
    version: int  #: policy version of the weights that produced it (on-policy check)
    #: per response token: 1 = sampled, 0 = inserted by a tool (`inference/tools.py`);
    #: None = all sampled
    loss_mask: list[int] | None = None
    #: per response token: the weights version that sampled it, when the generation spans a
    #: weight update (partial rollouts, `HFInferenceEngine.generate_partial`); None = all `version`
    token_versions: list[int] | None = None


@dataclass(slots=True)
class DecodeClock:
    """Seconds an engine spent in its decodes, summed over its life (the HF engine keeps one as
    `clock`): a caller reads it before and after a decode and takes the difference."""

    #: forward passes over prompts: the first prefill, and a partial rollout's re-prefills
    prefill_s: float = 0.0
    #: whole decodes: tokenizing, prefill, every decode step and sampling, building the outputs
    generate_s: float = 0.0

    def since(self, before: DecodeClock) -> dict[str, float]:
        """What was spent since `before` (an earlier `copy()`), as `prefill_s` and `generate_s`."""
        return {"prefill_s": self.prefill_s - before.prefill_s, "generate_s": self.generate_s - before.generate_s}

    def copy(self) -> DecodeClock:
        return DecodeClock(self.prefill_s, self.generate_s)

    @contextlib.contextmanager
    def prefilling(self, device: torch.device) -> Iterator[None]:
        """Add the block's seconds to `prefill_s`, the device's queued work included."""
        t0 = synced_now(device)
        yield
        self.prefill_s += synced_now(device) - t0


def synced_now(device: torch.device | None = None) -> float:
    """perf_counter once `device` finished its queued work (a GPU runs kernels asynchronously)."""
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return time.perf_counter()


@runtime_checkable
class InferenceBackend(Protocol):
    """A rollout engine for one agent (HF today; vLLM behind the same calls)."""

    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded (0 = initial weights)."""
        ...

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int,
    ) -> list[Generation]:
        """Sample one response per prompt. Same weights, prompts, sampling and seed give the
        same outputs. Repeat a prompt G times for a GRPO group."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights (a full state dict, `lm_head.weight` included) tagged `version`."""
        ...


@runtime_checkable
class PartialBackend(InferenceBackend, Protocol):
    """An engine that resumes a decode under newer weights (`codesign.partial_rollouts`; the HF
    engine)."""

    def generate_partial(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int,
        refresh: Callable[[], bool],
        every: int = 16,
    ) -> list[Generation]:
        """`generate`, calling `refresh` every `every` decode steps; when it loaded newer
        weights, the rows still decoding resume under them (their tokens keep their versions)."""
        ...


@runtime_checkable
class SharedBaseBackend(Protocol):
    """One engine for every LoRA agent on a base (HF or vLLM): a weights version per adapter;
    each agent sees it through its own `view`."""

    #: agent -> the weights version of its adapter here
    versions: dict[str, int]

    def add(self, agent: str, spec: LoraSpec, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Give `agent` an adapter (`spec`) holding `state` as `version`."""
        ...

    def update_adapter(self, agent: str, state: Mapping[str, torch.Tensor], version: int) -> None: ...

    def view(self, agent: str) -> InferenceBackend:
        """`agent`'s engine on this base."""
        ...

    def generate_requests(
        self, requests: Sequence[tuple[str, Sequence[str] | Sequence[Sequence[int]], SamplingConfig, int]]
    ) -> list[list[Generation]]:
        """One decode for several (agent, prompts, sampling, seed) requests, each row through its
        agent's adapter; each request gets the tokens it would get alone."""
        ...
