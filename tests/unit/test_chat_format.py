"""A YAML team's agent in its model's own chat format: its `system` message and its rendered
template as the user message, through its `chat_template`, give exactly the prompt (text and
token ids) that the program endpoint renders for those two messages, and a run rolls out and
trains on that format."""

from __future__ import annotations

import copy
from pathlib import Path

import openai
import pytest

from flexmarl_core.config import ConfigError, load_config
from flexmarl_core.driver import run
from flexmarl_core.meg import MEG
from flexmarl_core.models import load_agent_model, save_model
from flexmarl_core.programs.engines import LocalDispatcher
from flexmarl_core.programs.gateway import Gateway, Session
from flexmarl_core.programs.team import agent_spec
from flexmarl_core.sim.threads import ThreadExecutor, stage_fn
from flexmarl_core.teams.graph import prompt
from storage import MEGStore
from tests._models_util import tiny_model, tokenizer

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
SYSTEM = "You solve arithmetic. Answer with the number only."
#: a model whose tokenizer has a chat format of its own (not the built-in chatml)
OWN = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
       "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def own_format_model(tmp_path_factory) -> Path:
    tok = copy.deepcopy(tokenizer())  # the shared test tokenizer keeps its own template
    tok.chat_template = OWN
    return save_model(tiny_model(seed=5), tok, tmp_path_factory.mktemp("own") / "model")


def _solver(over: list[str]):
    cfg = load_config(TINY, over)
    return cfg, MEG.from_config(cfg.team), cfg.agent("solver")


@pytest.mark.parametrize("fmt", ["chatml", "tokenizer"])
def test_a_yaml_agents_prompt_is_what_the_endpoint_renders_for_its_messages(fmt, own_format_model):
    over = [f"team.agents.solver.chat_template={fmt}", f"team.agents.solver.system={SYSTEM}"]
    if fmt == "tokenizer":
        over.append(f"team.agents.solver.model.path={own_format_model}")
    cfg, meg, acfg = _solver(over)
    user = prompt(meg, "solver", "3+4", {"planner": "add them"})
    assert user.startswith("<|im_start|>system\n" if fmt == "chatml" else "[system] " + SYSTEM)

    model, tok = load_agent_model(acfg.model, seed=cfg.seed)
    gw = Gateway.shared()
    s = Session("k", {"solver": agent_spec(acfg, cfg.seed)}, {"solver": 0},
                LocalDispatcher.of_engines({"solver": _engine(model, tok)}), lambda *a: 0)
    t = gw.open(s, "p0", 0, 0)
    try:
        text = "Q:3+4\nP:add them\nA:"  # the template `Q:{input}\nP:{planner}\nA:` filled
        openai.OpenAI(base_url=gw.base_url, api_key=t.key, max_retries=0).chat.completions.create(
            model="solver", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}])
    finally:
        gw.finish(t)
        gw.close(s)
    rec = t.records[-1]
    assert rec.prompt_text == user
    assert rec.prompt_ids == tok.encode(user, add_special_tokens=False)


def _engine(model, tok):
    from flexmarl_core.inference.hf import HFInferenceEngine

    return HFInferenceEngine(model, tok)


def test_system_needs_a_chat_format_and_plain_is_unchanged():
    with pytest.raises(ConfigError, match=r"agent 'solver': `system` needs turns .*chatml, tokenizer"):
        load_config(TINY, [f"team.agents.solver.system={SYSTEM}"])
    _, meg, _ = _solver([])
    assert prompt(meg, "solver", "3+4", {"planner": "p"}) == "Q:3+4\nP:p\nA:"


def test_a_run_rolls_out_and_trains_in_the_models_own_format(own_format_model, tmp_path):
    small = ["train.iterations=1", "batch.inputs_per_iteration=2", "batch.micro_batch_inputs=2",
             "batch.group_size=2", "train.warm_start=none", "train.evaluate_initial=false",
             "train.evaluate=false", f"run_dir={tmp_path / 'run'}", "team.agents.solver.chat_template=tokenizer",
             f"team.agents.solver.system={SYSTEM}", f"team.agents.solver.model.path={own_format_model}"]
    cfg = load_config(TINY, small)
    run_dir = run.prepare_run(cfg)
    ex = ThreadExecutor(stage_fn(str(run_dir)), {"w0": {"rollout": 1, "train": 1}})
    try:
        run.train(cfg, run_dir, ex)
    finally:
        ex.close()
    tbl = MEGStore(cfg.resolved_store_uri()).read_samples(
        "solver", 0, columns=["prompt_text", "prompt_ids", "consumed_step"]).to_pylist()
    tok = load_agent_model(cfg.agent("solver").model, seed=cfg.seed)[1]
    assert len(tbl) == 4
    for row in tbl:
        assert row["prompt_text"].startswith(f"[system] {SYSTEM}\n[user] Q:") and row["prompt_text"].endswith("[assistant] ")
        assert row["prompt_ids"] == tok.encode(row["prompt_text"], add_special_tokens=False)
        assert row["consumed_step"] is not None  # trained
