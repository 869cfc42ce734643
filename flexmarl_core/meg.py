"""MEG — the multi-agent execution graph.

The team is declared once (config or Python): agents are nodes, edges say whose output goes
into whose prompt. Multi-round teams (debate, refine) unroll into a DAG of `(agent, turn)`
nodes: a plain edge connects the same turn, a recurrent edge connects turn r to turn r+1.

Per training iteration the MEG is instantiated: inputs x G trajectories x nodes, each keyed by
`sample_id = "{input_id}:{traj}:{agent}:{turn}"` with the sample ids of its parents.

    meg = MEG.from_config(cfg.team)
    for node in meg.instantiate(["p0", "p1"], group_size=4):
        ...
"""

from __future__ import annotations

import string
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the config package checks teams through this module
    from flexmarl_core.config.agent import AgentConfig
    from flexmarl_core.config.models import EdgeConfig, TeamConfig

INPUT = "input"


class MEGError(ValueError):
    """An invalid team graph; the message names the agents involved."""


@dataclass(frozen=True, slots=True)
class NodeKey:
    """One unrolled node of the MEG: an agent in one round."""

    agent: str
    turn: int

    def __str__(self) -> str:
        return f"{self.agent}@{self.turn}"


@dataclass(frozen=True, slots=True)
class SampleNode:
    """One instantiated node: one agent call for one trajectory of one input."""

    sample_id: str
    input_id: str
    traj: int
    agent: str
    turn: int
    parents: tuple[str, ...]  #: sample ids whose outputs go into this prompt


def sample_id(input_id: str, traj: int, agent: str, turn: int) -> str:
    return f"{input_id}:{traj}:{agent}:{turn}"


def _template_fields(template: str) -> set[str]:
    try:
        return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise MEGError(f"bad prompt template {template!r}: {exc}") from None


