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


def test_on_object_storage_the_op_log_goes_up_in_parts_of_bounded_size(s3_server, tmp_path, monkeypatch):
    """A run on S3 (moto): each upload of the op log sends only its newest part, which stops
    growing at `PART_BYTES`, so an upload's bytes do not grow with the log; a resumed writer
    reads every part back and goes on in a new one; `store repair`'s rewrite keeps one part."""
    from flexmarl_core.driver import metrics
    from flexmarl_core.driver.metrics import log_lines, log_parts, rewrite_log
    from flexmarl_core.ops import Op, OpRecord, StageResult
    from flexmarl_core.runfiles.location import RunLocation
    from tests._s3 import make_bucket

    for k, v in {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "testing",
                 "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    make_bucket(s3_server, "oplog")
    monkeypatch.setattr(metrics, "PART_BYTES", 4096)
    monkeypatch.setattr(MetricsWriter, "MIRROR_EVERY_S", 0.0)  # every op goes up at once
    loc = RunLocation("s3://oplog/runs/x")

    def record(i: int) -> OpRecord:
        return OpRecord(Op(i, "rollout", "solver", mb=0), float(i), float(i) + 1, StageResult(Op(i, "rollout", "solver", mb=0)))

    w = MetricsWriter(tmp_path / "a", mirror=loc)
    sent = []
    for i in range(60):
        before = w.uploaded_bytes["ops.jsonl"]
        w.op(record(i))
        sent.append(w.uploaded_bytes["ops.jsonl"] - before)
    w.close()
    line = max(len(x) + 1 for x in (tmp_path / "a" / "metrics" / "ops.jsonl").read_text().splitlines())
    assert max(sent) < 4096 + line, sent  # never more than one part
    parts = log_parts(loc, "ops.jsonl")
    assert len(parts) >= 3 and not loc.exists("metrics/ops.jsonl"), parts
    assert [json.loads(x)["iteration"] for x in log_lines(loc, "ops.jsonl")] == list(range(60))

    again = MetricsWriter(tmp_path / "b", mirror=loc)  # a resume on another machine
    again.op(record(60))
    again.close()
    assert [json.loads(x)["iteration"] for x in log_lines(loc, "ops.jsonl")] == list(range(61))
    assert len(log_parts(loc, "ops.jsonl")) == len(parts) + 1

    rewrite_log(loc, "ops.jsonl", log_lines(loc, "ops.jsonl")[:10])
    assert len(log_parts(loc, "ops.jsonl")) == 1
    assert [json.loads(x)["iteration"] for x in log_lines(loc, "ops.jsonl")] == list(range(10))
