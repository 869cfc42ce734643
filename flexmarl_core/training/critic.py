"""The critic's trainer: a trainable value head on a frozen copy of a base model (MARFT's
critic: arXiv:2504.16129), stepped like an agent's trainer (accumulate micro-batches with a
fixed loss scale, then one step per iteration) and checkpointed, swapped and replayed through
the same `TrainBackend` calls.

The value of an observation is read at its last prompt token (one value per call), or, per
token, at the position before each response token (the prompt plus the response so far),
with a one-hot of the calling agent beside the base's hidden state. The base only reads: its
features are computed without gradients (and kept per micro-batch until the step, whose
further epochs reuse them), so a step costs one forward of the base and the head's updates.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flexmarl_core.algorithms.gae import value_loss
from flexmarl_core.training.api import StepResult
from flexmarl_core.training.torch_trainer import clone_tree


@dataclass(slots=True)
class ValueSample:
    """One call to value (and, in training, its targets)."""

    prompt_ids: list[int]  #: the observation: task plus the outputs of the calls before it
    response_ids: list[int]  #: the call's response (per-token values read along it)
    agent: str = ""  #: whose call (per-agent metrics)
    #: the critic's values when the advantages were computed (1, or 1 per response token)
    old_values: Sequence[float] = ()
    returns: Sequence[float] = ()  #: GAE returns, the regression targets (same length)


class ValueHead(nn.Module):
    def __init__(self, width: int, hidden: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        layers: list[nn.Module] = [nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, 1)] if hidden \
            else [nn.Linear(width, 1)]
        self.net = nn.Sequential(*layers)
        with torch.no_grad():  # seeded, and the output layer starts at 0: V = 0 before any step
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * width ** -0.5)
            self.net[-1].weight.zero_()
            self.net[-1].bias.zero_()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.net(h).squeeze(-1)


class CriticTrainer:
    """A value model's trainer: frozen `base` (a causal LM) + `ValueHead`, AdamW on the head."""

    def __init__(self, base: nn.Module, *, hidden: int, per_token: bool, lr: float,
                 max_grad_norm: float, value_clip: float | None, seed: int, pad_id: int = 0,
                 agents: Sequence[str] = ()) -> None:
        self.base = base.float().eval().requires_grad_(False)
        self.backbone = getattr(base, "base_model", base)  # the transformer without its LM head
        #: the agents whose calls it values: a one-hot of the caller joins the features, so a
        #: shared critic knows whose turn it values (MARFT's agent ids)
        self.agents = list(agents)
        self.head = ValueHead(int(base.config.hidden_size) + len(self.agents), hidden, seed)
        self.per_token = per_token
        self.max_grad_norm = max_grad_norm
        self.value_clip = value_clip
        self.pad_id = pad_id
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=lr)
        self._version = 0
        self._pending = 0
        self._cache: dict[Hashable, tuple[torch.Tensor, list[int]]] = {}

    @property
    def version(self) -> int:
        return self._version

    def _positions(self, s: ValueSample) -> list[int]:
        p = len(s.prompt_ids)
        return list(range(p - 1, p - 1 + len(s.response_ids))) if self.per_token else [p - 1]

    def _features(self, samples: Sequence[ValueSample]) -> tuple[torch.Tensor, list[int]]:
        """(K, H) hidden states at every valued position of `samples`, and positions per sample."""
        if not samples:
            raise ValueError("no sample to value")
        seqs = [s.prompt_ids + (s.response_ids if self.per_token else []) for s in samples]
        ids = torch.full((len(seqs), max(len(q) for q in seqs)), self.pad_id, dtype=torch.long)
        for b, q in enumerate(seqs):
            ids[b, :len(q)] = torch.tensor(q, dtype=torch.long)
        with torch.no_grad():  # right padding: the causal mask already hides every pad
            hidden = self.backbone(input_ids=ids).last_hidden_state
        rows, cols, counts = [], [], []
        for b, s in enumerate(samples):
            pos = self._positions(s)
            rows += [b] * len(pos)
            cols += pos
            counts.append(len(pos))
        feats = hidden[rows, cols].float()
        if self.agents:
            who = torch.zeros(len(rows), len(self.agents))
            for i, b in enumerate(rows):
                if samples[b].agent not in self.agents:
                    raise ValueError(f"a call of agent {samples[b].agent!r}, which this critic does not "
                                     f"value (it values {self.agents})")
                who[i, self.agents.index(samples[b].agent)] = 1.0
            feats = torch.cat([feats, who], dim=1)
        return feats, counts

    def values(self, samples: Sequence[ValueSample]) -> list[list[float]]:
        """Per sample its values (one, or one per response token), without gradients."""
        feats, counts = self._features(samples)
        with torch.no_grad():
            flat = self.head(feats).tolist()
        out, k = [], 0
        for n in counts:
            out.append(flat[k:k + n])
            k += n
        return out

    def _cached(self, samples: Sequence[ValueSample], key: Hashable | None) -> tuple[torch.Tensor, list[int]]:
        """The features of `samples`, kept under `key` until the step (the base is frozen, so a
        later epoch over the same micro-batch needs no forward of it)."""
        if key is None:
            return self._features(samples)
        if key not in self._cache:
            self._cache[key] = self._features(samples)
        return self._cache[key]

    def accumulate(self, samples: Sequence[ValueSample], loss_scale: float,
                   key: Hashable | None = None) -> dict[str, float]:
        """Backward of the clipped value loss summed over `samples` times `loss_scale` (`key`:
        the micro-batch, whose features the step's later epochs reuse). Returns per agent
        `value_loss/<agent>` (its samples' loss sum, scaled) and the total."""
        out = self._backward(samples, loss_scale, key)
        self._pending += 1
        return out

    def _backward(self, samples: Sequence[ValueSample], loss_scale: float, key: Hashable | None) -> dict[str, float]:
        feats, counts = self._cached(samples, key)
        v = self.head(feats)
        old = torch.tensor([x for s in samples for x in s.old_values], dtype=torch.float32)
        ret = torch.tensor([x for s in samples for x in s.returns], dtype=torch.float32)
        if old.numel() != v.numel() or ret.numel() != v.numel():
            raise ValueError(f"{v.numel()} valued positions but {old.numel()} old values and "
                             f"{ret.numel()} returns")
        per = value_loss(v, old, ret, clip=self.value_clip)
        (per.sum() * loss_scale).backward()
        out: dict[str, float] = {"value_loss": float(per.detach().sum()) * loss_scale}
        k = 0
        for s, n in zip(samples, counts, strict=True):
            name = f"value_loss/{s.agent}"
            out[name] = out.get(name, 0.0) + float(per[k:k + n].detach().sum()) * loss_scale
            k += n
        return out

    def _update(self) -> float:
        norm = float(torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.max_grad_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def step(self, epochs: Sequence[Sequence[tuple[Hashable, Sequence[ValueSample]]]] = (),
             loss_scale: float = 1.0) -> StepResult:
        """Apply the accumulated gradient (the iteration's first pass over its micro-batches),
        then one update per micro-batch of each further epoch in `epochs` (PPO's several
        critic passes over a batch), all before the version moves: an error while reading the
        batches leaves the trainer as it was."""
        if self._pending == 0:
            raise ValueError("step() called with no accumulated micro-batch")
        norm = self._update()
        for epoch in epochs:
            for key, batch in epoch:
                self._backward(batch, loss_scale, key)
                self._update()
        self._cache.clear()
        n, self._pending = self._pending, 0
        self._version += 1
        return StepResult(version=self._version, grad_norm=norm, num_micro_batches=n)

    def weights(self, *, copy: bool = True) -> dict[str, torch.Tensor]:  # always copies
        """The head's weights (the base is the frozen copy every process rebuilds)."""
        return {k: v.detach().clone() for k, v in self.head.state_dict().items()}

    def state(self, *, copy: bool = True) -> dict[str, Any]:  # always copies
        opt = self.optimizer.state_dict()
        params = list(self.head.parameters())
        return {
            "version": self._version, "pending": self._pending,
            "head": self.weights(),
            "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
            # a list in parameter order: the state's files keep no integer dict keys
            "adam": [clone_tree(opt["state"].get(i)) for i in range(len(params))],
            "param_groups": clone_tree(opt["param_groups"]),
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        self._cache.clear()  # features kept for another state's micro-batches
        self.head.load_state_dict(state["head"])
        params = list(self.head.parameters())
        for p, g in zip(params, state["grads"], strict=True):
            p.grad = None if g is None else g.clone()
        groups = [{**g, "betas": tuple(g["betas"])} for g in state["param_groups"]]
        self.optimizer.load_state_dict({
            "state": {i: s for i, s in enumerate(state["adam"]) if s is not None},
            "param_groups": groups,
        })
        self._version = int(state["version"])
        self._pending = int(state["pending"])
