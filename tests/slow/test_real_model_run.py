"""The shipped real-model config (`configs/qwen_gsm8k.yaml`) trains as shipped, through the
Prefect flow on the Dask cluster, on GSM8K from the data folder, with a small model of the same
architecture (Qwen2ForCausalLM, a tokenizer with a chat template) put into a hub cache where
Qwen2.5-0.5B-Instruct would be: the hub id resolves offline and is pinned, both agents load it,
and their prompts are rendered by the model's own chat template. Overridden only in size."""

from __future__ import annotations

from pathlib import Path

import yaml

from flexmarl_core.config import load_config
from flexmarl_core.models import load_tokenizer
from storage import MEGStore
from tests._models_util import publish

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "qwen_gsm8k.yaml")
HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"
COMMIT = "b" * 40
SMALL = ["train.iterations=1", "train.evaluate_initial=false", "workload.heldout_size=2",
         "batch.inputs_per_iteration=2", "batch.group_size=2", "batch.micro_batch_inputs=1",
         "team.agents.planner.sampling.max_new_tokens=8", "team.agents.solver.sampling.max_new_tokens=8",
         "cluster.torch_threads=1", "cluster.prefect_lean=true"]


def test_the_shipped_qwen_config_trains_on_a_stand_in_of_its_model(dask_cluster, gsm8k_dir, tmp_path, monkeypatch):
    from flows.train import train

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = publish(cache, HUB_ID, COMMIT, seed=5)
    monkeypatch.setenv("FLEXMARL_DATA", str(gsm8k_dir.parent))
    run = tmp_path / "run"
    state = train(CONFIG, [f"run_dir={run}", f"cluster.address={dask_cluster}", *SMALL], progress=False,
                  return_state=True)
    assert state.is_completed(), state.message

    saved = yaml.safe_load((run / "config.yaml").read_text())
    for a in saved["team"]["agents"]:
        assert (a["model"]["hub_id"], a["model"]["revision"], a["model"]["path"]) == (HUB_ID, COMMIT, str(snapshot))
    cfg = load_config(run / "config.yaml")
    store, tok = MEGStore(cfg.resolved_store_uri()), load_tokenizer(snapshot)
    texts = {r["input_id"]: r["text"] for r in store.read_inputs(0).to_pylist()}
    for agent in ("planner", "solver"):
        rows = store.read_samples(agent, 0).to_pylist()
        assert len(rows) == 2 * 2
        a = cfg.agent(agent)
        for r in rows:
            # The model's own template renders [system, user]: the planner's user turn is the question.
            prompt = tok.decode(r["prompt_ids"])
            assert prompt.startswith(f"<|im_start|>system\n{a.system}<|im_end|>\n<|im_start|>user\n"), prompt
            assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
            assert texts[r["input_id"]] in prompt
    summary = (run / "metrics" / "summary.json").read_text()
    assert "heldout_accuracy" in summary
