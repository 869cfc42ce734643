"""The co-design's switches (`codesign:`): the paper's four, the switches that act through them,
and the schedules built from them (the synchronous baseline, `serial`); `switch_overrides`
turns them on and off by name, as the benches and the simulator's studies do."""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import Field, model_validator

from flexmarl_core.config.agent import _Strict


class CodesignConfig(_Strict):
    dependency_parallel: bool = Field(
        True, description="Downstream agents start a micro-batch as soon as its parents finish it."
    )
    load_balancing: bool = Field(
        True, description="Route to the least-loaded instance; move instances between agents."
    )
    async_pipeline: bool = Field(
        True, description="Agents train per micro-batch and start their next iteration on their own."
    )
    on_demand_allocation: bool = Field(
        True, description="Training slots go to agents whose data is ready; idle states swap out."
    )
    late_binding: bool = Field(
        False,
        description="With load_balancing: a rollout waits in the orchestrator until an instance of "
        "its agent has nothing queued (an idle rollout worker is lent to it if none has), so where "
        "it runs is chosen when a worker frees, not when it became ready; trainer and reward ops "
        "go ahead of rollouts. For long, uneven rollouts (configs/longtail_team.yaml).",
    )
    gradient_helpers: bool = Field(
        False,
        description="With on_demand_allocation: a train op whose agent's training slot is busy may run on another idle "
        "training slot: it computes that micro-batch's gradient on a copy of the agent's weights "
        "of the same version and leaves it at the run's location, and the agent's step adds it "
        "(the same gradient, summed in another order). Agents on the plain torch backend without "
        "LoRA, on-policy (max_staleness 0); others train in their slot as before.",
    )
    serial: bool = Field(
        False,
        description="Agents one at a time, as a loop over a single-agent trainer runs a team "
        "(MARFT's agent-by-agent schedule): each turn's whole batch rolls out after the turn "
        "before it, with no other agent's rollouts beside it, then the agents train and sync one "
        "after another. A baseline schedule: needs dependency_parallel and async_pipeline off; "
        "with load_balancing the whole inference pool serves the one agent rolling out.",
    )
    partial_rollouts: bool = Field(
        False,
        description="With max_staleness >= 1: a rollout still decoding when its agent's newer "
        "weights are published (within the staleness bound) resumes under them: its rows' "
        "context is prefilled again with the new weights and the rest of each response sampled "
        "by them. Every token keeps the version that sampled it (the store's token_versions) and "
        "its behaviour logprob, which decoupled_ppo corrects per token; a sample's policy_version "
        "is its oldest token's. Agents on the HF engine without model.lora or a tool; others "
        "roll out under one version as before.",
    )
    balance_threshold: float = Field(
        2.0, gt=1.0, description="Queued-work ratio hottest/coldest agent that triggers a move."
    )
    max_staleness: int = Field(
        0, ge=0, le=64,
        description="Bounded staleness k: an agent's rollouts of iteration i may use its weights "
        "of any version >= i - k (0: strictly on-policy). k > 0 needs an off-policy loss "
        "(algorithm.policy_loss: decoupled_ppo).",
    )
    mixed_batch_window_s: float | None = Field(
        None, ge=0.0, le=10.0,
        description="LoRA agents: rollouts of agents on one base that run at the same time in a "
        "worker share one decode (rows of several adapters in one forward pass); the first waits "
        "up to this long for peers (inference/coalesce.py). Needs a worker that runs several "
        "rollouts at once (nthreads > 1, rollout tags with room). None: each rollout decodes alone.",
    )

    @model_validator(mode="after")
    def _switches_take_effect(self) -> CodesignConfig:
        # A switch that acts through another one can do nothing without it: refused, not ignored.
        if self.late_binding and not self.load_balancing:
            raise ValueError("late_binding=true has no effect with load_balancing=false (late binding "
                             "picks among the instances the balancer routes to); set load_balancing: true "
                             "or late_binding: false")
        if self.serial and (self.dependency_parallel or self.async_pipeline):
            on = [n for n in ("dependency_parallel", "async_pipeline") if getattr(self, n)]
            raise ValueError("serial=true runs agents one at a time, which "
                             f"{' and '.join(f'{n}=true' for n in on)} would "
                             "overlap; set " + " and ".join(f"{n}: false" for n in on) + " or serial: false")
        if self.partial_rollouts and not self.max_staleness:
            raise ValueError("partial_rollouts=true has no effect with max_staleness=0 (no newer weights "
                             "can be published while an on-policy rollout runs: its agent's next sync "
                             "waits for it); set max_staleness: 1 or partial_rollouts: false")
        if self.partial_rollouts and self.mixed_batch_window_s is not None:
            raise ValueError("partial_rollouts=true and mixed_batch_window_s: a decode shared by several "
                             "adapters' rollouts cannot resume one of them under new weights; leave "
                             "mixed_batch_window_s unset or set partial_rollouts: false")
        if self.gradient_helpers and not self.on_demand_allocation:
            raise ValueError("gradient_helpers=true has no effect with on_demand_allocation=false (a helper "
                             "takes a train op to another training slot, and static placement gives each "
                             "agent one slot); set on_demand_allocation: true or gradient_helpers: false")
        if self.gradient_helpers and self.max_staleness:
            raise ValueError(f"gradient_helpers=true has no effect with max_staleness={self.max_staleness} "
                             "(a helper loads the weights its samples were drawn with, which are the "
                             "trainer's only on-policy); set max_staleness: 0 or gradient_helpers: false")
        return self


#: The paper's four co-design switches: every one off is the synchronous baseline.
SWITCHES = ("dependency_parallel", "load_balancing", "async_pipeline", "on_demand_allocation")
#: Switches that act through another one (`CodesignConfig` refuses them without it).
REQUIRES = {"late_binding": "load_balancing", "gradient_helpers": "on_demand_allocation"}


def switch_overrides(on: Iterable[str] = (), off: Iterable[str] = ()) -> list[str]:
    """`a.b=value` overrides turning the named `codesign` switches on and off; a switch that
    acts through one turned off goes off with it (`REQUIRES`), so `off=SWITCHES` is the
    synchronous baseline of any config."""
    off = list(off)
    out = [f"codesign.{s}=true" for s in on] + [f"codesign.{s}=false" for s in off]
    return out + [f"codesign.{dep}=false" for dep, base in REQUIRES.items() if base in off and dep not in off]
