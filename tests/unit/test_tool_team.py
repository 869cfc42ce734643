"""The tool-using team (configs/tool_team.yaml): the calculator, the tool loop inside a response,
the loss mask that keeps inserted tool output out of the loss, and the store column holding it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from flexmarl_core.algorithms import make_loss_fn, token_weight
from flexmarl_core.config import AlgorithmConfig, SamplingConfig, load_config
from flexmarl_core.driver.sft import demonstration_tokens, sft_loss
from flexmarl_core.inference import HFInferenceEngine
from flexmarl_core.inference.tools import generate_with_tool, split_demonstration
from flexmarl_core.meg import MEG
from flexmarl_core.teams import team_shape
from flexmarl_core.training import Sample, TorchTrainer, TrainerOptions, collate
from flexmarl_core.workloads import WorkloadError, make_workload
from storage import MEGStore
from tests._models_util import ScriptedLM, tiny_model, tokenizer

REPO = Path(__file__).resolve().parents[2]
TOOL = str(REPO / "configs" / "tool_team.yaml")


def _team():
    cfg = load_config(TOOL, [])
    return cfg, make_workload(cfg.workload, cfg.team), MEG.from_config(cfg.team)


def test_calculator_workload_rounds_and_demonstrations():
    cfg, wl, meg = _team()
    calc = wl.tool("solver")
    assert wl.tool("planner") is None
    assert (calc("47*23"), calc(" 12 - 30 "), calc("4*"), calc("x")) == ("=1081", "=-18", "=?", "=?")
    train = {p.text for p in wl.problems("train", 200, seed=0)}
    held = wl.problems("heldout", 200, seed=0)
    assert not train & {p.text for p in held}
    demos = team_shape(cfg).demonstrations(wl, held[:20], seed=0, rng=random.Random(0), perturb=0.0)
    for i, p in enumerate(held[:20]):
        steps = p.meta["steps"]
        # The planner names round 0's operation; the solver's last round holds the answer.
        assert demos["planner"][i][1] == steps[0][0]
        first, last = (t for _, t in demos["solver"][2 * i : 2 * i + 2])
        assert first == f"[{steps[0][0]}]={steps[0][1]};{steps[0][2]}"
        assert last == f"[{steps[1][0]}]={steps[1][1]};{p.answer}"
        outs = {"planner": steps[0][0], "solver": last}
        assert wl.reward(p, outs) == {"planner": 1.0, "solver": 1.0} and wl.is_correct(p, outs)
        assert not wl.is_correct(p, {**outs, "solver": last + "1"})
    # A demonstration is split where the calculator writes: its output is never "sampled".
    assert split_demonstration("[47*23]=1081;1081+19\n", calc) == [
        ("[47*23]", True), ("=1081", False), (";1081+19\n", True)]
    with pytest.raises(ValueError, match="tool's output '=1081'"):
        split_demonstration("[47*23]=1080;1080+19", calc)


def test_words_phrasing_changes_the_text_only():
    cfg, wl, _ = _team()
    words = make_workload(load_config(TOOL, ["workload.params.phrasing=words"]).workload, cfg.team)
    for split in ("train", "heldout"):
        sym, said = wl.problems(split, 40, seed=3), words.problems(split, 40, seed=3)
        # the same expressions, held out alike, solved by the same calls to the same answers
        assert [(p.input_id, p.answer, p.meta) for p in sym] == [(p.input_id, p.answer, p.meta) for p in said]
        for p, q in zip(sym, said, strict=True):
            assert q.text == p.text.replace("+", " plus ").replace("-", " minus ").replace("*", " times ")
    assert "written in words" in words.heldout_description(8)
    with pytest.raises(WorkloadError, match="phrasing"):
        make_workload(load_config(TOOL, ["workload.params.phrasing=prose"]).workload, cfg.team)


def test_turn_credit_pays_the_solver_round_for_its_own_reduction():
    cfg, wl, _ = _team()
    assert wl.params.turn_credit and cfg.workload.format_weight == 0.1
    p = next(p for p in wl.problems("train", 50, seed=0) if "*" in p.text)
    (op, v, rest), (op2, v2, _) = p.meta["steps"]
    right, last = f"[{op}]={v};{rest}", f"[{op2}]={v2};{p.answer}"
    # The seen error: the call is right, the rewrite after it is not (one digit changed).
    wrong = f"[{op}]={v};{rest[:-1]}{(int(rest[-1]) + 1) % 10}"
    final = wl.reward(p, {"planner": op, "solver": last})["solver"]
    # Round 0: 0.9 * (exact reduction) + 0.1 * (format); the last round keeps the team reward.
    assert wl.turn_rewards(p, "solver", [right, last], final) == [1.0, final]
    assert wl.turn_rewards(p, "solver", [wrong, last], 0.1) == [pytest.approx(0.1), 0.1]
    assert wl.turn_rewards(p, "solver", ["no call", last], final) == [0.0, final]
    assert wl.turn_rewards(p, "planner", [op], 0.3) == [0.3]
    # Off: every turn gets the last turn's reward (the default for every workload).
    off = make_workload(load_config(TOOL, ["workload.params.turn_credit=false"]).workload, cfg.team)
    assert off.turn_rewards(p, "solver", [right, last], 0.1) == [0.1, 0.1]


def test_bad_tool_team_configs_name_the_field():
    cfg = load_config(TOOL, [])
    with pytest.raises(WorkloadError, match="team.rounds=1.*team.rounds=2"):
        make_workload(cfg.workload, cfg.team.model_copy(update={"rounds": 1}))
    agents = [a.model_copy(update={"backend": a.backend.model_copy(update={"inference": "vllm"})})
              if a.name == "solver" else a for a in cfg.team.agents]
    with pytest.raises(WorkloadError, match="agent 'solver' calls a tool.*backend.inference=hf"):
        make_workload(cfg.workload, cfg.team.model_copy(update={"agents": agents}))


#: the scripted solver's steer (tests/_models_util.py `ScriptedLM`): greedy follows the script;
#: a sampled token leaves it with probability under V * e^-12 ~ 0.3% (V ~ 500 tokens here)
BOOST = 12.0


@pytest.fixture(scope="module")
def team_demos():
    """The tool team's workload, 8 training problems' solver demonstrations (prompt, target),
    and the tokenizer."""
    cfg, wl, _ = _team()
    demos = team_shape(cfg).demonstrations(wl, wl.problems("train", 8, seed=0), seed=0, rng=random.Random(0),
                                           perturb=0.0)["solver"]
    return wl, demos, tokenizer()


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of zeros."""
    out, i = [], 0
    while i < len(mask):
        if mask[i] == 0:
            j = i
            while j < len(mask) and mask[j] == 0:
                j += 1
            out.append((i, j))
            i = j
        else:
            i += 1
    return out


