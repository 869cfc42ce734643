"""HF rollout engine: seeded reproducibility, logprobs == trainer recomputation, stops, weights."""

from __future__ import annotations

import pytest
import torch

from flexmarl_core.config import AgentConfig, SamplingConfig
from flexmarl_core.inference import HFInferenceEngine, InferenceBackend, make_inference_engine
from flexmarl_core.inference.sampling import sample_next
from flexmarl_core.training import Sample
from tests._models_util import tiny_model, tokenizer, trainer

PROMPTS = [
    "question: 12 + 7 * 3\nplan:",
    "hi",
    "plan: step 1 compute 3 * 4 = 12\nstep 2 check\nanswer:",
    "answer:",
]


def engine(seed: int = 0) -> HFInferenceEngine:
    return HFInferenceEngine(tiny_model(seed), tokenizer())


def test_same_seed_same_outputs_and_protocol():
    eng = engine()
    assert isinstance(eng, InferenceBackend) and eng.version == 0
    sp = SamplingConfig(temperature=1.0, max_new_tokens=12)
    a, b = eng.generate(PROMPTS, sp, seed=11), eng.generate(PROMPTS, sp, seed=11)
    assert [(g.response_ids, g.logprobs, g.text) for g in a] == [(g.response_ids, g.logprobs, g.text) for g in b]
    c = eng.generate(PROMPTS, sp, seed=12)
    assert [g.response_ids for g in a] != [g.response_ids for g in c]
    for g, p in zip(a, PROMPTS, strict=True):
        assert g.prompt_ids == tokenizer().encode(p, add_special_tokens=False)
        assert g.finish_reason == "length" and len(g.response_ids) == len(g.logprobs) == 12
        assert g.text == tokenizer().decode(g.response_ids) and g.version == 0
    # prompts may also be token ids
    ids = eng.generate([g.prompt_ids for g in a], sp, seed=11)
    assert [g.response_ids for g in ids] == [g.response_ids for g in a]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_engine_logprobs_match_trainer_recomputation(temperature, top_p):
    """Same weights -> engine logprobs == trainer logprobs to fp32 summation order, although
    the engine left-pads and uses a KV cache and the trainer right-pads in one forward."""
    model = tiny_model(2)
    eng = HFInferenceEngine(model, tokenizer())
    gens = eng.generate(PROMPTS, SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=10), seed=3)
    tr = trainer(tiny_model(2), temperature=temperature)
    samples = [Sample(g.prompt_ids, g.response_ids, g.logprobs, 0.0) for g in gens]
    # Padding and the KV cache change the order of fp32 sums over the hidden size: bound the
    # difference by hidden * eps * |logprob| (a wrong temperature or top-p renormalisation
    # moves logprobs by >= 1e-2, far more).
    hidden, eps = model.config.hidden_size, torch.finfo(torch.float32).eps
    for g, lp in zip(gens, tr.logprobs(samples), strict=True):
        want = torch.tensor(g.logprobs)
        atol = hidden * eps * float(want.abs().max())
        torch.testing.assert_close(torch.tensor(lp), want, atol=atol, rtol=0)


def test_stop_strings_truncate_text_and_keep_completing_token():
    eng = engine(1)
    base = eng.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=24), seed=0)[0]
    text = base.text
    k = len(text) // 2
    stop = text[k : k + 2]
    cut = text.find(stop)
    g = eng.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=24, stop=[stop, "@@never"]), seed=0)[0]
    assert g.finish_reason == "stop"
    assert g.text == text[:cut]
    n = len(g.response_ids)
    assert g.response_ids == base.response_ids[:n] and g.logprobs == base.logprobs[:n]
    dec = tokenizer().decode
    assert stop in dec(g.response_ids) and stop not in dec(g.response_ids[:-1])


