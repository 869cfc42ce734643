"""The trainers of a run and their kinds: each trainable agent's policy and, for a team whose
agents use `algorithm.advantage: gae`, its critics, with what each critic values (no torch
here: config checks read it).

A critic is a trainer like an agent's, with a name of its own: `critic` (one for the team,
`critic.shared: true`, MARFT) or `critic-<agent>` (one per agent, MARTI's independent
critics). Its ops in the plan (`orchestrator/plan.py`):

    reward(it, mb) ─► value(c, it, mb) ─► train(c, it, mb) ─► step(c, it) ─► sync(c, it) ─► value(c, it+1, *)
                              └────────► train(agent, it, mb)   (every agent the critics value)

`value` writes the critic's values of the micro-batch's calls to the store (status field
`value`, per token `token_values`) with the critic at version `it`; every train op then
computes the same GAE from the stored rewards and values (`trainers/critic.py` `targets`). The
chain runs over the trainable agents' calls in the team's call order (`TeamShape.call_order`:
a graph's order, round after round), so per-agent critics still chain: each call is valued by
its own agent's critic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flexmarl_core.config import ExperimentConfig

SHARED = "critic"


def critic_names(cfg: ExperimentConfig) -> dict[str, list[str]]:
    """Critic name -> the trainable agents whose calls it values (team order); {} without gae."""
    agents = [a.name for a in cfg.team.agents if a.trainable and a.algorithm.advantage == "gae"]
    if not agents:
        return {}
    if cfg.critic.shared:
        return {SHARED: agents}
    return {f"critic-{a}": [a] for a in agents}


def critic_of(cfg: ExperimentConfig, agent: str) -> str:
    """The critic that values `agent`'s calls."""
    for c, agents in critic_names(cfg).items():
        if agent in agents:
            return c
    raise KeyError(f"agent {agent!r} has no critic (its algorithm.advantage is not gae)")


def trainer_kinds(cfg: ExperimentConfig) -> dict[str, str]:
    """Every trainer of the run -> its kind (`trainers/kinds.py`): each trainable agent's
    policy, each critic."""
    return {**{a.name: "policy" for a in cfg.team.agents if a.trainable},
            **dict.fromkeys(critic_names(cfg), "critic")}


def base_agent(cfg: ExperimentConfig, critic: str) -> str:
    """The agent whose initial weights the critic's frozen base copies."""
    agents = critic_names(cfg)[critic]
    return cfg.critic.base or agents[0] if critic == SHARED else agents[0]


def critic_problems(cfg: ExperimentConfig) -> list[str]:
    """What makes a gae team (or step_discount credit) unrunnable, one sentence each naming the
    field (`config/load.py` `load_config`): both need the graph's call order."""
    out = []
    if cfg.workload.credit == "step_discount" and cfg.team.shape != "graph":
        out.append(f"workload.credit step_discount needs the call order of a YAML team's graph; a "
                   f"{cfg.team.shape} team's calls are not ordered across agents in the store: use team or per_agent")
    trainable = [a.name for a in cfg.team.agents if a.trainable]
    gae = [a for a in trainable if cfg.agent(a).algorithm.advantage == "gae"]
    if not gae:
        return out
    others = [a for a in trainable if a not in gae]
    if others:
        out.append(f"agents {gae} use algorithm.advantage gae but {others} do not: a critic's GAE "
                   "chains every trainable agent's calls, so give them all gae (or none)")
    if cfg.team.shape != "graph":
        out.append(f"algorithm.advantage gae needs the call order of a YAML team's graph; a {cfg.team.shape} "
                   "team's calls are not ordered across agents in the store: use grpo"
                   + (" or rae" if cfg.team.shape == "environment" else ""))
    names = {a.name for a in cfg.team.agents}
    clash = sorted(names & set(critic_names(cfg)))
    if clash:
        out.append(f"agent name(s) {clash} are the names of the run's critics; rename the agent(s)")
    if cfg.critic.base is not None and cfg.critic.base not in names:
        out.append(f"critic.base {cfg.critic.base!r} is not an agent of the team; agents: {sorted(names)}")
    return out
