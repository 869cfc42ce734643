"""A program's calls -> the MEG Store rows of its agents.

Every answered call (choice) of a trajectory is a `CallRecord`. Per agent, in call order:

- a call whose prompt tokens start with an earlier sample's prompt + response tokens of the
  same agent and policy version *continues* that sample: the tokens in between (what the
  program inserted: a tool's output, another agent's message, the chat template's turn
  markers) join its response with `loss_mask` 0 and log-prob 0, then this call's sampled
  tokens with mask 1 — one multi-turn sample, trained as a tool loop's sample is;
- any other call starts a sample of its own.

A sample's id is `{input_id}:{traj}:{agent}:{turn}` with `turn` the index of its first call
among the agent's calls in the trajectory; `extra.calls` lists the calls merged into it, and
`parents` the samples answered before its first call was made (the edges the program took).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexmarl_core.meg import sample_id
from flexmarl_core.programs.api import CallRecord, TrajectoryResult


@dataclass
class _Sample:
    agent: str
    turn: int
    version: int
    prompt_ids: list[int]
    prompt_text: str
    response_ids: list[int]
    logprobs: list[float]
    mask: list[int]
    texts: list[str]
    calls: list[int] = field(default_factory=list)
    records: list[int] = field(default_factory=list)  #: indices into the trajectory's records

    @property
    def full(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def _continues(s: _Sample, rec: CallRecord) -> bool:
    full = s.full
    return (s.agent == rec.agent and s.version == rec.gen.version and len(rec.prompt_ids) >= len(full)
            and rec.prompt_ids[: len(full)] == full)


def merge_calls(records: Sequence[CallRecord], decode: Callable[[str, list[int]], str]) -> list[_Sample]:
    """The samples of one trajectory's calls (module docstring); `decode(agent, ids)` renders
    the inserted tokens of a continued sample into its response text."""
    samples: list[_Sample] = []
    for i in sorted(range(len(records)), key=lambda i: (records[i].agent, records[i].call)):
        rec, g = records[i], records[i].gen
        mask = list(g.loss_mask) if g.loss_mask is not None else [1] * len(g.response_ids)
        prev = next((s for s in reversed(samples) if _continues(s, rec)), None)
        if prev is None:
            samples.append(_Sample(rec.agent, rec.call, g.version, list(rec.prompt_ids), rec.prompt_text,
                                   list(g.response_ids), list(g.logprobs), mask, [g.text], [rec.call], [i]))
            continue
        inserted = rec.prompt_ids[len(prev.full):]
        prev.response_ids += inserted + list(g.response_ids)
        prev.logprobs += [0.0] * len(inserted) + list(g.logprobs)
        prev.mask += [0] * len(inserted) + mask
        prev.texts += [decode(rec.agent, inserted), g.text]
        prev.calls.append(rec.call)
        prev.records.append(i)
    return samples


def trajectory_rows(res: TrajectoryResult,
                    decode: Callable[[str, list[int]], str]) -> dict[str, list[dict[str, Any]]]:
    """Per agent, the sample rows of one trajectory (rewards come later, as status rows)."""
    samples = merge_calls(res.records, decode)
    owner = {i: s for s in samples for i in s.records}
    out: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        first = res.records[s.records[0]]
        parents = sorted({sample_id(res.input_id, res.traj, owner[j].agent, owner[j].turn)
                          for j in first.after if owner[j] is not s})
        out.setdefault(s.agent, []).append({
            "sample_id": sample_id(res.input_id, res.traj, s.agent, s.turn),
            "input_id": res.input_id, "traj": res.traj, "turn": s.turn, "mb": res.mb,
            "policy_version": s.version, "parents": parents,
            "prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "logprobs": s.logprobs,
            "loss_mask": None if all(s.mask) else s.mask,
            "prompt_text": s.prompt_text, "response_text": "".join(s.texts),
            "extra": json.dumps({"calls": s.calls}),
        })
    return out


def last_outputs(res: TrajectoryResult) -> dict[str, str]:
    """Each agent's last answered text in the trajectory (what the workload's per-agent
    terms read), the program's answer as the output agent's is set by the caller."""
    out: dict[str, str] = {}
    for rec in sorted(res.records, key=lambda r: r.t_end):
        out[rec.agent] = rec.gen.text
    return out