def test_a_stop_check_that_outgrows_the_tail_cache_starts_over_with_every_tail_it_reads(monkeypatch):
    """The engine keeps the decoded text of the token tails its stop checks read, and starts
    over past `TAIL_CACHE` of them. A check that knew one of its tails and met new ones past
    the limit used to keep only the new ones and fail on the known one (a KeyError, after
    65,536 tails of a long run). Here: one known tail, two new, a limit of 2."""
    import flexmarl_core.inference.hf as hf

    eng, dec = engine(), tokenizer().decode
    known, fresh, other = (5, 6), (40, 41), (70, 71)
    texts = {t: dec(list(t)) for t in (known, fresh, other)}
    stop = texts[fresh]
    assert stop not in texts[known] and stop not in texts[other]  # only the middle row stops
    monkeypatch.setattr(hf, "TAIL_CACHE", 2)
    eng._tail_text = {known: texts[known]}
    tokens = torch.tensor([known, fresh, other])
    done, hit = torch.zeros(3, dtype=torch.bool), [False] * 3
    eng._check_stops(tokens, torch.tensor([2, 2, 2]), done, hit,
                     [(0, 3, SamplingConfig(max_new_tokens=4, stop=[stop]), 0)], [2])
    assert done.tolist() == [False, True, False] and hit == [False, True, False]
    assert eng._tail_text == texts  # started over, with every tail this check read


def test_many_one_row_requests_in_one_decode_sample_what_each_samples_alone():
    """A program endpoint's batch: many single-row requests, each with its own seed, most sharing
    temperature and top-p (drawn as one batch), some greedy, some with stop strings. Each gets
    the tokens it gets alone; log-probs differ only in the forward's summation order."""
    eng = engine()
    plain = SamplingConfig(temperature=1.0, max_new_tokens=10, stop=["\n"])
    reqs = [([PROMPTS[k % 4]], plain, 100 + k) for k in range(10)]
    reqs.insert(3, ([PROMPTS[0]], SamplingConfig(temperature=0.0, max_new_tokens=6), 7))
    reqs.insert(7, ([PROMPTS[2]], SamplingConfig(temperature=0.8, top_p=0.9, max_new_tokens=8), 8))
    together = eng.generate_groups(reqs)
    for (prompts, sampling, seed), gens in zip(reqs, together, strict=True):
        alone = eng.generate(prompts, sampling, seed)
        assert [g.response_ids for g in gens] == [g.response_ids for g in alone]
        assert [(g.text, g.finish_reason) for g in gens] == [(g.text, g.finish_reason) for g in alone]
        for g, ref in zip(gens, alone, strict=True):  # fp32, |logprob| < 20: summation order only
            assert max((abs(x - y) for x, y in zip(g.logprobs, ref.logprobs, strict=True)), default=0) < 1e-4
    assert len({tuple(g[0].response_ids) for g in together[:3]}) > 1  # sampled: seeds differ


def test_eos_ends_a_row_and_is_not_in_text():
    model = tiny_model(1)
    eng = HFInferenceEngine(model, tokenizer())
    sp = SamplingConfig(temperature=0, max_new_tokens=16)
    base = eng.generate(PROMPTS[:2], sp, seed=0)
    eos = base[0].response_ids[3]  # pretend the 4th greedy token of row 0 is an EOS token
    model.generation_config.eos_token_id = [tokenizer().eos_token_id, eos]
    g = HFInferenceEngine(model, tokenizer()).generate(PROMPTS[:2], sp, seed=0)[0]
    first = base[0].response_ids.index(eos)
    assert g.finish_reason == "eos" and g.response_ids == base[0].response_ids[: first + 1]
    assert g.text == tokenizer().decode(base[0].response_ids[:first])


def test_update_weights_and_version():
    eng, other = engine(0), tiny_model(5)
    sp = SamplingConfig(temperature=0, max_new_tokens=8)
    want = HFInferenceEngine(tiny_model(5), tokenizer()).generate(PROMPTS, sp, seed=0)
    sd = other.state_dict()
    assert "lm_head.weight" in sd
    eng.update_weights(sd, version=3)
    got = eng.generate(PROMPTS, sp, seed=0)
    assert eng.version == 3 and all(g.version == 3 for g in got)
    assert [g.response_ids for g in got] == [g.response_ids for g in want]
    bad = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="model.norm.weight"):
        eng.update_weights(bad, version=4)
    assert eng.version == 3


