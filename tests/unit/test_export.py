"""After training: `flexmarl export` writes folders that transformers loads, unchanged, to the
logits of flexmarl's own engines and to the prompt ids training used, for full and LoRA agents,
from a run on local disk or on object storage; `flexmarl eval` makes the run's own evaluation
at any kept version; bad input is one line, exit 2, and leaves nothing written. (`flexmarl
serve`: tests/unit/test_serve.py.)"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from flexmarl.cli import main
from flexmarl_core.config import SamplingConfig, load_config
from flexmarl_core.meg import MEG
from flexmarl_core.runtime.worker import context
from storage import MEGStore
from tests._runs import train_on_threads

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
AGENTS = ("planner", "solver", "verifier")
#: a tiny team trained for real in seconds: one worker, a reward that varies for untrained
#: models (so every agent's advantages are non-zero) and a rate that moves the weights visibly
COMMON = ["cluster.workers=[{name: w0, resources: {rollout: 1, train: 1}}]", "train.evaluate=false",
          "train.evaluate_initial=false", "train.warm_start=none", "workload.heldout_size=8",
          "workload.reward=tests.reward_fns:varied", "workload.credit=team",
          *(f"team.agents.{a}.algorithm.lr=0.01" for a in AGENTS)]
#: the solver's prompts are turns (a system message, its template as the user's), the others' plain text
TURNS = ["team.agents.solver.chat_template=chatml", "team.agents.solver.system=Solve it."]
LORA = [f"team.agents.{a}.model={{base: tiny-1m, lora: {{rank: 4}}}}" for a in ("planner", "solver")]
PROMPTS = ["Q:3+4*2\nP:", "Q:9-1*5\nP:3+4\nA:", "<|im_start|>user\nQ:1+1<|im_end|>\n"]


def _train(root: Path, extra: list[str]) -> Path:
    cfg = load_config(TINY, [f"run_dir={root / 'run'}", *COMMON, *extra])
    folder, _ = train_on_threads(cfg)
    return Path(folder)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """Two iterations: versions 0 and 2 kept (retention deleted 1)."""
    return _train(tmp_path_factory.mktemp("full"), TURNS)


@pytest.fixture(scope="module")
def exported(run: Path) -> Path:
    out = run.parent / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    return out


def _logits(model, prompt_ids: list[int], **kw) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt_ids]), **kw).logits[0]


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


def test_export_loads_in_transformers_to_the_engines_logits(run, exported, tmp_path):
    ctx = context(str(run))
    v0 = tmp_path / "v0"
    assert main(["export", str(run), "--out", str(v0), "--version", "0", "--agent", "solver"]) == 0
    assert sorted(p.name for p in v0.iterdir() if p.is_dir()) == ["solver"]
    for agent in AGENTS:
        folder = exported / agent
        assert (folder / "model.safetensors").is_file()
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tok = AutoTokenizer.from_pretrained(folder)
        eng = ctx.engine(agent, 2)
        for p in PROMPTS:
            ids = eng.tokenizer.encode(p, add_special_tokens=False)
            assert tok.encode(p, add_special_tokens=False) == ids
            want = _logits(eng.model, ids)
            # The same fp32 weights through the same modules: equal up to the summation order of
            # another kernel choice, ~1e-7 at these magnitudes (|logit| ~ 1).
            torch.testing.assert_close(_logits(model, ids), want, rtol=0, atol=1e-5)
            if agent == "solver":  # the trained version, not the initial one (lr 0.01 moved it)
                initial = AutoModelForCausalLM.from_pretrained(v0 / "solver").eval()
                assert (_logits(initial, ids) - want).abs().max() > 1e-3
        sampling = ctx.cfg.agent(agent).sampling
        gen = GenerationConfig.from_pretrained(folder)
        assert (gen.max_new_tokens, gen.temperature, gen.top_p, gen.stop_strings) == (
            sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.stop)
        assert tok.eos_token_id in gen.eos_token_id
        card = (folder / "README.md").read_text()
        commit = json.loads((run / "provenance.json").read_text())["commit"]
        assert f"{agent}, weights version 2" in card and f"`{run}`" in card and str(commit) in card
    manifest = json.loads((exported / "flexmarl-export.json").read_text())
    assert {a: e["version"] for a, e in manifest["agents"].items()} == dict.fromkeys(AGENTS, 2)
    assert (exported / "config.yaml").read_text() == (run / "config.yaml").read_text()


def test_the_tokenizer_renders_the_agents_training_prompts_to_their_ids(run, exported):
    """Every prompt the run sampled from, rebuilt as messages (the agent's system message, its
    template filled from the problem and its parents' answers as the user's) and rendered by
    the exported tokenizer's chat template: the very ids training stored."""
    cfg = context(str(run)).cfg
    meg, store = MEG.from_config(cfg.team), MEGStore(cfg.resolved_store_uri())
    checked = 0
    for it in range(cfg.train.iterations):
        texts = {r["input_id"]: r["text"] for r in store.read_inputs(it).to_pylist()}
        rows = {a: store.read_samples(a, it).to_pylist() for a in AGENTS}
        answers = {r["sample_id"]: r["response_text"] for rs in rows.values() for r in rs}
        for agent in AGENTS:
            tok = AutoTokenizer.from_pretrained(exported / agent)
            system = cfg.agent(agent).system
            for r in rows[agent]:
                parents = {p.split(":")[2]: answers[p] for p in r["parents"]}
                user = meg.render_prompt(agent, texts[r["input_id"]], parents)
                msgs = [{"role": "system", "content": system}] * (system is not None) + [
                    {"role": "user", "content": user}]
                assert _ids(tok.apply_chat_template(msgs, add_generation_prompt=True)) == r["prompt_ids"], (
                    agent, r["sample_id"])
                checked += 1
    # every sample: 2 iterations x 4 problems x 2 trajectories x 3 agents
    assert checked == cfg.train.iterations * cfg.batch.inputs_per_iteration * cfg.batch.group_size * len(AGENTS)
    assert "<|im_start|>system\nSolve it." in AutoTokenizer.from_pretrained(exported / "solver").apply_chat_template(
        [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "x"}], tokenize=False)


