"""The graph team: agents with prompt templates, edges that feed one agent's answer into
another's prompt, rounds unrolled into a DAG (`meg.py`). Each iteration rolls out node by node,
one `rollout` op per node and micro-batch, then one `reward` op per micro-batch scores the
trajectories.

    rollout(planner, mb) ─► rollout(solver, mb) ─► rollout(verifier, mb) ─► reward(mb)
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flexmarl_core.inference.tools import generate_with_tool, tool_of
from flexmarl_core.meg import MEG
from flexmarl_core.ops import Op
from flexmarl_core.programs.chat import as_turns
from flexmarl_core.runfiles.location import reward_key
from flexmarl_core.teams.api import Demonstrations, Generation, PlanView, RunView, register_shape

if TYPE_CHECKING:
    from flexmarl_core.config import ExperimentConfig
    from flexmarl_core.workloads.api import Problem, Workload


@register_shape("graph")
class GraphTeam:
    """A team declared as a graph (`team.agents` with templates, `team.edges`, `team.rounds`)."""

    trajectory_groups = False

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.meg = MEG.from_config(cfg.team)
        self.group_size = cfg.batch.group_size

    def generation(self, plan: PlanView, it: int) -> Generation:
        """A rollout waits for its parents' rollouts of its micro-batch (without
        `dependency_parallel`: of every micro-batch) and for the weights that gate its agent;
        a reward for its micro-batch's rollouts (or all). `serial`: a turn's rollouts also
        wait for every rollout of the turn before it, one agent at a time."""
        meg, mbs = self.meg, range(plan.num_mb)
        rollouts = {(n.agent, n.turn, j): Op(it, "rollout", n.agent, n.turn, j) for n in meg.nodes for j in mbs}
        deps: dict[Op, list[Op]] = {}
        for n in meg.nodes:
            gate = plan.gate(it, n.agent)
            for j in mbs:
                d: list[Op] = []
                for p in meg.parents[n]:
                    if plan.dependency_parallel:
                        d.append(rollouts[(p.agent, p.turn, j)])
                    else:
                        d.extend(rollouts[(p.agent, p.turn, k)] for k in mbs)
                deps[rollouts[(n.agent, n.turn, j)]] = d + gate
        for j in mbs:
            deps[Op(it, "reward", mb=j)] = (
                [op for (_, _, k), op in rollouts.items() if k == j] if plan.dependency_parallel
                else list(rollouts.values()))
        if plan.serial:
            for prev, node in zip(meg.nodes, meg.nodes[1:], strict=False):
                before = [rollouts[(prev.agent, prev.turn, j)] for j in mbs]
                for j in mbs:
                    d = deps[rollouts[(node.agent, node.turn, j)]]
                    d += [b for b in before if b not in d]
        return Generation(deps, [[Op(it, "reward", mb=j)] for j in mbs])

    def expected_ids(self, run: RunView, it: int, mbs: Sequence[int], agent: str, *,
                     trained: bool = True) -> set[str]:
        """Every (input, trajectory, turn) of the agent in the micro-batches' inputs; `trained`:
        but those of trajectories whose reward failed (the reward manifest)."""
        inputs = [r["input_id"] for j in mbs for r in run.inputs(it, j)]
        failed = {(f["input_id"], f["traj"]) for j in mbs for f in _failed(run, it, j)} if trained else set()
        return {n.sample_id for n in self.meg.instantiate(inputs, self.group_size)
                if n.agent == agent and (n.input_id, n.traj) not in failed}

    def outputs(self, workload: Workload, engines: Mapping[str, Any], problems: Sequence[Problem],
                *, seed: int, greedy: bool) -> list[dict[str, str]]:
        """Every agent decodes the batch in graph order, each prompt rendered from the
        problem and its parents' answers (an agent with a tool calls it mid-answer)."""
        meg = self.meg
        outputs: list[dict[str, str]] = [{} for _ in problems]
        for node in meg.nodes:
            agent = meg.agents[node.agent]
            prompts = [
                prompt(meg, node.agent, p.text, {q.agent: outputs[i][q.agent] for q in meg.parents[node]})
                for i, p in enumerate(problems)
            ]
            sampling = agent.sampling.model_copy(update={"temperature": 0.0}) if greedy else agent.sampling
            gens = generate_with_tool(engines[node.agent], prompts, sampling, seed, tool_of(workload, node.agent))
            for i, g in enumerate(gens):
                outputs[i][node.agent] = g.text
        return outputs

    def demonstrations(self, workload: Workload, problems: Sequence[Problem], *, seed: int,
                       rng: random.Random, perturb: float) -> Demonstrations:
        """The chain teacher-forced along the graph: each prompt rendered from the parents'
        demonstrated answers, which a child sometimes sees replaced by a realistic mistake."""
        meg = self.meg
        out: Demonstrations = {a: [] for a in meg.agent_names}
        can_perturb = hasattr(workload, "perturbation")
        for p in problems:
            outputs: dict[str, str] = {}
            for node in meg.nodes:
                parents = {q.agent: outputs[q.agent] for q in meg.parents[node]}
                shown_prompt = prompt(meg, node.agent, p.text, parents)
                target = workload.demonstration(p, node.agent, parents)
                out[node.agent].append((shown_prompt, target))
                shown = target
                if can_perturb and perturb > 0 and rng.random() < perturb and meg.children_of(node):
                    shown = workload.perturbation(p, node.agent, rng)  # type: ignore[attr-defined]
                outputs[node.agent] = shown
        return out

    def call_order(self) -> dict[tuple[str, int], int]:
        return self.meg.call_order()


def prompt(meg: MEG, agent: str, text: str, parents: Mapping[str, str]) -> str:
    """What `agent`'s model sees: its template filled (`MEG.render_prompt`), as the user turn
    after its `system` in its chat format (`programs.chat.as_turns`) unless that is `plain`."""
    filled = meg.render_prompt(agent, text, parents)
    a = meg.agents[agent]
    return filled if a.chat_template == "plain" else as_turns(a, filled)


def _failed(run: RunView, it: int, mb: int) -> list[dict[str, Any]]:
    """The trajectories of a micro-batch whose reward failed (`stages/reward.py`)."""
    try:
        return list(json.loads(run.loc.read_text(reward_key(it, mb)))["failed"])
    except FileNotFoundError:
        return []
