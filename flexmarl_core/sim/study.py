"""What `flexmarl simulate`, `bench/sim.py` and the sweep flow run: the synchronous baseline
against the co-design (Table 2), each switch off alone (Table 3), and the replay of a real
run with its fitted cost model (calibration).

Overrides (`--set`) that start with `sim.` change the cluster description; the rest change
the experiment config, as for `flexmarl train`.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from flexmarl_core.config import (
    SWITCHES,
    ExperimentConfig,
    config_from_dict,
    load_config,
    switch_overrides,
)
from flexmarl_core.meg import MEG
from flexmarl_core.sim import LABEL, SimResult, simulate
from flexmarl_core.sim.calibrate import calibrate, measured_summary
from flexmarl_core.sim.cluster import SimCluster, cost_model, load_cluster, workers

CODESIGN, SYNC = "co-design", "synchronous baseline"
#: one agent at a time on the whole cluster (`codesign.serial`; the balancer and on-demand
#: allocation give the one agent every instance and training slot)
SERIAL = "serial"
#: the co-design with late binding (a rollout is bound to an instance only when one is idle,
#: so none waits pinned behind another's tail), on-policy
CODESIGN_LATE = "co-design, late binding"
#: and at bounded staleness k = 1 (every trainable agent on decoupled_ppo)
CODESIGN_K1 = "co-design, late binding, k=1"
K1_OFF = " off (k=1)"


def modes(ablation: bool = True, agents: list[str] | None = None) -> dict[str, list[str]]:
    """Mode name -> the overrides that make it; with `agents` (the team's trainable agents) also
    the serial schedule, the co-design with late binding at k = 0 and k = 1 and (`ablation`)
    each switch off alone from the latter."""
    out = {SYNC: switch_overrides(off=SWITCHES), CODESIGN: switch_overrides(on=SWITCHES)}
    if agents is not None:
        out[SERIAL] = [*switch_overrides(on=["load_balancing", "on_demand_allocation"],
                                         off=["dependency_parallel", "async_pipeline"]), "codesign.serial=true"]
        out[CODESIGN_LATE] = [*out[CODESIGN], "codesign.late_binding=true"]
        out[CODESIGN_K1] = [*out[CODESIGN_LATE], "codesign.max_staleness=1",
                            *(f"team.agents.{a}.algorithm.policy_loss=decoupled_ppo" for a in agents)]
    if ablation:
        for off in SWITCHES:
            out[f"{off} off"] = switch_overrides(on=[s for s in SWITCHES if s != off], off=[off])
        if agents is not None:
            for off in (*SWITCHES, "late_binding"):
                out[f"{off}{K1_OFF}"] = [*out[CODESIGN_K1], *switch_overrides(off=[off])]
    return out


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(experiment overrides, cluster overrides without the `sim.` prefix)."""
    sim = [o.removeprefix("sim.") for o in overrides if o.startswith("sim.")]
    return [o for o in overrides if not o.startswith("sim.")], sim


def run_cluster(cfg: ExperimentConfig, cluster: SimCluster, warm: bool = True) -> SimResult:
    ws, pools = workers(cluster, MEG.from_config(cfg.team).agent_names)
    return simulate(cfg, cost_model(cluster, cfg), ws, pools, warm=warm)


def run_modes(config: str | Path, cluster_path: str | Path, overrides: list[str] | None = None,
              ablation: bool = True, schedules: bool = False, only: tuple[str, ...] = (),
              warm: bool = True) -> tuple[dict[str, SimResult], SimCluster]:
    """Every mode of `modes` (`schedules`: with the serial schedule and the co-design at k = 1;
    `only`: just these; `warm`: see `simulate`)."""
    cfg_over, sim_over = split_overrides(overrides or [])
    cluster = load_cluster(cluster_path, sim_over)
    agents = MEG.from_config(load_config(config, cfg_over).team).trainable_agents if schedules else None
    out = {m: run_cluster(load_config(config, [*cfg_over, *sw]), cluster, warm)
           for m, sw in modes(ablation, agents).items() if not only or m in only}
    return out, cluster


def tables(results: dict[str, SimResult]) -> dict[str, Any]:
    """Table 2 (sync vs co-design: E2E, tokens/s, speedup) and Table 3 (each switch off: its
    E2E and slowdown against the co-design), from `run_modes` results. E2E and tokens/s are
    the steady state (iterations after the first); `e2e_s_all_iterations` includes it."""
    s = {m: r.summary for m, r in results.items()}

    def row(m: str) -> dict[str, Any]:
        return {"e2e_s_per_iteration": s[m]["e2e_s_steady"], "tokens_per_s": s[m]["tokens_per_s_steady"],
                "e2e_s_all_iterations": s[m]["e2e_s_per_iteration"],
                "utilization_per_pool": s[m]["utilization_per_pool"]}

    cod, syn = s[CODESIGN]["e2e_s_steady"], s[SYNC]["e2e_s_steady"]
    ratio = s[CODESIGN]["tokens_per_s_steady"] / s[SYNC]["tokens_per_s_steady"]
    t2: dict[str, Any] = {SYNC: row(SYNC), CODESIGN: row(CODESIGN), "speedup": syn / cod,
                          "tokens_per_s_ratio": ratio}
    cods = [m for m in (CODESIGN, CODESIGN_LATE, CODESIGN_K1) if m in s]
    for m in cods[1:]:
        t2[m] = row(m)
    best = min(s[m]["e2e_s_steady"] for m in cods)
    if len(cods) > 1:  # the best co-design on-policy and at k <= 1, against sync and serial
        t2["speedup_on_policy"] = syn / min(s[m]["e2e_s_steady"] for m in cods if m != CODESIGN_K1)
        t2["speedup_best"] = syn / best
    if SERIAL in s:
        t2[SERIAL] = row(SERIAL)
        t2["speedup_vs_serial"] = s[SERIAL]["e2e_s_steady"] / best
    out: dict[str, Any] = {"label": LABEL, "window": "steady state: iterations after the first", "table2": t2}
    t3 = {m: {**row(m), "slowdown_vs_codesign": s[m]["e2e_s_steady"] / cod}
          for m in s if m.endswith(" off")}
    if t3:
        out["table3"] = dict(sorted(t3.items(), key=lambda kv: -kv[1]["e2e_s_per_iteration"]))
    t3k = {m: {**row(m), "slowdown_vs_best": s[m]["e2e_s_steady"] / s[CODESIGN_K1]["e2e_s_steady"]}
           for m in s if m.endswith(K1_OFF)}
    if t3k:  # the same ablation from the best co-design (late binding, k = 1)
        out["table3_k1"] = dict(sorted(t3k.items(), key=lambda kv: -kv[1]["e2e_s_per_iteration"]))
    return out


def replay(run: str | Path, overrides: list[str] | None = None) -> tuple[dict[str, Any], SimResult]:
    """Fit the cost model from `run`'s op log and replay its config (with `overrides`, e.g.
    switches: a what-if on the measured costs) on its own workers."""
    cfg, model, rows = calibrate(run)
    if overrides:
        cfg = config_from_dict(cfg.model_dump(mode="json"), source=str(Path(run) / "config.yaml"),
                               overrides=overrides)
    ws = {w.name: dict(w.resources) for w in cfg.cluster.workers}
    sim = simulate(cfg, model, ws)
    out: dict[str, Any] = {"label": LABEL, "run": str(run), "simulated": sim.summary,
                           "cost_model": model.as_dict()}
    if not overrides:
        meas = measured_summary(rows, cfg.train.iterations)
        out["measured"] = meas
        out["e2e_error"] = sim.summary["e2e_s_per_iteration"] / meas["e2e_s_per_iteration"] - 1
    return out, sim


def many_agents(models: Path, chains: int = 10, depth: int = 10) -> ExperimentConfig:
    """`chains` independent chains of `depth` agents each (every third chain of 32B models,
    the rest 14B; `models` holds their `config.json` folders): the scale test of the control
    plane, 100 agents by default."""
    agents, edges = [], []
    for chain, k in itertools.product(range(chains), range(depth)):
        name, parent = f"a{chain}_{k}", f"a{chain}_{k - 1}" if k else None
        agents.append({"name": name, "template": "{input}" + (f" {{{parent}}}" if parent else ""),
                       "model": {"path": str(models / ("qwen2.5-32b" if chain % 3 == 0 else "qwen2.5-14b"))},
                       "sampling": {"max_new_tokens": 4096}})
        if parent:
            edges.append(f"{parent} -> {name}")
    return config_from_dict({"name": f"sim-{chains * depth}-agents",
                             "team": {"agents": agents, "edges": edges, "output": f"a0_{depth - 1}"},
                             "batch": {"inputs_per_iteration": 8, "group_size": 4, "micro_batch_inputs": 2},
                             "train": {"iterations": 2}})


#: 64 nodes x 16 devices: 48 inference nodes in 4-device instances, 16 training nodes
THOUSAND_DEVICES = ["nodes=64", "inference.nodes=48", "inference.group_devices=4",
                    "training.nodes=16", "training.group_devices=16"]