def call_before(tok, ids: list[int], start: int, tool) -> str:
    """The call whose output was inserted at `start`: the token before it holds the close
    marker (alone, or merged with text after it, e.g. `])`), and the call is the text after the
    last open marker before that close (all of it, without one), as the tool loop reads it."""
    assert tool.close in tok.decode(ids[start - 1 : start]), tok.decode(ids[:start])
    before = tok.decode(ids[:start])
    end = before.rfind(tool.close)
    at = before.rfind(tool.open, 0, end)
    return before[at + len(tool.open) : end] if at >= 0 else before[:end]


def test_tool_loop_inserts_calculator_output_masked(team_demos):
    """A solver scripted to write its demonstrations (a real tiny transformer whose logits are
    steered along them, `ScriptedLM`) calls the calculator by construction: the tool loop
    stops at each `]`, inserts the calculator's own output masked, and goes on. Greedy, a
    rollout is token for token the demonstration SFT would train on, mask included; sampled,
    every inserted run is the calculator's answer to the call just before it."""
    wl, demos, tok = team_demos
    calc = wl.tool("solver")
    torch.manual_seed(0)
    targets = [demonstration_tokens(tok, target + "\n", calc) for _, target in demos]
    prompts = [p for p, _ in demos]
    scripts = [(tok.encode(p, add_special_tokens=False), ids) for p, (ids, _) in zip(prompts, targets, strict=True)]
    model = ScriptedLM(tiny_model(), scripts, BOOST)
    engine = HFInferenceEngine(model, tok)
    budget = max(len(ids) for ids, _ in targets) + 4
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=budget, stop=["\n"])
    greedy = generate_with_tool(engine, prompts, sampling.model_copy(update={"temperature": 0.0}), 0, calc)
    for g, (ids, mask), (_, target) in zip(greedy, targets, demos, strict=True):
        assert 0 in mask, target  # every solver demonstration calls the calculator
        assert (g.response_ids, g.loss_mask, g.text) == (ids, mask, target), target
        assert g.finish_reason == "stop"
    gens = generate_with_tool(engine, prompts * 2, sampling, 7, calc)
    assert gens == generate_with_tool(engine, prompts * 2, sampling, 7, calc)  # seeded
    called = 0
    for g in gens + greedy:
        assert len(g.loss_mask or g.response_ids) == len(g.response_ids) == len(g.logprobs)
        assert len(g.response_ids) <= sampling.max_new_tokens
        mask = g.loss_mask or [1] * len(g.response_ids)
        for start, end in _runs(mask):
            called += 1
            # Each inserted run is exactly the calculator's answer to the call just before it.
            call = call_before(tok, g.response_ids, start, calc)
            assert tok.decode(g.response_ids[start:end]) == calc(call)
            assert g.logprobs[start:end] == [0.0] * (end - start)
        assert all(lp < 0 for lp, m in zip(g.logprobs, mask, strict=True) if m)
    # Greedy calls once per demonstration; a sampled row skips its call only by leaving the
    # script before its `]` (~10 tokens at <0.3% each): far fewer than half of 32 rows do.
    assert called >= len(greedy) + len(gens) // 2

    # The trainer scores the whole sequence (inserted tokens as context); on the sampled tokens
    # it gives the engine's logprobs back. fp32 end to end, values of magnitude ~1-10 through a
    # few layers: 1e-4 is ~100x the accumulated float32 rounding.
    samples = [Sample(g.prompt_ids, g.response_ids, g.logprobs, 0.0, g.loss_mask) for g in gens]
    tr = TorchTrainer(model, TrainerOptions(make_loss_fn(AlgorithmConfig()), token_weight, lr=1e-3))
    for s, lp in zip(samples, tr.logprobs(samples), strict=True):
        mask = s.loss_mask or [1] * len(s.response_ids)
        got = [a for a, m in zip(lp, mask, strict=True) if m]
        want = [a for a, m in zip(s.logprobs, mask, strict=True) if m]
        assert got == pytest.approx(want, abs=1e-4)


