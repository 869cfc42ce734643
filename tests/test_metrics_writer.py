"""The run's JSONL metrics survive the ways a driver dies while appending: a full disk names
the file in the operator's line, and a torn last line is cut before the next attempt appends."""

from __future__ import annotations

import json
import os

import pytest

from flexmarl_core.driver.failures import stopped_line
from flexmarl_core.driver.metrics import MetricsWriter


def test_a_torn_last_line_is_cut_before_appending(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    whole = json.dumps({"iteration": 0, "reward": 1.0}) + "\n"
    (metrics / "iterations.jsonl").write_text(whole + '{"iteration": 1, "rew')  # died mid-line
    (metrics / "decisions.jsonl").write_text('{"torn')  # nothing whole at all
    (metrics / "ops.jsonl").write_text("")
    w = MetricsWriter(tmp_path)
    w.iteration({"iteration": 1, "reward": 0.5})
    w.close()
    rows = [json.loads(x) for x in (metrics / "iterations.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1] and rows[1]["reward"] == 0.5
    assert (metrics / "decisions.jsonl").read_text() == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
def test_a_full_disk_while_appending_names_the_file(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    (metrics / "iterations.jsonl").symlink_to("/dev/full")  # every write fails with ENOSPC
    w = MetricsWriter(tmp_path)
    with pytest.raises(OSError) as info:
        w.iteration({"iteration": 0, "reward": 1.0})
    w.close()
    line = stopped_line(info.value, str(tmp_path))
    assert "No space left on device" in line and str(metrics / "iterations.jsonl") in line, line
    assert "free space there" in line and f"flexmarl train --resume {tmp_path}" in line, line
