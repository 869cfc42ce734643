"""The `flexmarl` console script, run as a user would (a subprocess of the installed entry point);
the SFT checks past the first call the same `main` in this process, which has torch and
transformers loaded already (a subprocess spends 5 of its 8 s importing them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from storage import MEGStore

FLEXMARL = str(Path(sys.executable).with_name("flexmarl"))
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([FLEXMARL, *args], capture_output=True, text=True, timeout=120)


def run_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """`flexmarl ARGS` through the console script's `main`, in this process."""
    from flexmarl.cli import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["flexmarl", *args], code, out.out, out.err)


def test_store_check_clean_and_damaged(tmp_path):
    root = tmp_path / "store"
    store = MEGStore(str(root))
    store.write_samples("solver", 0, [
        {"input_id": "p0", "traj": t, "turn": 0, "mb": 0, "policy_version": 0,
         "prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-0.5],
         "prompt_text": "Q", "response_text": "A"} for t in range(2)
    ])
    ok = run("store", "check", str(root))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = root / "samples" / "agent=solver" / "iteration=0" / "mb000000-deadbeef.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    res = run("store", "check", str(root))
    assert res.returncode == 1
    assert bad.name in res.stdout + res.stderr


def test_train_rejects_bad_config_naming_file_and_field(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(TINY.read_text().replace("group_size: 2", "group_size: -1"))
    res = run("train", str(cfg))
    assert res.returncode == 2
    assert str(cfg) in res.stderr and "batch.group_size" in res.stderr
    res = run("train", str(TINY), "--set", "codesign.async_pipline=true")
    assert res.returncode == 2 and "codesign.async_pipline" in res.stderr


def test_sft_writes_a_checkpoint_per_agent(tmp_path):
    res = run("sft", str(TINY), "--out", str(tmp_path / "sft"), "--set", "train.sft_max_steps=2",
              "--set", "train.sft_eval_every=1", "--set", "train.sft_eval_size=4",
              "--set", "train.sft_batch=4")
    assert res.returncode == 0, res.stderr[-2000:]
    for agent in ("planner", "solver", "verifier"):
        assert (tmp_path / "sft" / agent / "model.safetensors").exists()
    assert "after 2 steps" in res.stdout


def test_sft_keep_checks_saves_the_team_at_every_check(tmp_path, capsys):
    import json

    from safetensors.torch import load_file

    out = tmp_path / "sft"
    res = run_here(capsys, "sft", str(TINY), "--out", str(out), "--keep-checks", "--set", "train.sft_max_steps=2",
              "--set", "train.sft_eval_every=1", "--set", "train.sft_eval_size=4",
              "--set", "train.sft_batch=4", "--set", "train.sft_target_accuracy=1.0")
    assert res.returncode == 0, res.stderr[-2000:]
    for step in (0, 1, 2):
        meta = json.loads((out / f"step-{step}" / "sft.json").read_text())
        assert meta["steps"] == step
    # The last check is the final team; the first is the untrained one, not the same weights.
    final = load_file(str(out / "solver" / "model.safetensors"))
    last, first = (load_file(str(out / f"step-{s}" / "solver" / "model.safetensors")) for s in (2, 0))
    assert all(last[k].equal(v) for k, v in final.items())
    assert not all(first[k].equal(v) for k, v in final.items())


def test_sft_resume_from_a_check_continues_at_its_step(tmp_path, capsys):
    import json

    from safetensors.torch import load_file

    first = tmp_path / "sft"
    common = ["--set", "train.sft_eval_every=1", "--set", "train.sft_eval_size=4",
              "--set", "train.sft_batch=4", "--set", "train.sft_target_accuracy=1.0"]
    res = run_here(capsys, "sft", str(TINY), "--out", str(first), "--keep-checks", "--set", "train.sft_max_steps=1", *common)
    assert res.returncode == 0, res.stderr[-2000:]
    check = first / "step-1"
    # Resumed at its own last step: nothing to train, the saved team is the check's.
    same = tmp_path / "same"
    res = run_here(capsys, "sft", str(TINY), "--out", str(same), "--resume-from", str(check),
              "--set", "train.sft_max_steps=1", *common)
    assert res.returncode == 0, res.stderr[-2000:]
    a, b = (load_file(str(d / "solver" / "model.safetensors")) for d in (check, same))
    assert all(a[k].equal(v) for k, v in b.items())
    # One more step: the count goes on from the check's, and the weights move.
    more = tmp_path / "more"
    res = run_here(capsys, "sft", str(TINY), "--out", str(more), "--resume-from", str(check),
              "--set", "train.sft_max_steps=2", *common)
    assert res.returncode == 0, res.stderr[-2000:]
    meta = json.loads((more / "sft.json").read_text())
    assert meta["steps"] == 2 and meta["history"][0]["resumed_from"] == str(check)
    c = load_file(str(more / "solver" / "model.safetensors"))
    assert not all(a[k].equal(v) for k, v in c.items())
    # Not a saved team: a clear error naming the file.
    res = run_here(capsys, "sft", str(TINY), "--out", str(tmp_path / "x"), "--resume-from", str(tmp_path), *common)
    assert res.returncode == 2 and "sft.json" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr  # one line, no traceback