def test_tiny_top_p_is_greedy_and_sampler_matches_distribution():
    eng = engine()
    greedy = eng.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=6), seed=0)
    nucleus = eng.generate(PROMPTS, SamplingConfig(temperature=1.0, top_p=1e-6, max_new_tokens=6), seed=5)
    assert [g.response_ids for g in greedy] == [g.response_ids for g in nucleus]
    probs = torch.tensor([0.1, 0.0, 0.5, 0.15, 0.25])
    logits = probs.clamp(min=1e-30).log().expand(40_000, -1)
    draws = sample_next(logits, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=5).float() / draws.numel()
    # Five standard deviations of a frequency over n draws, sqrt(p(1-p)/n) <= 0.5/sqrt(n).
    five_sigma = 5 * 0.5 / draws.numel() ** 0.5
    torch.testing.assert_close(freq, probs, atol=five_sigma, rtol=0)
    # top_p=0.7 keeps {0.5, 0.25}, renormalised
    draws = sample_next(logits, SamplingConfig(temperature=1.0, top_p=0.7), torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=5).float() / draws.numel()
    torch.testing.assert_close(freq, torch.tensor([0, 0, 2 / 3, 0, 1 / 3]), atol=five_sigma, rtol=0)


def test_factory_dtype_and_backend_errors():
    agent = AgentConfig(name="solver", template="{input}", model={"dtype": "bfloat16"})
    eng = make_inference_engine(agent, tiny_model(), tokenizer())
    assert next(eng.model.parameters()).dtype == torch.bfloat16
    g = eng.generate(PROMPTS[:2], SamplingConfig(max_new_tokens=4), seed=0)
    assert all(len(x.response_ids) == 4 for x in g)
    with pytest.raises(ValueError, match="empty"):
        eng.generate([""], SamplingConfig(), seed=0)


def test_partial_generation_resumes_under_new_weights():
    """Partial rollouts: weights that change mid-decode (a sync landing while a long rollout
    runs) take over from the next token on. Tokens before the switch are the old weights' own
    (the same as a decode that never switched), and every token after it is scored by the new
    weights on the whole context, as the trainer recomputes it: the context was prefilled again,
    not continued from the old weights' KV cache."""
    old, new = tiny_model(0), tiny_model(1)
    sp = SamplingConfig(temperature=1.0, max_new_tokens=16)
    plain = HFInferenceEngine(tiny_model(0), tokenizer()).generate(PROMPTS, sp, seed=5)
    eng = HFInferenceEngine(old, tokenizer())
    calls = []

    def refresh() -> bool:  # the second check (after 8 tokens) finds version 1 published
        calls.append(len(calls))
        if len(calls) == 2:
            eng.update_weights(new.state_dict(), 1)
            return True
        return False

    gens = eng.generate_partial(PROMPTS, sp, seed=5, refresh=refresh, every=4)
    assert calls[:2] == [0, 1] and eng.version == 1
    spans = [g for g in gens if len(g.response_ids) > 8]
    assert spans, "no row decoded past the switch"
    for g, p in zip(gens, plain, strict=True):
        assert g.version == 0  # the oldest weights in it: what the staleness bound checks
        assert g.response_ids[:8] == p.response_ids[:8] and g.logprobs[:8] == p.logprobs[:8]
        n = len(g.response_ids)
        assert g.token_versions == ([0] * 8 + [1] * (n - 8) if n > 8 else None)
    hidden, eps = new.config.hidden_size, torch.finfo(torch.float32).eps
    samples = [Sample(g.prompt_ids, g.response_ids, g.logprobs, 0.0) for g in spans]
    for g, lp_old, lp_new in zip(spans, trainer(tiny_model(0)).logprobs(samples),
                                 trainer(tiny_model(1)).logprobs(samples), strict=True):
        want = torch.tensor(g.logprobs)
        atol = hidden * eps * float(want.abs().max())
        torch.testing.assert_close(torch.tensor(lp_old[:8]), want[:8], atol=atol, rtol=0)
        torch.testing.assert_close(torch.tensor(lp_new[8:]), want[8:], atol=atol, rtol=0)