def test_lora_agents_export_merged_and_as_adapters_on_their_base(tmp_path):
    from peft import AutoPeftModelForCausalLM

    run = _train(tmp_path, LORA)
    merged, adapters = tmp_path / "merged", tmp_path / "adapters"
    assert main(["export", str(run), "--out", str(merged), "--max-shard-size", "2MB"]) == 0
    assert main(["export", str(run), "--out", str(adapters), "--adapter"]) == 0
    ctx = context(str(run))
    for agent in ("planner", "solver"):
        assert (merged / agent / "model.safetensors.index.json").is_file()  # 4.4 MB in 2 MB shards
        plain = AutoModelForCausalLM.from_pretrained(merged / agent).eval()
        conf = json.loads((adapters / agent / "adapter_config.json").read_text())
        base = Path(conf["base_model_name_or_path"])
        assert base.parent == adapters and base.is_dir()  # the run's base, written beside the adapters
        peft = AutoPeftModelForCausalLM.from_pretrained(adapters / agent).eval()
        base_only = AutoModelForCausalLM.from_pretrained(base).eval()
        eng = ctx.engine(agent, 2)
        for p in PROMPTS:
            ids = eng.tokenizer.encode(p, add_special_tokens=False)
            want = _logits(eng.shared.model, ids, adapter_names=[agent])
            # Merged: W + s*B@A rounded once to fp32, against x@W + s*(x@A)@B: ~5e-7 at |logit| ~ 1.
            torch.testing.assert_close(_logits(plain, ids), want, rtol=0, atol=1e-5)
            # The adapter through PEFT: the engine's own modules and operations.
            torch.testing.assert_close(_logits(peft, ids), want, rtol=0, atol=1e-6)
            assert (_logits(base_only, ids) - want).abs().max() > 1e-3  # the adapter trained
    manifest = json.loads((adapters / "flexmarl-export.json").read_text())
    assert [manifest["agents"][a]["kind"] for a in AGENTS] == ["adapter", "adapter", "full"]
    assert (adapters / "verifier" / "model.safetensors").is_file()
    # What `flexmarl serve` decodes with, from each export and from one agent's folder of it:
    # the engine's greedy tokens (each adapter merged into the base it names).
    from flexmarl_core.programs.api import DecodeGroup, DecodeStats
    from flexmarl_core.programs.serve import team_of_folder

    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    for folder, agent in ((adapters, "solver"), (adapters / "planner", "planner")):
        served = team_of_folder(str(folder))
        ids = ctx.engine(agent, 2).tokenizer.encode(PROMPTS[1], add_special_tokens=False)
        got = served.dispatcher.decode(agent, 2, [DecodeGroup(tuple(ids), greedy, 0)], DecodeStats())[0][0]
        assert got.response_ids == ctx.engine(agent, 2).generate([ids], greedy, 0)[0].response_ids, folder
        assert served.versions[agent] == 2 and served.agents[agent].sampling == ctx.cfg.agent(agent).sampling


