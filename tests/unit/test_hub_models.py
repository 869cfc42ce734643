"""Models named as users name them: `model.path: org/name` resolves through the Hugging Face cache
(here one the test populates from locally built models, offline), pins the commit it found, and is
what the run's workers load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexmarl_core.config import ConfigError, ModelConfig, config_from_text, load_config
from flexmarl_core.models import load_agent_model
from tests._models_util import publish, tiny_model

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
FLEXMARL = str(Path(sys.executable).with_name("flexmarl"))
REPO_ID = "acme/tiny-chat"
FIRST, SECOND = "1" * 40, "2" * 40


def _publish(cache: Path, repo: str, commit: str, seed: int) -> Path:
    return publish(cache, repo, commit, seed=seed)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return tmp_path / "hf" / "hub"


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_hub_id_resolves_offline_to_its_snapshot_and_pins_the_commit(hf_cache):
    first = _publish(hf_cache, REPO_ID, FIRST, seed=3)
    cfg = load_config(TINY, [f"team.agents.solver.model.path={REPO_ID}"])
    m = cfg.team.agents[1].model
    assert (m.path, m.hub_id, m.revision) == (str(first), REPO_ID, FIRST)
    assert torch.equal(_weights(load_agent_model(m, seed=0)[0]), _weights(tiny_model(seed=3)))

    # The hub's main moves on during the run: the run's saved config still reads its commit.
    _publish(hf_cache, REPO_ID, SECOND, seed=4)
    again = config_from_text(cfg.model_dump_json(), source="config.yaml").team.agents[1].model
    assert (again.path, again.revision) == (str(first), FIRST)
    assert load_config(TINY, [f"team.agents.solver.model.path={REPO_ID}"]).team.agents[1].model.revision == SECOND
    # A worker on another machine (the driver's folder is not there) resolves the id at the commit.
    elsewhere = m.model_copy(update={"path": "/nowhere/driver/snapshot"})
    assert elsewhere.folder() == first
    assert ModelConfig(**elsewhere.model_dump()).path == str(first)
    # A revision asked for by name resolves to its commit too.
    pinned = load_config(TINY, [f"team.agents.solver.model.path={REPO_ID}", f"team.agents.solver.model.revision={FIRST}"])
    assert pinned.team.agents[1].model.path == str(first)


def test_a_lora_base_named_by_its_hub_id(hf_cache):
    first = _publish(hf_cache, REPO_ID, FIRST, seed=3)
    pytest.importorskip("peft")
    cfg = load_config(TINY, [f"team.agents.planner.model={{base: {REPO_ID}, lora: {{rank: 4}}}}"])
    m = cfg.team.agents[0].model
    assert (m.path, m.hub_id, m.revision) == (str(first), REPO_ID, FIRST)


def test_a_missing_hub_id_offline_is_one_error_naming_the_agent_the_id_and_how_to_get_it(hf_cache, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["team.agents.verifier.model.path=acme/not-there"])
    msg = str(err.value)
    assert "team.agents[verifier]" in msg and "'acme/not-there'" in msg
    assert "hf download acme/not-there" in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(ConfigError, match="`revision` is for hub ids"):
        load_config(TINY, ["team.agents.verifier.model.revision=main"])

    run_dir = tmp_path / "run"
    res = subprocess.run([FLEXMARL, "train", str(TINY), "--set", f"run_dir={run_dir}",
                          "--set", "team.agents.verifier.model.path=acme/not-there"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "acme/not-there" in errors[0] and "hf download" in errors[0], res.stderr
    assert "Traceback" not in res.stderr and not run_dir.exists()


def test_a_run_prepared_from_a_hub_id_trains_that_snapshot(hf_cache, tmp_path):
    """The run folder's initial weights are the snapshot's, and its workers load them."""
    from flexmarl_core.driver.run import prepare_run
    from flexmarl_core.runtime.worker import context

    _publish(hf_cache, REPO_ID, FIRST, seed=3)
    cfg = load_config(TINY, [f"run_dir={tmp_path / 'run'}", "train.iterations=1",
                             f"team.agents.solver.model.path={REPO_ID}"])
    run_dir = prepare_run(cfg, log=lambda _: None)
    trainer = context(run_dir).trainer("solver", 0)[0]
    assert torch.equal(_weights(trainer.model), _weights(tiny_model(seed=3)))
