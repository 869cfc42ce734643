"""Config loading/validation and the MEG: validation errors, unrolling, instantiation."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flexmarl_core.config import ConfigError, TeamConfig, config_from_dict, load_config
from flexmarl_core.meg import MEG, MEGError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def team(agents, edges, **kw):
    return {"team": {"agents": agents, "edges": edges, **kw}}


def agent(name, template="{input}", **kw):
    return {"name": name, "template": template, **kw}


CHAIN = team(
    [agent("planner"), agent("solver", "{input} {planner}"), agent("verifier", "{input} {solver}")],
    ["planner -> solver", ["solver", "verifier"]],
)


def meg_of(data) -> MEG:
    return MEG.from_config(config_from_dict(data).team)


def test_bad_field_names_file_and_field(tmp_path):
    data = dict(CHAIN)
    data["batch"] = {"group_size": 0}
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and "batch.group_size" in str(e.value)


def test_unknown_key_and_agent_index_named(tmp_path):
    data = yaml.safe_load(yaml.safe_dump(CHAIN))
    data["team"]["agents"][1]["sampling"] = {"temprature": 0.5}
    with pytest.raises(ConfigError, match=r"team\.agents\[solver\]\.sampling\.temprature"):
        config_from_dict(data, source="x.yaml")


def test_unreadable_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)
    p.write_text("team: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_overrides_by_path_and_agent_name():
    cfg = config_from_dict(
        CHAIN,
        overrides=["batch.group_size=8", "team.agents.solver.sampling.temperature=0.5", "seed=3"],
    )
    assert cfg.batch.group_size == 8 and cfg.seed == 3
    assert cfg.agent("solver").sampling.temperature == 0.5
    with pytest.raises(ConfigError, match="no list item named 'nobody'"):
        config_from_dict(CHAIN, overrides=["team.agents.nobody.trainable=false"])
    with pytest.raises(ConfigError, match="key.path=value"):
        config_from_dict(CHAIN, overrides=["seed"])


def test_micro_batch_must_divide_batch():
    with pytest.raises(ConfigError, match="micro_batch_inputs"):
        config_from_dict({**CHAIN, "batch": {"inputs_per_iteration": 6, "micro_batch_inputs": 4}})


def test_chain_topology_and_instantiation():
    meg = meg_of(CHAIN)
    assert [str(n) for n in meg.topological_order()] == ["planner@0", "solver@0", "verifier@0"]
    assert meg.output == "verifier"
    nodes = meg.instantiate(["p0", "p1"], group_size=3)
    assert len(nodes) == 2 * 3 * 3
    ids = [n.sample_id for n in nodes]
    assert len(set(ids)) == len(ids)
    by_id = {n.sample_id: n for n in nodes}
    v = by_id["p1:2:verifier:0"]
    assert v.parents == ("p1:2:solver:0",) and v.traj == 2 and v.input_id == "p1"
    pos = {sid: i for i, sid in enumerate(ids)}
    for n in nodes:
        assert all(pos[p] < pos[n.sample_id] for p in n.parents)


def test_render_prompt():
    meg = meg_of(CHAIN)
    assert meg.render_prompt("solver", "2+3", {"planner": "5"}) == "2+3 5"
    assert meg.render_prompt("solver", "2+3", {}) == "2+3 "  # parent not run yet


@pytest.mark.parametrize(
    "data, match",
    [
        (team([agent("a"), agent("b", "{a}")], ["a -> b", "b -> a"]), r"cycle in the team graph: (a -> b -> a|b -> a -> b)"),
        (team([agent("a"), agent("b", "{a}")], ["a -> c"]), "unknown agent 'c'"),
        (team([agent("a"), agent("a")], []), r"duplicate agent name\(s\): \['a'\]"),
        (team([agent("a")], ["a -> a"]), "cannot feed itself"),
        (team([agent("a"), agent("b", "no input here")], []), r"\['b'\] are not reached by any input"),
        (team([agent("a"), agent("b", "{a} {zzz}")], ["a -> b"]), r"placeholder\(s\) \['zzz'\]"),
        (team([agent("a"), agent("b")], []), "set team.output"),
        (team([agent("a"), agent("b", "{a}", share_model_with="c")], ["a -> b"]),
         r"agent 'b': share_model_with 'c' is not an agent"),
        (team([], []), "the team has no agents"),
    ],
)
def test_validation_errors(data, match):
    # Loading the config validates the graph (so `flexmarl train` stops before anything starts)
    # and names the file; the MEG validates a team built in Python on its own.
    with pytest.raises(ConfigError, match=rf"^x\.yaml: team: .*{match}"):
        config_from_dict(data, source="x.yaml")
    with pytest.raises(MEGError, match=match):
        MEG.from_config(TeamConfig.model_validate(data["team"]))


def test_three_cycle_is_named_in_order():
    data = team(
        [agent("a"), agent("b", "{a}"), agent("c", "{b}")], ["a -> b", "b -> c", "c -> a"]
    )
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    msg = str(e.value)
    assert any(c in msg for c in ("a -> b -> c -> a", "b -> c -> a -> b", "c -> a -> b -> c"))


def test_debate_rounds_unroll_into_dag():
    data = team(
        [
            agent("pro", "{input} {con}"),
            agent("con", "{input} {pro}"),
            agent("judge", "{input} {pro} {con}", rounds="last"),
        ],
        [
            {"src": "pro", "dst": "con", "recurrent": True},
            {"src": "con", "dst": "pro", "recurrent": True},
            "pro -> judge",
            "con -> judge",
        ],
        rounds=3,
        output="judge",
    )
    meg = meg_of(data)
    names = [str(n) for n in meg.topological_order()]
    assert names == ["pro@0", "con@0", "pro@1", "con@1", "pro@2", "con@2", "judge@2"]
    assert {str(p) for p in meg.parents[meg.nodes[2]]} == {"con@0"}
    assert {str(p) for p in meg.parents[meg.nodes[-1]]} == {"pro@2", "con@2"}
    # In round 0 the other debater has not spoken yet: its placeholder renders empty.
    assert meg.render_prompt("pro", "Q", {}) == "Q "
    assert meg.render_prompt("pro", "Q", {"con": "no"}) == "Q no"
    nodes = meg.instantiate(["x"], group_size=1)
    assert [n.sample_id for n in nodes][-1] == "x:0:judge:2"
    assert nodes[-1].parents == ("x:0:pro:2", "x:0:con:2")