def test_the_clock_counts_each_decode_and_the_prefill_within_it():
    """`clock` sums the engine's seconds: a caller's difference around a decode is that
    decode's, its prefill a part of it (a rollout's `prefill_share`)."""
    eng = engine()
    sp = SamplingConfig(temperature=1.0, max_new_tokens=8)
    before = eng.clock.copy()
    eng.generate(PROMPTS, sp, seed=1)
    one, mid = eng.clock.since(before), eng.clock.copy()
    eng.generate_groups([([PROMPTS[0]] * 3, sp, 2)])  # one prefill for the group's rows
    two = eng.clock.since(mid)
    for spent in (one, two):
        assert 0 < spent["prefill_s"] < spent["generate_s"]
    assert eng.clock.since(before)["generate_s"] == pytest.approx(one["generate_s"] + two["generate_s"])


# -- the decode loop's parts, each alone ---------------------------------------------------------

def test_sample_rows_draws_each_request_as_it_would_alone():
    """Sampling: two requests in one call (one greedy, one at temperature 1) get the tokens and
    logprobs each gets alone; a request's draws come from its own generator only."""
    from flexmarl_core.inference.sampling import sample_rows

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen)
    greedy, hot = SamplingConfig(temperature=0.0, max_new_tokens=4), SamplingConfig(temperature=1.0, max_new_tokens=4)
    spans = [(0, 2, greedy, 1), (2, 5, hot, 2)]

    def gens():
        return [torch.Generator().manual_seed(s[3]) for s in spans]

    both_t, both_s = sample_rows(logits, range(5), [0, 1], spans, gens(), [1.0, 1.0])
    alone = [sample_rows(logits[lo:hi], range(hi - lo), [0], [(0, hi - lo, s, seed)], [g], [1.0])
             for (lo, hi, s, seed), g in zip(spans, gens(), strict=True)]
    assert torch.equal(both_t, torch.cat([a[0] for a in alone]))
    assert torch.equal(both_s, torch.cat([a[1] for a in alone]))
    assert torch.equal(both_t[:2], logits[:2].argmax(-1))


def test_a_row_draws_what_it_would_whichever_rows_beside_it_ended():
    """Rows that ended leave the batch: each row still decoding takes the uniform it would have
    taken with every row of its request there, so its token does not depend on which others
    ended (a row's token is row-wise in its logits and its uniform)."""
    from flexmarl_core.inference.sampling import sample_rows

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    hot = SamplingConfig(temperature=1.0, max_new_tokens=4)
    spans = [(0, 3, hot, 5), (3, 6, hot, 6)]

    def gens():
        return [torch.Generator().manual_seed(s[3]) for s in spans]

    full_t, full_s = sample_rows(logits, range(6), [0, 1], spans, gens(), [1.0, 1.0])
    left = [0, 2, 5]  # rows 1, 3 and 4 ended
    part_t, part_s = sample_rows(logits[left], left, [0, 1], spans, gens(), [1.0, 1.0])
    assert torch.equal(part_t, full_t[left]) and torch.equal(part_s, full_s[left])


def test_evict_ended_keeps_the_rows_still_decoding():
    """Eviction: rows that ended leave the batch, and a request with them once all its rows
    ended; the kept batch positions are those of the rows still decoding, in order."""
    from flexmarl_core.inference.sampling import evict_ended

    s = SamplingConfig()
    spans = [(0, 2, s, 0), (2, 3, s, 0), (3, 5, s, 0)]
    assert evict_ended(range(5), [0, 1, 2], spans, [False] * 5) is None
    assert evict_ended(range(5), [0, 1, 2], spans, [True, False, False, True, False]) == ([1, 2, 4], [0, 1, 2])
    assert evict_ended(range(5), [0, 1, 2], spans, [True, True, False, True, False]) == ([2, 4], [1, 2])
    # after that eviction, positions count the rows still in the batch only
    assert evict_ended([2, 4], [1, 2], spans, [True, True, True, True, False]) == ([1], [2])