def test_inserted_tokens_contribute_exactly_zero_gradient(team_demos):
    wl, demos, tok = team_demos
    rng = random.Random(0)
    samples = []
    for prompt, target in demos:
        ids, mask = demonstration_tokens(tok, target + "\n", wl.tool("solver"))
        assert 0 in mask and 1 in mask
        samples.append(Sample(tok.encode(prompt, add_special_tokens=False), ids, [0.0] * len(ids),
                              rng.choice((-1.0, 1.0)) * rng.uniform(0.5, 1.0), mask))
    # On-policy behaviour logprobs on sampled tokens (ratio 1: no clipping zeroes a gradient),
    # 0.0 on inserted ones, as a rollout stores them.
    scorer = TorchTrainer(tiny_model(seed=1), TrainerOptions(sft_loss, token_weight, lr=1e-3))
    for s, lp in zip(samples, scorer.logprobs(samples), strict=True):
        s.logprobs = [x if m else 0.0 for x, m in zip(lp, s.loss_mask, strict=True)]
    # The loss mask separates sampled tokens from inserted ones, and only sampled ones count.
    batch = collate(samples)
    for b, s in enumerate(samples):
        assert batch.mask[b, : len(s.response_ids)].tolist() == [float(m) for m in s.loss_mask]
    assert token_weight(samples) == sum(sum(s.loss_mask) for s in samples)

    seen: dict[str, torch.Tensor] = {}
    policy = make_loss_fn(AlgorithmConfig())

    def loss_fn(logprobs, tb):
        logprobs.retain_grad()
        seen["logprobs"] = logprobs
        return policy(logprobs, tb)

    def grads(batch_samples):
        torch.manual_seed(0)
        tr = TorchTrainer(tiny_model(seed=1), TrainerOptions(loss_fn, token_weight, lr=1e-3))
        tr.accumulate(batch_samples, loss_scale=1.0 / token_weight(batch_samples))
        return {n: p.grad.clone() for n, p in tr.model.named_parameters()}, seen["logprobs"].grad

    g, d_logp = grads(samples)
    inserted = batch.mask == 0
    real = torch.zeros_like(batch.mask, dtype=torch.bool)
    for b, s in enumerate(samples):
        real[b, : len(s.response_ids)] = True
    # d loss / d logprob of every inserted token is exactly 0; of sampled tokens, not 0.
    assert torch.equal(d_logp[inserted & real], torch.zeros(int((inserted & real).sum())))
    assert bool((d_logp[~inserted & real] != 0).all())
    # Whatever the inserted tokens' stored logprobs say, the gradient is bit-identical: their
    # loss terms contribute nothing (they still condition later tokens, as context).
    noisy = [Sample(s.prompt_ids, s.response_ids,
                    [lp if m else -rng.uniform(20, 50) for lp, m in zip(s.logprobs, s.loss_mask, strict=True)],
                    s.advantage, s.loss_mask) for s in samples]
    g2, _ = grads(noisy)
    assert all(torch.equal(g[n], g2[n]) for n in g)
    # Unmasking them does change it: the test above could fail.
    unmasked = [Sample(s.prompt_ids, s.response_ids, s.logprobs, s.advantage, None) for s in noisy]
    g3, _ = grads(unmasked)
    assert any(not torch.equal(g[n], g3[n]) for n in g)


def test_store_keeps_the_loss_mask_and_reads_rows_without_it(tmp_path):
    store = MEGStore(str(tmp_path / "store"))
    row = {"input_id": "i0", "traj": 0, "turn": 0, "mb": 0, "policy_version": 0,
           "prompt_ids": [5, 6], "response_ids": [7, 8, 9], "logprobs": [-1.0, 0.0, -2.0]}
    store.write_samples("solver", 0, [
        {**row, "sample_id": "i0:0:solver:0", "loss_mask": [1, 0, 1]},
        {**row, "sample_id": "i0:1:solver:0", "traj": 1},  # written like a store from before tools
    ])
    got = {r["sample_id"]: r["loss_mask"] for r in store.read_samples("solver", 0).to_pylist()}
    assert got == {"i0:0:solver:0": [1, 0, 1], "i0:1:solver:0": None}