@dataclass
class MEG:
    agents: dict[str, AgentConfig]
    edges: list[EdgeConfig]
    rounds: int = 1
    output: str | None = None
    #: graph: the edges are the data flow; flat (any other team shape, e.g. a program): one
    #: node per agent and no edges, the team deciding at run time who is called and how often
    flat: bool = False
    #: unrolled DAG, filled by validate()
    nodes: list[NodeKey] = field(default_factory=list)
    parents: dict[NodeKey, list[NodeKey]] = field(default_factory=dict)

    @classmethod
    def from_config(cls, team: TeamConfig) -> MEG:
        names = [a.name for a in team.agents]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise MEGError(f"duplicate agent name(s): {dupes}")
        meg = cls(
            agents={a.name: a for a in team.agents},
            edges=list(team.edges),
            rounds=team.rounds,
            output=team.output,
            flat=team.shape != "graph",
        )
        meg.validate()
        return meg

    # -- validation and unrolling -------------------------------------------------------------

    def validate(self) -> None:
        if not self.agents:
            raise MEGError("the team has no agents")
        for a in self.agents.values():
            if a.share_model_with is not None and a.share_model_with not in self.agents:
                raise MEGError(
                    f"agent {a.name!r}: share_model_with {a.share_model_with!r} is not an agent; "
                    f"agents: {sorted(self.agents)}"
                )
        if self.flat:
            # Each agent is one node whose calls (turns) the team makes; a program's edges are
            # discovered per call (`programs/capture.py`).
            self.nodes = [NodeKey(a, 0) for a in self.agents]
            self.parents = {n: [] for n in self.nodes}
            self.output = self.output or list(self.agents)[-1]
            if self.output not in self.agents:
                raise MEGError(f"team.output {self.output!r} is not an agent; agents: {sorted(self.agents)}")
            return
        untemplated = [a for a in self.agents.values() if a.template is None]
        if untemplated:
            raise MEGError(f"agent {untemplated[0].name!r} has no template: set team.agents[{untemplated[0].name}]"
                           ".template, or make the team a program (team.program)")
        for e in self.edges:
            for end in (e.src, e.dst):
                if end not in self.agents:
                    raise MEGError(
                        f"edge {e.src} -> {e.dst}: unknown agent {end!r}; agents: {sorted(self.agents)}"
                    )
            if e.src == e.dst and not e.recurrent:
                raise MEGError(f"edge {e.src} -> {e.dst}: an agent cannot feed itself in one round")
        seen: set[tuple[str, str, bool]] = set()
        for e in self.edges:
            key = (e.src, e.dst, e.recurrent)
            if key in seen:
                raise MEGError(f"duplicate edge {e.src} -> {e.dst}")
            seen.add(key)
        self._check_acyclic()
        self._unroll()
        self._check_templates()
        self._check_reachable()
        if self.output is None:
            sinks = [n for n in self.nodes if not self.children_of(n) and n.turn == self.rounds - 1]
            agents = sorted({n.agent for n in sinks})
            if len(agents) != 1:
                raise MEGError(
                    f"the team has {len(agents)} final agents {agents}: set team.output to the one "
                    "whose answer counts"
                )
            self.output = agents[0]
        elif self.output not in self.agents:
            raise MEGError(f"team.output {self.output!r} is not an agent; agents: {sorted(self.agents)}")

    def _check_acyclic(self) -> None:
        """Plain (same-round) edges must form a DAG; report one cycle by name."""
        adj: dict[str, list[str]] = defaultdict(list)
        for e in self.edges:
            if not e.recurrent:
                adj[e.src].append(e.dst)
        color: dict[str, int] = {}
        stack: list[str] = []

        def visit(u: str) -> None:
            color[u] = 1
            stack.append(u)
            for v in adj[u]:
                if color.get(v) == 1:
                    cyc = stack[stack.index(v) :] + [v]
                    raise MEGError(
                        "cycle in the team graph: " + " -> ".join(cyc)
                        + " (mark the back edge `recurrent: true` and set team.rounds to unroll it)"
                    )
                if v not in color:
                    visit(v)
            stack.pop()
            color[u] = 2

        for a in self.agents:
            if a not in color:
                visit(a)

    def _active(self, agent: str, turn: int) -> bool:
        mode = self.agents[agent].rounds
        return mode == "each" or (mode == "first" and turn == 0) or (
            mode == "last" and turn == self.rounds - 1
        )

    def _unroll(self) -> None:
        order = self._agent_topo_order()
        self.nodes = [NodeKey(a, t) for t in range(self.rounds) for a in order if self._active(a, t)]
        present = set(self.nodes)
        self.parents = {n: [] for n in self.nodes}
        for n in self.nodes:
            for e in self.edges:
                if e.dst != n.agent:
                    continue
                # A recurrent edge reads the previous round; a plain edge the same round. When the
                # source does not run in that round, it reads the source's latest earlier turn.
                start = n.turn - 1 if e.recurrent else n.turn
                for t in range(start, -1, -1):
                    src = NodeKey(e.src, t)
                    if src in present:
                        self.parents[n].append(src)
                        break

    def _agent_topo_order(self) -> list[str]:
        indeg = {a: 0 for a in self.agents}
        adj: dict[str, list[str]] = defaultdict(list)
        for e in self.edges:
            if not e.recurrent:
                adj[e.src].append(e.dst)
                indeg[e.dst] += 1
        # Stable: declaration order breaks ties, so the order users see is the one they wrote.
        ready = [a for a in self.agents if indeg[a] == 0]
        order: list[str] = []
        while ready:
            a = ready.pop(0)
            order.append(a)
            for b in adj[a]:
                indeg[b] -= 1
                if indeg[b] == 0:
                    ready.append(b)
        return order

    def _template(self, agent: str) -> str:
        t = self.agents[agent].template
        if t is None:
            raise MEGError(f"agent {agent!r} has no template")
        return t

    def _check_templates(self) -> None:
        for agent in self.agents:
            # Any agent with an edge into this one may appear in its template; in a turn where
            # that parent has not run yet (round 0 of a refine loop) it renders as "".
            allowed = {INPUT} | {e.src for e in self.edges if e.dst == agent}
            bad = sorted(_template_fields(self._template(agent)) - allowed)
            if bad:
                raise MEGError(
                    f"agent {agent!r}: template placeholder(s) {bad} are neither 'input' nor a "
                    f"parent agent; parents: {sorted(allowed - {INPUT})}"
                )

    def _check_reachable(self) -> None:
        reached: set[NodeKey] = set()
        for n in self.nodes:  # nodes are in topological order
            if INPUT in _template_fields(self._template(n.agent)) or any(
                p in reached for p in self.parents[n]
            ):
                reached.add(n)
        unreached = sorted({n.agent for n in self.nodes} - {n.agent for n in reached})
        if unreached:
            raise MEGError(
                f"agent(s) {unreached} are not reached by any input: use {{input}} in their "
                "template or add an edge from an agent that is"
            )

    # -- queries ------------------------------------------------------------------------------

    def topological_order(self) -> list[NodeKey]:
        return list(self.nodes)

    def call_order(self) -> dict[tuple[str, int], int]:
        """(agent, turn) -> its position in a trajectory's calls: the graph's order, round by
        round (GAE's chain and `credit: step_discount` both follow it)."""
        return {(n.agent, n.turn): i for i, n in enumerate(self.nodes)}

    def children_of(self, node: NodeKey) -> list[NodeKey]:
        return [n for n in self.nodes if node in self.parents[n]]

    @property
    def agent_names(self) -> list[str]:
        return list(dict.fromkeys(n.agent for n in self.nodes))

    @property
    def trainable_agents(self) -> list[str]:
        return [a for a in self.agent_names if self.agents[a].trainable]

    def agent_parents(self, agent: str) -> list[str]:
        return sorted({p.agent for n in self.nodes if n.agent == agent for p in self.parents[n]})

    # -- instantiation ------------------------------------------------------------------------

    def instantiate(self, input_ids: Iterable[str], group_size: int) -> list[SampleNode]:
        """All sample nodes of one iteration, in an order where parents come first."""
        out = []
        for input_id in input_ids:
            if ":" in input_id:
                raise MEGError(f"input id {input_id!r} must not contain ':' (used in sample ids)")
            for traj in range(group_size):
                for n in self.nodes:
                    out.append(
                        SampleNode(
                            sample_id=sample_id(input_id, traj, n.agent, n.turn),
                            input_id=input_id,
                            traj=traj,
                            agent=n.agent,
                            turn=n.turn,
                            parents=tuple(
                                sample_id(input_id, traj, p.agent, p.turn) for p in self.parents[n]
                            ),
                        )
                    )
        return out

    def render_prompt(self, agent: str, input_text: str, parent_outputs: Mapping[str, str]) -> str:
        """Fill `agent`'s template from the input and its parents' outputs (keyed by agent); the
        model sees it in the agent's chat format (`teams.graph.prompt`). A declared parent with
        no output in this turn (not run yet) renders as ""."""
        declared = {e.src: "" for e in self.edges if e.dst == agent}
        values = {**declared, INPUT: input_text, **parent_outputs}
        try:
            return self._template(agent).format_map(values)
        except KeyError as exc:
            raise MEGError(
                f"agent {agent!r}: template needs {exc.args[0]!r} but only {sorted(values)} are available"
            ) from None