def test_select_row_kwargs_keeps_the_kept_rows_adapters():
    """Adapter groups: a per-row forward argument follows its rows out of the batch; others stay."""
    from flexmarl_core.inference.sampling import select_row_kwargs

    fkw = {"adapter_names": ["a", "a", "b", "c"], "flag": True, "other": [1, 2]}
    assert select_row_kwargs(fkw, [1, 3], 4) == {"adapter_names": ["a", "c"], "flag": True, "other": [1, 2]}


def test_reprefill_gives_the_next_logits_of_a_fresh_prefill():
    """Re-prefill: the context re-read under the model's weights gives the logits a prefill of
    that whole context gives (the same forward, up to the padding of ended rows' pad tokens)."""
    from flexmarl_core.inference.hf import left_pad, reprefill

    model = tiny_model(3).eval()
    prompts = [[5, 6, 7], [8, 9]]
    input_ids, attn, _ = left_pad(prompts, 0, torch.device("cpu"))
    tokens = torch.tensor([[11, 12, 0], [13, 14, 0]])
    nxt = torch.tensor([12, 14])
    attn = torch.cat([attn, attn.new_ones((2, 2))], dim=-1)  # two sampled tokens in the context
    with torch.inference_mode():
        out, pos = reprefill(model, input_ids, tokens, torch.arange(2), 1, nxt, attn, {})
        for i, p in enumerate(prompts):
            ctx = torch.tensor([[*p, int(tokens[i, 0]), int(nxt[i])]])
            ref = model(input_ids=ctx, use_cache=False).logits[0, -1]
            # fp32 forwards of one tiny model on the same tokens: equal up to summation order
            assert torch.allclose(out.logits[i, -1], ref, atol=1e-5, rtol=0)
            assert int(pos[i, 0]) == len(p) + 1


def test_token_versions_mark_tokens_from_each_switch_on():
    """Token versions: a generation still decoding at a switch carries, per token, the version
    that sampled it; one that ended before the first switch carries none."""
    from flexmarl_core.inference.api import Generation
    from flexmarl_core.inference.hf import token_versions

    def gen(n: int) -> Generation:
        return Generation(prompt_ids=[1], response_ids=list(range(n)), text="", logprobs=[0.0] * n,
                          finish_reason="length", version=3)

    short, long = gen(2), gen(7)
    token_versions([short, long], [(2, 4), (5, 6)], 3)
    assert short.token_versions is None
    assert long.token_versions == [3, 3, 4, 4, 4, 6, 6]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_group_prefilled_once_samples_what_it_samples_prefilled_row_by_row(temperature):
    """G rows of one prompt (and two groups in one decode) share one prefill, its cache copied
    to each row: the same tokens and, to fp32 summation order, the same log-probs as G prefills."""
    eng = engine(3)
    sp = SamplingConfig(temperature=temperature, max_new_tokens=10)
    groups = [([PROMPTS[0]] * 4, sp, 5), ([PROMPTS[2]] * 3 + [PROMPTS[1]], sp, 6)]
    shared = eng.generate_groups(groups)
    eng.share_prefill = False
    alone = eng.generate_groups(groups)
    hidden, eps = eng.model.config.hidden_size, torch.finfo(torch.float32).eps
    for a, b in zip((g for gs in shared for g in gs), (g for gs in alone for g in gs), strict=True):
        assert a.response_ids == b.response_ids and a.text == b.text
        want = torch.tensor(b.logprobs)  # bound as in the engine-against-trainer test above
        torch.testing.assert_close(torch.tensor(a.logprobs), want, rtol=0, atol=hidden * eps * float(want.abs().max()))


def test_distinct_rows_tell_prompts_and_adapters_apart():
    from flexmarl_core.inference.hf import distinct_rows

    cpu = torch.device("cpu")
    assert distinct_rows([[1, 2], [3]], {}, cpu) == (None, None)
    first, copies = distinct_rows([[1, 2], [1, 2], [3], [1, 2]], {}, cpu)
    assert first.tolist() == [0, 2] and copies.tolist() == [0, 0, 1, 0]
    # one prompt under two adapters is two prefills (a LoRA engine's per-row adapter names)
    first, copies = distinct_rows([[1], [1], [1]], {"adapter_names": ["a", "b", "a"]}, cpu)
    assert first.tolist() == [0, 1] and copies.tolist() == [0, 1, 0]
