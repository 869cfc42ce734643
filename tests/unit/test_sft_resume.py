"""`run_sft(resume_from=...)` continues bit for bit: each saved team holds its trainers' state
(Adam moments, step counter, RNG) and the demonstration sampler's RNG, so k steps, a save, a
resume and N-k more give the weights and moments of N uninterrupted steps. A folder saved
before that state existed still resumes, saying the optimizer starts fresh; a damaged state
file fails naming itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flexmarl_core.config import load_config
from flexmarl_core.driver.sft import STATE_NAME, ResumeStateError, run_sft
from flexmarl_core.training.handles import load
from tests import _models_util  # noqa: F401  (one torch thread for the tiny models)

REPO = Path(__file__).resolve().parents[2]
AGENTS = ("planner", "solver", "verifier")
# Never reaches the target (the tiny team scores 0), so every run trains to sft_max_steps;
# sft_perturb's default 0.2 makes the sampler's RNG matter.
TINY_SFT = ["train.sft_eval_every=2", "train.sft_eval_size=2", "train.sft_batch=4",
            "train.sft_target_accuracy=1.0", "workload.heldout_size=4"]


def _sft(out: Path, steps: int, resume: Path | None = None, *, keep_checks: bool = False) -> list[str]:
    cfg = load_config(REPO / "configs" / "tiny.yaml", [*TINY_SFT, f"train.sft_max_steps={steps}"])
    lines: list[str] = []
    run_sft(cfg, out, log=lines.append, keep_checks=keep_checks, resume_from=resume)
    return lines


def _state(folder: Path) -> dict:
    with open(folder / STATE_NAME, "rb") as f:
        return load(f, what=str(folder / STATE_NAME))


def _assert_same_team(a: Path, b: Path) -> None:
    for agent in AGENTS:
        wa, wb = (load_file(str(d / agent / "model.safetensors")) for d in (a, b))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), agent
    sa, sb = _state(a), _state(b)
    assert sa["python_rng"] == sb["python_rng"] and torch.equal(sa["torch_rng"], sb["torch_rng"])
    assert sa["trainers"].keys() == sb["trainers"].keys() == set(AGENTS)
    for agent, ta in sa["trainers"].items():
        tb = sb["trainers"][agent]
        assert ta["version"] == tb["version"] == 4 and torch.equal(ta["params"], tb["params"]), agent
        assert ta["adam"].keys() == tb["adam"].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(ta["adam"][k], tb["adam"][k]) for k in ta["adam"]), agent


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps in one go, saving the team at steps 0, 2 and 4."""
    out = tmp_path_factory.mktemp("sft") / "full"
    _sft(out, 4, keep_checks=True)
    return out


def test_resume_from_a_check_equals_the_uninterrupted_run(uninterrupted: Path, tmp_path: Path) -> None:
    lines = _sft(tmp_path / "resumed", 4, uninterrupted / "step-2")
    assert not any("starts fresh" in line for line in lines)
    _assert_same_team(uninterrupted, tmp_path / "resumed")


def test_resume_from_a_finished_run_equals_the_uninterrupted_run(uninterrupted: Path, tmp_path: Path) -> None:
    _sft(tmp_path / "short", 2)  # stops at step 2, saving `<out>` itself
    _sft(tmp_path / "longer", 4, tmp_path / "short")
    _assert_same_team(uninterrupted, tmp_path / "longer")


def test_a_check_without_optimizer_state_resumes_fresh_and_says_so(uninterrupted: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(uninterrupted / "step-2", old)
    (old / STATE_NAME).unlink()  # as saved before SFT kept it
    meta = json.loads((old / "sft.json").read_text())
    del meta["state_sha256"]
    (old / "sft.json").write_text(json.dumps(meta))
    lines = _sft(tmp_path / "fresh", 4, old)
    said = [line for line in lines if "optimizer starts fresh" in line]
    assert len(said) == 1 and str(old / STATE_NAME) in said[0], lines
    # The difference it announces is real (and this file's exactness checks can see it).
    a, b = (load_file(str(d / "solver" / "model.safetensors")) for d in (uninterrupted, tmp_path / "fresh"))
    assert not all(torch.equal(a[k], b[k]) for k in a)


def test_a_damaged_or_missing_state_file_fails_naming_it(uninterrupted: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(uninterrupted / "step-2", bad)
    path = bad / STATE_NAME
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the tensor bytes
    path.write_bytes(bytes(data))
    with pytest.raises(ResumeStateError, match="damaged") as e:
        _sft(tmp_path / "x", 4, bad)
    assert str(path) in str(e.value)
    path.unlink()
    with pytest.raises(ResumeStateError, match="not found") as e:
        _sft(tmp_path / "x", 4, bad)
    assert str(path) in str(e.value)


@pytest.mark.parametrize(("content", "says"), [
    (None, "not found"), ("{not json", "cannot be read as JSON"), ("[1, 2]", "no integer field 'steps'"),
    ('{"steps": "two"}', "no integer field 'steps'"), ("folder", "cannot be read as JSON")])
def test_a_folder_that_is_not_a_saved_team_fails_naming_its_sft_json(tmp_path: Path, content, says) -> None:
    """Read before any model is built: each way an `sft.json` can be wrong is one error that
    names the file (the CLI prints it as one line, exit 2)."""
    meta = tmp_path / "team" / "sft.json"
    meta.parent.mkdir()
    if content == "folder":
        meta.mkdir()
    elif content is not None:
        meta.write_text(content)
    with pytest.raises(ResumeStateError, match=says) as e:
        _sft(tmp_path / "x", 4, meta.parent)
    assert str(meta) in str(e.value)


def test_sft_beside_busy_cores_trains_on_the_free_ones_and_gives_torch_its_count_back(tmp_path, monkeypatch):
    """`run_sft` in this process takes the cores the auto layout would (`FLEXMARL_CORES` here:
    a share of the machine), not torch's thread per core, which beside a busy core wait for it at
    every OpenMP barrier (an SFT of this team ran 15x slower on two threads there)."""
    monkeypatch.setenv("FLEXMARL_CORES", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cfg = load_config(REPO / "configs" / "tiny.yaml", [*TINY_SFT, "train.sft_max_steps=2"])
        seen: list[tuple[str, int]] = []
        run_sft(cfg, tmp_path / "sft", log=lambda line: seen.append((line, torch.get_num_threads())))
        assert seen[0][0].startswith("sft: 1 torch thread"), seen
        assert all(n == 1 for line, n in seen[1:] if line.startswith("sft step")), seen
        assert torch.get_num_threads() == 2  # put back afterwards
    finally:
        torch.set_num_threads(before)
