"""A finished (or running) run opened for reading its team: its config, the weight versions it
keeps per agent, and which version of each agent a request names.

A version `v` is the weights after `v` optimizer steps: iteration `v` rolls out with it, and a
run of T iterations ends with version T. A frozen agent has only version 0. Retention deletes
most versions as a run goes (`driver/retention.py`); what is left on disk is what can be read.
While the run still trains, a version it keeps now may be deleted a moment later, so only the
versions it keeps for good are read then: version 0, every `train.keep_every`-th, and the last.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flexmarl_core.config import AgentConfig, ConfigError, ExperimentConfig, config_from_text
from flexmarl_core.driver.lease import Lease, read_lease
from flexmarl_core.runfiles.location import CONFIG_NAME, RunLocation, is_uri

LATEST = "latest"


class RunReadError(ValueError):
    """A run, agent or version that cannot be read as asked; one line naming it."""


@dataclass
class TrainedRun:
    """A run's location and config, opened for reading its weights."""

    loc: RunLocation
    cfg: ExperimentConfig

    @classmethod
    def open(cls, where: str) -> TrainedRun:
        try:
            loc = RunLocation(where)
            has_config = loc.is_file(CONFIG_NAME)
        except (OSError, ValueError) as exc:  # an unreachable store, a scheme pyarrow lacks
            raise RunReadError(f"{where}: cannot read it: {' '.join(str(exc).split())[:300]}") from None
        if not has_config:
            raise RunReadError(f"{where}: not a flexmarl run folder (no {CONFIG_NAME})")
        try:
            cfg = config_from_text(loc.read_text(CONFIG_NAME), source=loc.display(CONFIG_NAME))
        except ConfigError as exc:
            raise RunReadError(str(exc)) from None
        return cls(loc, cfg)

    @property
    def where(self) -> str:
        return self.loc.uri

    def agents(self, names: Sequence[str] | None = None) -> list[AgentConfig]:
        """The run's agents named in `names` (all, in team order, if none)."""
        have = [a.name for a in self.cfg.team.agents]
        for n in names or ():
            if n not in have:
                raise RunReadError(f"{self.where}: no agent {n!r} in this run; its agents: {have}")
        return [a for a in self.cfg.team.agents if not names or a.name in names]

    def kept(self, agent: str) -> list[int]:
        """The weight versions of `agent` on disk now, ascending."""
        return self.loc.versions(f"weights/{agent}")

    def training(self) -> Lease | None:
        """The lease of the live run still training in this folder, if any."""
        lease = read_lease(self.loc)
        return lease if lease is not None and lease.alive() else None

    def for_good(self, versions: Sequence[int]) -> list[int]:
        """Of `versions`, those the run never deletes (the module docstring)."""
        every, last = self.cfg.train.keep_every, self.cfg.train.iterations
        return [v for v in versions if v == 0 or v == last or (every is not None and v % every == 0)]

    def resolve(self, agents: Sequence[AgentConfig], version: int | str = LATEST) -> dict[str, int]:
        """The version each agent is read at: `version` (an int, or `latest`: the newest that
        every trainable one of `agents` has) for trainable agents, 0 for frozen ones. Refuses a
        version not kept (naming the kept ones) and, while the run trains, one it may still delete."""
        live = self.training()
        trainable = [a.name for a in agents if a.trainable]
        readable = {a: self.kept(a) for a in trainable}
        if live is not None:
            readable = {a: self.for_good(vs) for a, vs in readable.items()}
        if version == LATEST:
            common = set.intersection(*(set(vs) for vs in readable.values())) if readable else {0}
            if not common:
                raise RunReadError(f"{self.where}: no weights version that every agent of {trainable} has; "
                                   f"kept: {readable}")
            at = max(common)
        else:
            at = int(version)
            for a, vs in readable.items():
                if at in vs:
                    continue
                kept = self.kept(a)
                if live is not None and at in kept:
                    raise RunReadError(
                        f"{self.where}: the run is still training ({live.owner()}), and version {at} of agent "
                        f"{a!r} may be deleted as it goes; read one it keeps for good: {vs}")
                why = ("the run has not reached it" if at > max(kept, default=0)
                       else "retention deleted it (train.keep_every keeps more)")
                raise RunReadError(f"{self.where}: agent {a!r} has no weights version {at}: {why}; "
                                   f"versions kept: {kept}")
        for a in agents:  # a frozen agent's version 0 is there from the start
            if not a.trainable and 0 not in self.kept(a.name):
                raise RunReadError(f"{self.where}: agent {a.name!r} has no weights version 0")
        return {a.name: at if a.trainable else 0 for a in agents}

    def summary(self) -> dict[str, Any]:
        """The summary the run wrote at its end (held-out figures), if this machine has it: in
        the run folder, or in the local scratch folder of a run on object storage."""
        key = "metrics/summary.json"
        try:
            if self.loc.is_file(key):
                return dict(json.loads(self.loc.read_text(key))["summary"])
            local = self.loc.scratch_dir() / key
            if not is_uri(self.where) or not local.is_file():
                return {}
            return dict(json.loads(local.read_text())["summary"])
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def heldout(self, version: int) -> dict[str, Any]:
        """The run's own held-out figures of the weights `version` (the initial or the final
        evaluation), on the set it names; empty if it measured none there."""
        s = self.summary()
        prefix = "initial_" if version == 0 else "" if version == self.cfg.train.iterations else None
        if prefix is None or f"{prefix}heldout_accuracy" not in s:
            return {}
        out = {k.removeprefix(prefix): v for k, v in s.items()
               if k.startswith(f"{prefix}heldout") and not (prefix == "" and k.startswith("heldout_gain"))}
        if "heldout_set" in s:
            out["heldout_set"] = s["heldout_set"]
        return out
