"""A switch that can have no effect in a config is refused at load time, with one line naming
the key, why it can do nothing, and the fix; the overrides that turn switches off take the
switches that act through them along, so every config has a synchronous baseline."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexmarl_core.config import REQUIRES, SWITCHES, ConfigError, load_config, switch_overrides
from flexmarl_core.meg import MEG
from tests._models_util import QWEN_05B_INSTRUCT, publish

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
LONGTAIL = REPO / "configs" / "longtail_team.yaml"
AGENTS = ("planner", "solver", "verifier")


def _refused(overrides: list[str], *parts: str, config: Path = TINY) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(config, overrides)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{config}: ")
    for part in parts:
        assert part in msg, msg
    return msg


def test_late_binding_without_load_balancing():
    _refused(["codesign.late_binding=true", "codesign.load_balancing=false"],
             "codesign: late_binding=true has no effect with load_balancing=false",
             "set load_balancing: true or late_binding: false")
    assert load_config(TINY, ["codesign.late_binding=true"]).codesign.late_binding


def test_gradient_helpers_without_on_demand_allocation():
    _refused(["codesign.gradient_helpers=true", "codesign.on_demand_allocation=false"],
             "codesign: gradient_helpers=true has no effect with on_demand_allocation=false",
             "set on_demand_allocation: true or gradient_helpers: false")


def test_gradient_helpers_with_staleness():
    stale = ["codesign.max_staleness=1", *(f"team.agents.{a}.algorithm.policy_loss=decoupled_ppo" for a in AGENTS)]
    assert load_config(TINY, stale).codesign.max_staleness == 1  # staleness alone is fine
    _refused(["codesign.gradient_helpers=true", *stale],
             "codesign: gradient_helpers=true has no effect with max_staleness=1",
             "set max_staleness: 0 or gradient_helpers: false")


def test_gradient_helpers_with_no_agent_that_can_lend_a_gradient():
    frozen = [f"team.agents.{a}.trainable=false" for a in AGENTS]
    _refused(["codesign.gradient_helpers=true", *frozen],
             "codesign.gradient_helpers=true has no effect: no agent can lend a gradient",
             "set gradient_helpers: false")
    # one agent that can is enough
    cfg = load_config(TINY, ["codesign.gradient_helpers=true", *frozen[:2]])
    assert cfg.codesign.gradient_helpers


def test_gradient_helpers_with_one_training_slot():
    one = "cluster.workers=[{name: w0, resources: {rollout: 1, train: 1}}, {name: w1, resources: {rollout: 1}}]"
    _refused(["codesign.gradient_helpers=true", one],
             "codesign.gradient_helpers=true has no effect with 1 training slot(s) in cluster.workers (['w0'])",
             "give a second worker the 'train' tag or set gradient_helpers: false")
    # a cluster at an address: its workers' tags are not in the config, so nothing to refuse
    assert load_config(TINY, ["codesign.gradient_helpers=true", one, "cluster.address=tls://10.0.0.5:8786"])


def test_worker_env_with_a_cluster_address():
    _refused(["cluster.address=tls://10.0.0.5:8786", "cluster.worker_env={GOMP_SPINCOUNT: '0'}"],
             "cluster: worker_env has no effect with address='tls://10.0.0.5:8786'", "or remove it")


def test_switch_overrides_turn_off_what_acts_through_a_switch():
    assert REQUIRES == {"late_binding": "load_balancing", "gradient_helpers": "on_demand_allocation"}
    assert switch_overrides(off=["load_balancing"]) == ["codesign.load_balancing=false",
                                                         "codesign.late_binding=false"]
    assert switch_overrides(on=["async_pipeline"], off=["dependency_parallel"]) == [
        "codesign.async_pipeline=true", "codesign.dependency_parallel=false"]
    # the long-tail team turns late binding and helpers on: its baseline and each ablation load
    assert load_config(LONGTAIL).codesign.late_binding and load_config(LONGTAIL).codesign.gradient_helpers
    sync = load_config(LONGTAIL, switch_overrides(off=SWITCHES)).codesign
    assert not any(getattr(sync, s) for s in (*SWITCHES, *REQUIRES))
    for s in SWITCHES:
        cs = load_config(LONGTAIL, switch_overrides(on=[x for x in SWITCHES if x != s], off=[s])).codesign
        assert not getattr(cs, s) and all(getattr(cs, x) for x in SWITCHES if x != s)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")) + sorted(
    (REPO / "examples").rglob("config*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_still_loads(path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.chdir(REPO)  # configs name their files relative to the project root
    # A config naming a hub model (configs/qwen_gsm8k.yaml) resolves it in the cache, offline:
    # here one holding that model's config.json (tests/unit/test_real_model_config.py trains it).
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    publish(tmp_path, "Qwen/Qwen2.5-0.5B-Instruct", "0" * 40, config=QWEN_05B_INSTRUCT)
    cfg = load_config(path)
    assert cfg.team.agents and MEG.from_config(cfg.team).agent_names