def test_an_adapter_on_a_hub_model_names_its_hub_id(tmp_path, monkeypatch):
    """A LoRA base that is a hub model as it is (no warm start trained it) is named by its id:
    PEFT loads the base from the Hugging Face cache (here one populated offline)."""
    from peft import AutoPeftModelForCausalLM

    from flexmarl_core.models import save_model
    from tests._models_util import tiny_model, tokenizer

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-chat"
    save_model(tiny_model(seed=3), tokenizer(), repo / "snapshots" / ("1" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    run = _train(tmp_path, ["team.agents.solver.model={base: acme/tiny-chat, lora: {rank: 4}}",
                            "train.iterations=1"])
    out = tmp_path / "adapters"
    assert main(["export", str(run), "--out", str(out), "--adapter", "--agent", "solver"]) == 0
    assert json.loads((out / "solver" / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "acme/tiny-chat")
    assert not list(out.glob("base-*")) and "base_model: acme/tiny-chat" in (out / "solver" / "README.md").read_text()
    # huggingface_hub read HF_HOME and HF_HUB_OFFLINE when it was imported: say both again here
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    peft = AutoPeftModelForCausalLM.from_pretrained(out / "solver", cache_dir=str(tmp_path / "hf" / "hub"),
                                                    local_files_only=True).eval()
    eng = context(str(run)).engine("solver", 1)
    ids = eng.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    torch.testing.assert_close(_logits(peft, ids), _logits(eng.shared.model, ids, adapter_names=["solver"]),
                               rtol=0, atol=1e-6)  # the engine's modules and operations


def test_a_run_on_object_storage_exports_the_same_folder(run, exported, s3_server, monkeypatch, tmp_path):
    from flexmarl_core.runfiles.location import RunLocation
    from tests._s3 import aws_env, make_bucket

    for k, v in aws_env(s3_server).items():
        monkeypatch.setenv(k, v)
    make_bucket(s3_server, "export-runs")
    uri = "s3://export-runs/runs/tiny"
    loc = RunLocation(uri)
    for f in run.rglob("*"):
        if f.is_file() and "store" not in f.parts:
            loc.upload(f, f.relative_to(run).as_posix())
    out = tmp_path / "from-s3"
    assert main(["export", uri, "--out", str(out)]) == 0
    local = {p.relative_to(exported): p for p in exported.rglob("*") if p.is_file()}
    remote = {p.relative_to(out): p for p in out.rglob("*") if p.is_file()}
    assert local.keys() == remote.keys()
    for rel, p in local.items():
        if rel.name in ("README.md", "flexmarl-export.json"):  # they name where the run and the export are
            want = p.read_text().replace(str(run), "RUN").replace(str(exported), "OUT")
            assert remote[rel].read_text().replace(uri, "RUN").replace(str(out), "OUT") == want, rel
        else:
            assert remote[rel].read_bytes() == p.read_bytes(), rel


def _refused(capsys, argv: list[str], *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for n in needles:
        assert n in err, (n, err)
    return err


def _nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.*")), "a temporary folder was left"


def test_bad_input_is_one_line_and_leaves_nothing(run, tmp_path, capsys):
    out = tmp_path / "out"
    _refused(capsys, ["export", str(run), "--out", str(out), "--agent", "nobody"], "'nobody'", "planner")
    _refused(capsys, ["export", str(run), "--out", str(out), "--version", "1"],
             "no weights version 1", "retention deleted it", "[0, 2]")
    _refused(capsys, ["export", str(run), "--out", str(out), "--version", "7"], "not reached it", "[0, 2]")
    _refused(capsys, ["export", str(tmp_path), "--out", str(out)], "not a flexmarl run folder")
    _nothing_written(out)
    with pytest.raises(SystemExit) as e:
        main(["export", str(run), "--out", str(out), "--version", "newest"])
    assert e.value.code == 2 and "integer >= 0 or latest" in capsys.readouterr().err
    _refused(capsys, ["eval", str(run), "--version", "1"], "retention deleted it", "[0, 2]")

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    _refused(capsys, ["export", str(run), "--out", str(mine)], "exists", "--overwrite")
    _refused(capsys, ["export", str(run), "--out", str(mine), "--overwrite"], "not a flexmarl export")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]

    # A damaged weights file of the last agent: the first two were written, then all is undone.
    broken = tmp_path / "broken"
    shutil.copytree(run, broken, ignore=shutil.ignore_patterns("store"))
    (broken / "weights" / "verifier" / "v2.safetensors").write_bytes(b"not safetensors")
    _refused(capsys, ["export", str(broken), "--out", str(out)], "verifier", "not a safetensors weights file")
    _nothing_written(out)


def test_a_run_still_training_gives_only_the_versions_it_keeps_for_good(run, tmp_path, capsys):
    from flexmarl_core.driver.lease import RunLease
    from flexmarl_core.runfiles.location import RunLocation

    live = tmp_path / "live"
    shutil.copytree(run, live, ignore=shutil.ignore_patterns("store"))
    # Version 1 as a sync of the running run would have published it: kept now, deleted later.
    shutil.copy(live / "weights" / "solver" / "v2.safetensors", live / "weights" / "solver" / "v1.safetensors")
    lease = RunLease.acquire(RunLocation(live), resume=True, overwrite=False)
    try:
        out = tmp_path / "out"
        _refused(capsys, ["export", str(live), "--out", str(out), "--agent", "solver", "--version", "1"],
                 "still training", f"pid {lease.lease.pid}", "keeps for good: [0, 2]")
        _nothing_written(out)
        assert main(["export", str(live), "--out", str(out), "--agent", "solver"]) == 0
        assert "still training" in capsys.readouterr().err
        assert json.loads((out / "flexmarl-export.json").read_text())["agents"]["solver"]["version"] == 2
    finally:
        lease.release()
    # Once it ended, every version on disk is readable again.
    assert main(["export", str(live), "--out", str(tmp_path / "after"), "--agent", "solver", "--version", "1"]) == 0


def test_eval_makes_the_runs_own_evaluation_at_any_kept_version(run, tmp_path, capsys):
    from flexmarl_core.stages.evaluate import evaluate

    ctx = context(str(run))
    for version in (2, 0):
        # What the run's end computes (tasks/report.py `summarise`: the final and initial weights).
        want = evaluate(str(run), version)
        out = tmp_path / f"v{version}.json"
        assert main(["eval", str(run), "--version", str(version), "--json", str(out)]) == 0
        got = json.loads(out.read_text())
        assert got["versions"] == dict.fromkeys(AGENTS, version)
        assert {k: v for k, v in got.items() if k.startswith("heldout")} == {
            k: v for k, v in want.items() if k.startswith("heldout")}
    assert f"held-out accuracy {want['heldout_accuracy']:.4f} on 8 problems" in capsys.readouterr().out
    # The same problems from a file: the same figures (the arithmetic reward reads `plan` from meta).
    problems = ctx.workload.problems("heldout", 8, seed=ctx.cfg.seed)
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"id": p.input_id, "input": p.text, "answer": p.answer, **p.meta}) + "\n"
                            for p in problems))
    assert main(["eval", str(run), "--version", "0", "--data", str(data), "--json", str(tmp_path / "d.json")]) == 0
    from_file = json.loads((tmp_path / "d.json").read_text())
    assert {k: v for k, v in from_file.items() if k.startswith("heldout")} == {
        k: v for k, v in want.items() if k.startswith("heldout")}
    data.write_text('{"input": "1+1"}\n')
    _refused(capsys, ["eval", str(run), "--data", str(data)], "line 1", "answer")


