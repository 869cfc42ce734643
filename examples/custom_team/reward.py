"""Reward callables for the word-reversal team, named in config.yaml as `module:function`.

flexmarl calls each as `fn(problem, outputs)`: `problem.text` is the word list,
`problem.answer` the reversed list, `outputs` maps each agent to its final output text. Return
a number in 0..1 (1 = full marks; only full marks count as correct in held-out accuracy).
flexmarl adds the format term itself: reward = (1 - format_weight) * score + format_weight *
format.
"""

from __future__ import annotations

from flexmarl_core.workloads import Problem


def _positional_credit(text: str, answer: str) -> float:
    """Share of words in the right place: partial credit gives GRPO a gradient long before
    a tiny model gets whole answers right."""
    got, want = text.split(), answer.split()
    if not want:
        return 0.0
    hits = sum(g == w for g, w in zip(got, want, strict=False))
    # A longer output is penalised so that padding with extra words never pays.
    return hits / max(len(want), len(got))


def score(problem: Problem, outputs: dict[str, str]) -> float:
    """Team reward (`workload.reward`): the checker's final answer."""
    return _positional_credit(outputs.get("checker", ""), problem.answer)


def draft_score(problem: Problem, outputs: dict[str, str]) -> float:
    """The drafter's own reward (`workload.agent_rewards.drafter`, with credit: per_agent)."""
    return _positional_credit(outputs.get("drafter", ""), problem.answer)
