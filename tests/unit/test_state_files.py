"""Files a run reads back are plain data: a crafted trainer state, weights file or config in a
run folder (which may live on shared storage others can write) raises a clear error naming the
file and runs none of its contents. Each crafted file would, if unpickled or constructed, create
a marker file; the tests assert the error and that the marker is absent."""

from __future__ import annotations

import io
import json
import pickle
import struct
from pathlib import Path

import pytest
import torch

from flexmarl_core.config import ConfigError, load_config
from flexmarl_core.runfiles.location import trainer_key, weights_key
from flexmarl_core.training.handles import StateFileError, StateHandle, get, load, put

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


class _Touch:
    """Unpickling this creates `path` (stands for any code a pickle can run)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _evil_pickle(marker: Path) -> bytes:
    return pickle.dumps(_Touch(marker))


def _crafted(marker: Path) -> dict[str, bytes]:
    evil = _evil_pickle(marker)
    # The previous format: magic v1, three lengths, a pickled slot table (which the old reader
    # passed to pickle.loads) -- the exact file an attacker would plant.
    old = b"FLXSTATE\x01\n" + struct.pack("<QQQ", len(evil), len(evil), 0) + evil
    torch_file = io.BytesIO()
    torch.save({"w": _Touch(marker)}, torch_file)
    hdr = json.dumps({"slots": [["load", [1], 0, 4]], "nbytes": 4, "skeleton": {"tensor": 0}}).encode()
    bad_dtype = b"FLXSTATE\x02\n" + struct.pack("<Q", len(hdr)) + hdr + b"\0" * 64
    hdr2 = json.dumps({"slots": [], "nbytes": 0, "skeleton": {"__reduce__": ["os.system", "x"]}}).encode()
    bad_tag = b"FLXSTATE\x02\n" + struct.pack("<Q", len(hdr2)) + hdr2
    hdr3 = json.dumps({"slots": [["float32", [4], 0, 16]], "nbytes": 8, "skeleton": {"tensor": 0}}).encode()
    too_big = b"FLXSTATE\x02\n" + struct.pack("<Q", len(hdr3)) + hdr3
    return {"pickle": evil, "old-format": old, "torch.save": torch_file.getvalue(),
            "unknown dtype": bad_dtype, "unknown tag": bad_tag, "slot past the data": too_big}


@pytest.mark.parametrize("kind", ["pickle", "old-format", "torch.save", "unknown dtype", "unknown tag",
                                  "slot past the data"])
def test_crafted_state_file_raises_and_runs_nothing(tmp_path, kind):
    marker = tmp_path / "pwned"
    path = tmp_path / "v1.state"
    path.write_bytes(_crafted(marker)[kind])
    with pytest.raises(StateFileError, match=str(path)):
        get(StateHandle("file", str(path), 0))
    assert not marker.exists()


def test_state_file_header_is_json_and_round_trips(tmp_path):
    state = {"params": torch.randn(5), "meta": {0: {"betas": (0.9, 0.99), "b": b"\x00\x01"}}, "c": 1 + 2j}
    h = put(state, str(tmp_path / "s.state"))
    raw = (tmp_path / "s.state").read_bytes()
    (n,) = struct.unpack("<Q", raw[10:18])
    header = json.loads(raw[18:18 + n])  # plain JSON: nothing else in front of the tensor bytes
    assert header["skeleton"]["dict"][0][0] == "params"
    with open(tmp_path / "s.state", "rb") as f:
        got = load(f, what="s.state")
    assert torch.equal(got["params"], state["params"]) and got["meta"] == state["meta"] and got["c"] == state["c"]
    assert get(h)["meta"][0]["betas"] == (0.9, 0.99)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from flexmarl_core.driver import run

    cfg = load_config(TINY, [f"run_dir={tmp_path_factory.mktemp('crafted')}/run", "train.iterations=1"])
    return Path(run.prepare_run(cfg, log=lambda _: None))


def test_worker_refuses_a_crafted_checkpoint_in_the_run_folder(run_dir, tmp_path):
    """Through the path a worker takes when it swaps a trainer state in (on-demand allocation,
    resume): the planted checkpoint is refused by name and nothing in it runs."""
    from flexmarl_core.runtime.worker import context

    marker = tmp_path / "pwned"
    target = run_dir / trainer_key("solver", 1)
    target.parent.mkdir(parents=True, exist_ok=True)
    ctx = context(str(run_dir))
    for blob in _crafted(marker).values():
        target.write_bytes(blob)
        with pytest.raises(StateFileError, match=str(target)):
            ctx.trainer("solver", 1)
        assert not marker.exists()


def test_worker_refuses_crafted_weights_and_config(run_dir, tmp_path):
    from flexmarl_core.runtime.worker import WorkerContext, context, load_weights

    marker = tmp_path / "pwned"
    w = run_dir / weights_key("planner", 1)
    w.parent.mkdir(parents=True, exist_ok=True)
    w.write_bytes(_evil_pickle(marker))
    with pytest.raises(ValueError, match=f"{w} is not a safetensors weights file"):
        load_weights(run_dir, "planner", 1)
    # A config that asks YAML to construct a Python object: the safe loader refuses it.
    other = tmp_path / "run2"
    other.mkdir()
    (other / "config.yaml").write_text(f"!!python/object/apply:pathlib.Path.touch [{str(marker)!r}]\n")
    with pytest.raises(ConfigError, match="config.yaml"):
        context(str(other))
    assert not marker.exists()
    assert isinstance(context(str(run_dir)), WorkerContext)
