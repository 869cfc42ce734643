"""Held-out evaluation of a team: every agent decodes greedily, in MEG order, over a batch of
problems; the team is correct when the workload says the output agent's answer is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flexmarl_core.meg import MEG
from flexmarl_core.workloads.api import Problem, Workload


def evaluate_team(
    meg: MEG,
    workload: Workload,
    engines: Mapping[str, Any],
    problems: Sequence[Problem],
    *,
    seed: int = 0,
) -> dict[str, Any]:
    """Greedy team rollout over `problems`; returns accuracy, mean reward per agent, outputs."""
    outputs: list[dict[str, str]] = [{} for _ in problems]
    for node in meg.nodes:
        agent = meg.agents[node.agent]
        prompts = [
            meg.render_prompt(node.agent, p.text, {q.agent: outputs[i][q.agent] for q in meg.parents[node]})
            for i, p in enumerate(problems)
        ]
        greedy = agent.sampling.model_copy(update={"temperature": 0.0})
        gens = engines[node.agent].generate(prompts, greedy, seed=seed)
        for i, g in enumerate(gens):
            outputs[i][node.agent] = g.text
    correct = [workload.is_correct(p, o) for p, o in zip(problems, outputs, strict=True)]
    rewards: dict[str, float] = {}
    for p, o in zip(problems, outputs, strict=True):
        for a, r in workload.reward(p, o).items():
            rewards[a] = rewards.get(a, 0.0) + r / len(problems)
    return {"accuracy": sum(correct) / max(len(correct), 1), "reward": rewards,
            "n": len(problems), "outputs": outputs}
