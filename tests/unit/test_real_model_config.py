"""The shipped real-model config (`configs/qwen_gsm8k.yaml`: Qwen2.5-0.5B-Instruct by hub id):
accepted as shipped by the memory plan at that model's shape, refused at the default worker
limit it was sized away from; and on a machine without the model, one line saying how to get
it. (Trained for real, on a small stand-in of the same architecture: tests/slow/test_real_model_run.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flexmarl_core.config import ConfigError, config_from_text, load_config
from flexmarl_core.control import memory
from tests._models_util import QWEN_05B_INSTRUCT, publish

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "qwen_gsm8k.yaml"
HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"
FLEXMARL = str(Path(sys.executable).with_name("flexmarl"))


@pytest.fixture
def real_shape(tmp_path, monkeypatch) -> Path:
    """An offline hub cache holding the model's config.json (its shape) and no weights."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return publish(cache, HUB_ID, "a" * 40, config=QWEN_05B_INSTRUCT)


def test_the_shipped_config_fits_its_worker_at_the_real_models_shape(real_shape):
    cfg = load_config(CONFIG)
    for a in cfg.team.agents:
        assert (a.model.hub_id, a.model.path, a.chat_template) == (HUB_ID, str(real_shape), "tokenizer")
    agents, (w0,) = memory.plan(cfg)
    assert [round(m.params / 1e6) for m in agents] == [494, 494]
    # Both trainer states do not fit at once: one resident, the other swapped out, within the limit.
    assert (w0.resident, w0.verdict) == (1, "fits with swap") and w0.planned <= w0.limit < w0.all_resident
    lines = memory.check(cfg)
    assert any("at most 1 of 2 trainer states resident" in line for line in lines)
    # The same team at Dask's default worker limit (what docs/models.md's example once met): refused.
    with pytest.raises(ConfigError, match=r"does not fit its memory_limit 6\.00 GiB"):
        memory.check(load_config(CONFIG, ["cluster.workers.w0.memory_limit=6GiB"]))


def test_the_docs_example_fits_as_written(real_shape):
    """docs/models.md's first example, copied as is into a config, is accepted by the plan."""
    text = (REPO / "docs" / "models.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert example is not None
    cfg = config_from_text(example.group(1), source="docs/models.md")
    assert cfg.team.agents[0].model.hub_id == HUB_ID
    (w0,) = memory.plan(cfg)[1]
    assert w0.verdict == "fits" and w0.all_resident <= w0.limit
    memory.check(cfg)


def test_without_the_model_one_line_says_how_to_download_it(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    res = subprocess.run([FLEXMARL, "train", str(CONFIG), "--set", f"run_dir={run_dir}"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert res.returncode == 2, res.stdout + res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr
    assert f"hf download {HUB_ID}" in errors[0] and "team.agents[planner]" in errors[0], errors[0]
    assert "Traceback" not in res.stderr and not run_dir.exists()
