"""The first run a user sees, on a tiny config: `flexmarl train` warm-starts the team from SFT
(made once, then cached), trains with RL, and the terminal shows the UI link, the iterations
and a summary with held-out accuracy before and after, and no Dask or Prefect INFO lines; the
run folder gets a timeline (one lane per worker) and learning curves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
FLEXMARL = str(Path(sys.executable).with_name("flexmarl"))
TINY_FIRST_RUN = ["train.warm_start=sft", "train.evaluate_initial=true", "train.sft_max_steps=3",
                  "train.sft_eval_every=1", "train.sft_eval_size=4", "workload.heldout_size=8"]


def _png_meta(path: Path, key: str) -> list:
    with Image.open(path) as im:
        im.load()
        return json.loads(im.info[key])


@pytest.fixture(scope="module")
def first_run(prefect_api, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("first-run")
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "FLEXMARL_CACHE": str(tmp / "cache"),
           "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", None)
    sets = [x for kv in [*TINY_FIRST_RUN, f"run_dir={tmp / 'run'}"] for x in ("--set", kv)]
    res = subprocess.run([FLEXMARL, "train", str(REPO / "configs" / "tiny.yaml"), *sets],
                         capture_output=True, text=True, timeout=600, cwd=tmp, env=env)
    return tmp, res


def test_terminal_shows_before_and_after_and_no_internal_info(first_run):
    tmp, res = first_run
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "Prefect UI for this run:" in out
    assert "warm start: SFT made" in out
    # where it runs, in one line: tiny.yaml places its workers by hand
    assert re.search(r"^layout: 2 workers x 1 torch thread on \d+ cores? \(set in cluster.workers", out, re.M), out
    assert re.search(r"held-out team accuracy: \d\.\d{3} before RL -> \d\.\d{3} after \([+-]\d\.\d{3}\)", out), out
    assert "held-out set: 8 generated held-out expressions" in out
    assert "final reward per agent: planner" in out
    # Piped (as a scheduler or CI runs it): a line per iteration with its figures, no bars.
    lines = re.findall(r"^iteration (\d+)/(\d+)  E2E \d+\.\d\d s  acc \d\.\d{3}  util \d\.\d\d  "
                       r"reward planner \d\.\d{3} solver \d\.\d{3} verifier \d\.\d{3}$", res.stdout, re.M)
    assert lines == [("1", "2"), ("2", "2")], res.stdout[-3000:]
    assert not re.search(r"^iteration \d+/\d+ .*━", res.stdout, re.M), res.stdout[-3000:]  # no bar
    # Dask's and Prefect's INFO lines went to the run folder's logs, not here.
    assert not [line for line in out.splitlines() if re.search(r"\bINFO\b", line)], out[-3000:]
    assert "Run out-of-band function" in (tmp / "run" / "logs" / "dask-w0.log").read_text()
    table = [line for line in res.stdout.splitlines() if line[:1] in "┏┃┡│└"]
    assert table and max(len(line) for line in table) <= 100
    assert "R planner" in res.stdout and "R verifier" in res.stdout  # agent names not cut


def test_pictures_have_a_lane_per_worker_and_the_curves(first_run):
    tmp, res = first_run
    assert res.returncode == 0
    run = tmp / "run"
    workers = sorted({json.loads(x)["worker"] for x in (run / "metrics" / "ops.jsonl").read_text().splitlines()})
    assert workers == ["w0", "w1"]
    assert [w for _, w in _png_meta(run / "timeline.png", "flexmarl-lanes")] == workers
    assert "accuracy" in _png_meta(run / "curves.png", "flexmarl-series")
    # `flexmarl report RUN --compare RUN2` stacks two runs' lanes on one axis.
    cmp = subprocess.run([FLEXMARL, "report", str(run), "--compare", str(run), "--out", str(tmp / "cmp")],
                         capture_output=True, text=True, timeout=120)
    assert cmp.returncode == 0, cmp.stderr
    assert len(_png_meta(tmp / "cmp" / "timeline.png", "flexmarl-lanes")) == 2 * len(workers)
    bad = subprocess.run([FLEXMARL, "report", str(tmp)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr


def test_the_warm_start_is_reused(first_run):
    tmp, res = first_run
    assert res.returncode == 0
    from flexmarl_core.config import load_config
    from flexmarl_core.driver.sft import warm_start

    cfg = load_config(REPO / "configs" / "tiny.yaml", [*TINY_FIRST_RUN, "train.iterations=7"])
    folder, info = warm_start(cfg, tmp / "cache", log=lambda _: None)
    assert info["reused"] and (folder / "solver" / "model.safetensors").is_file()
    made = json.loads((tmp / "run" / "warm_start.json").read_text())
    assert made["out_dir"] == str(folder) and not made["reused"]