def test_eval_through_a_program_of_the_same_calls_gives_the_yaml_teams_figures(run, tmp_path, capsys):
    """`--program`: the run's agents at a kept version, called by a program making the YAML
    team's very calls: the same greedy decodes, so the run's own figures; a program making
    other calls (no system message for the solver) answers too, the same on every try."""
    from flexmarl_core.stages.evaluate import evaluate

    want = {k: v for k, v in evaluate(str(run), 2).items() if k.startswith("heldout")}
    out = tmp_path / "p.json"
    assert main(["eval", str(run), "--program", f"{REPO}/tests/program_teams.py:tiny_turns", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert {k: v for k, v in got.items() if k.startswith("heldout")} == want
    assert "tiny_turns" in got["set"] and "run_measured" not in got
    other = [f"{REPO}/examples/programs/arith_team.py:team", "--json", str(out)]
    assert main(["eval", str(run), "--program", *other]) == 0
    first = json.loads(out.read_text())
    assert main(["eval", str(run), "--program", *other]) == 0
    assert json.loads(out.read_text()) == first
    capsys.readouterr()
    _refused(capsys, ["eval", str(run), "--program", str(tmp_path / "none.py:team")], "--program", "none.py")
    _refused(capsys, ["eval", str(run), "--program", "no_colon"], "--program", "module:function")
