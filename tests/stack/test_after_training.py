"""After a real run (the Prefect flow on the Dask cluster, a program team, its held-out
evaluation before and after as the run makes them): `flexmarl eval` gives the run's own figures
for the same versions and set, through the team's program, and `flexmarl export` writes the
figures into each agent's model card."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoModelForCausalLM

from flexmarl.cli import main
from tests.stack.test_program_team_run import SMALL, _flow


def test_eval_and_export_after_a_run_give_its_own_heldout_figures(dask_cluster, tmp_path, capsys):
    run = tmp_path / "run"
    state = _flow([f"run_dir={run}", f"cluster.address={dask_cluster}", *SMALL, "train.evaluate=true",
                   "train.evaluate_initial=true"])
    assert state.is_completed(), state.message
    summary = json.loads((run / "metrics" / "summary.json").read_text())["summary"]
    for version, prefix in ((2, ""), (0, "initial_")):
        out = tmp_path / f"eval-{version}.json"
        assert main(["eval", str(run), "--version", str(version), "--json", str(out)]) == 0
        got = json.loads(out.read_text())
        # The same greedy decodes of the same problems: the same answers, so the same figures.
        assert got["heldout_accuracy"] == summary[f"{prefix}heldout_accuracy"]
        assert got["heldout_n"] == summary[f"{prefix}heldout_n"] == 8
        for agent in ("planner", "solver", "verifier"):
            assert abs(got[f"heldout_reward/{agent}"] - summary[f"{prefix}heldout_reward/{agent}"]) < 1e-9
        assert got["run_measured"]["heldout_accuracy"] == got["heldout_accuracy"]
        assert "(the same)" in capsys.readouterr().out
    # The run's own program named by --program: the run's own evaluation again, said to be the same.
    program = Path(__file__).resolve().parents[2] / "examples" / "programs" / "arith_team.py"
    out = tmp_path / "eval-program.json"
    assert main(["eval", str(run), "--program", f"{program}:team", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["heldout_accuracy"] == summary["heldout_accuracy"]
    assert "(the same)" in capsys.readouterr().out
    exported = tmp_path / "export"
    assert main(["export", str(run), "--out", str(exported)]) == 0
    card = (exported / "verifier" / "README.md").read_text()
    assert f"held-out accuracy with these weights: {summary['heldout_accuracy']:.3f} on 8 problems" in card
    assert "arith_team.py:team` calls it as `model='verifier'`" in card  # the program's path, resolved
    assert AutoModelForCausalLM.from_pretrained(Path(exported) / "verifier").config.model_type == "qwen2"
