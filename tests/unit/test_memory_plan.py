"""The memory plan: what each agent needs (weights, gradients, optimizer, engine, KV cache,
activations) from its model's shape, whether the team fits each worker, and the run that
follows from it: refused when nothing fits, trained with trainer states swapped out when only
some fit, with the same weights as a run that keeps every state resident."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flexmarl_core.config import ConfigError, load_config
from flexmarl_core.control import memory
from flexmarl_core.driver import run
from flexmarl_core.runtime.worker import context, load_weights
from flexmarl_core.sim.threads import ThreadExecutor, stage_fn

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
AGENTS = ("planner", "solver", "verifier")
BIG = [f"team.agents.{a}.model.preset=small-0.5b" for a in AGENTS]


def _one_worker(limit: str, resident: int | None = None) -> str:
    extra = f", resident_trainers: {resident}" if resident else ""
    return f"cluster.workers=[{{name: w0, resources: {{rollout: 1, train: 1}}, memory_limit: {limit}{extra}}}]"


def test_sizes_read_as_dask_reads_a_memory_limit():
    from dask.utils import parse_bytes

    for text in ("6GiB", "512 MB", "1e9", "20GiB", "300MiB", "2 GB", "1024", "5kB", "1.5TiB"):
        assert memory.parse_size(text) == parse_bytes(text), text
    with pytest.raises(ValueError, match="not a memory size"):
        memory.parse_size("lots")


def test_the_terms_follow_the_models_shape():
    cfg = load_config(TINY, BIG)
    m = memory.agent_memory(cfg, cfg.agent("solver"))
    assert 490e6 < m.params < 500e6 and m.trained_params == m.params
    # fp32 AdamW: 4 bytes of weights, 4 of gradients, 8 of moments per parameter; engine fp32
    assert (m.weights, m.grads, m.optimizer, m.engine) == (4 * m.params, 4 * m.params, 8 * m.params, 4 * m.params)
    bf16 = load_config(TINY, [*BIG, "team.agents.solver.model.dtype=bfloat16"])
    half = memory.agent_memory(bf16, bf16.agent("solver"))
    assert half.engine == 2 * m.params and half.kv_cache == m.kv_cache // 2
    kl = memory.agent_memory(cfg, cfg.agent("solver").model_copy(
        update={"algorithm": cfg.agent("solver").algorithm.model_copy(update={"kl_coef": 0.1})}))
    assert kl.reference == 4 * m.params


def test_a_team_that_fits_nowhere_is_refused_with_the_figures_and_one_that_fits_with_swap_says_so():
    with pytest.raises(ConfigError) as err:
        memory.check(load_config(TINY, [*BIG, _one_worker("6GiB")]))
    msg = str(err.value)
    assert "cluster.workers[w0]" in msg and "even with one trainer state resident" in msg
    assert "memory plan (GiB)" in msg and "solver  494.0M" in msg

    lines = memory.check(load_config(TINY, [*BIG, _one_worker("20GiB")]))
    assert any("fits with swap: at most 1 of 3 trainer states resident" in line for line in lines)
    # every state resident, asked for by hand: refused with the figures
    with pytest.raises(ConfigError, match=r"cluster.workers\[w0\].resident_trainers: 3 trainer states do not fit"):
        memory.check(load_config(TINY, [*BIG, _one_worker("20GiB", 3)]))
    with pytest.raises(ConfigError, match="needs codesign.on_demand_allocation: true"):
        memory.check(load_config(TINY, [*BIG, _one_worker("20GiB"), "codesign.on_demand_allocation=false"]))
    # tiny models: one line, every worker fits
    (line,) = memory.check(load_config(TINY))
    assert line.startswith("memory plan: every worker fits") and "w0" in line and "w1" in line


def _train(tmp_path: Path, name: str, resident: int | None) -> Path:
    small = ["train.iterations=2", "batch.inputs_per_iteration=2", "batch.micro_batch_inputs=1",
             "batch.group_size=2", "train.warm_start=none", "train.evaluate_initial=false",
             "train.evaluate=false", f"run_dir={tmp_path / name}", _one_worker("6GiB", resident)]
    cfg = load_config(TINY, small)
    run_dir = run.prepare_run(cfg, log=lambda _: None)
    ex = ThreadExecutor(stage_fn(str(run_dir)), {"w0": {"rollout": 1, "train": 1}})
    try:
        run.train(cfg, run_dir, ex)
    finally:
        ex.close()
    return run_dir


def test_trainer_states_swapped_out_train_exactly_as_resident_ones(tmp_path):
    """One trainer state resident at a time (three agents, two micro-batches each per iteration,
    so a state leaves mid-iteration with gradients accumulated): the final weights are the same
    bits as with every state resident."""
    resident, swapped = _train(tmp_path, "resident", None), _train(tmp_path, "swapped", 1)
    ctx = context(swapped)
    assert ctx.resident_limit == 1 and context(resident).resident_limit is None
    for a in AGENTS:
        want, got = load_weights(context(resident).loc, a, 2), load_weights(ctx.loc, a, 2)
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), (a, k)
    ops = [line for line in (swapped / "metrics" / "ops.jsonl").read_text().splitlines() if '"swap_in_s"' in line]
    assert ops, "no trainer state was swapped back in"
