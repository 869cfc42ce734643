"""Mixed-adapter batches across rollout ops (`codesign.mixed_batch_window_s`): rollouts of LoRA
agents on one base that run at the same time in a worker process share one decode, through the
real stages and store (on the in-process executor), and the run samples what it samples with
mixing off."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

pytest.importorskip("peft")

from flexmarl_core.config import ConfigError, load_config  # noqa: E402
from tests._golden import fingerprint  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
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
# `generate` call, each with its own samples) is `tests/slow/test_backends.py`.
#: The in-process executor runs an op at a time per worker: the planner's worker and the one
#: the solver and verifier share run two rollouts at once in this process, as one Dask worker
#: with two threads would (mixing wants a worker config with nthreads > 1: w0 says 2). One
#: training slot, as that one process has: the agents' trainers share the base model.
THREADED = ("cluster.workers=[{name: w0, nthreads: 2, resources: {rollout:planner: 1, train: 1}}, "
            "{name: w1, resources: {rollout:solver: 1, rollout:verifier: 1}}]")


def test_concurrent_rollouts_of_two_agents_share_a_decode_and_sample_what_they_sample_alone(
        tmp_path, monkeypatch):
    """Two runs of the LoRA team through the real stages on the in-process executor: mixing off,
    and on with a 0.3 s window. In the mixed run the planner's second rollout and the solver's
    first are held at the batcher's door until both are there (a barrier), so they meet within
    the window by construction, not by how the threads happen to be scheduled."""
    from flexmarl_core.driver import run
    from flexmarl_core.inference.coalesce import Coalescer
    from flexmarl_core.sim.threads import ThreadExecutor, stage_fn

    calls: dict[str, int] = {}
    door = threading.Barrier(2, timeout=120)
    generate = Coalescer.generate

    def meet(self, agent, version, prompts, sampling, seed):
        calls[agent] = calls.get(agent, 0) + 1
        if (agent, calls[agent]) in {("planner", 2), ("solver", 1)}:
            door.wait()  # the first solver rollout needs one planner rollout done: no deadlock
        return generate(self, agent, version, prompts, sampling, seed)

    common = [THREADED, "codesign.load_balancing=false", "train.iterations=3", "train.evaluate=false", *LORA]
    prints = {}
    for name, window in (("alone", "null"), ("mixed", "0.3")):
        if name == "mixed":
            monkeypatch.setattr(Coalescer, "generate", meet)
        cfg = load_config(TINY, [f"run_dir={tmp_path / name}", f"codesign.mixed_batch_window_s={window}", *common])
        run_dir = run.prepare_run(cfg, log=lambda _: None)
        ex = ThreadExecutor(stage_fn(str(run_dir)), {w.name: dict(w.resources) for w in cfg.cluster.workers})
        try:
            out = run.train(cfg, run_dir, ex)
        finally:
            ex.close()
        prints[name] = (fingerprint(run_dir), out.iterations)
    assert calls["planner"] >= 2 and not door.broken
    (alone, alone_rows), (mixed, mixed_rows) = prints["alone"], prints["mixed"]

    def total(rows: list[dict], metric: str) -> float:
        return sum(v for r in rows for k, v in r.items() if k.endswith(f"/rollout/{metric}"))

    # Mixing off: every rollout op is one decode of its agent's rows alone.
    ops = 3 * 2 * len(AGENTS)  # iterations x micro-batches x agents
    assert total(alone_rows, "decodes") == ops and total(alone_rows, "mixed_rows") == 0
    # Mixing on: some decodes served rows of two different agents, so fewer decodes ran.
    assert total(mixed_rows, "mixed_rows") > 0, mixed_rows
    assert total(mixed_rows, "decodes") < ops
    # The shared base engine's clock, through each agent's view and through a shared decode
    # (each op its rows' part of the decode's seconds): prefill is a part of decoding.
    for r in alone_rows + mixed_rows:
        for a in AGENTS:
            assert 0 < r[f"agent/{a}/rollout/prefill_share"] < 1, (a, r)
    # The same samples: tokens exact (each op keeps its own seeded generator); the behaviour
    # logprobs only up to summation order, a few fp32 ulps per token (|logprob| < ~20 over
    # ~100 tokens per agent and iteration: 1e-3 on the sum bounds that with room).
    for key, want in alone["samples"].items():
        got = mixed["samples"][key]
        assert (got["n"], got["tokens_sha256"]) == (want["n"], want["tokens_sha256"]), key
        assert got["logprob_sum"] == pytest.approx(want["logprob_sum"], abs=1e-3), key
        assert got["reward_sum"] == want["reward_sum"], key
