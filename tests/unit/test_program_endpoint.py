"""flexmarl's OpenAI-compatible endpoint, driven by the real `openai` client over HTTP: what it
answers equals what the engine samples, every call is recorded, concurrent calls batch, and
every bad request gets OpenAI's error JSON with a 4xx while the endpoint keeps serving."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from flexmarl_core.config import SamplingConfig
from flexmarl_core.inference.hf import HFInferenceEngine
from flexmarl_core.programs.api import DecodeStats, MachineryError
from flexmarl_core.programs.chat import BUILTIN
from flexmarl_core.programs.engines import LocalDispatcher
from flexmarl_core.programs.gateway import AgentSpec, Gateway, Session
from tests._models_util import tiny_model, tokenizer

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=8, stop=["\n"])
CONTEXT = 64  # a small context, so an oversized prompt is cheap to send


@pytest.fixture(scope="module")
def engines():
    return {a: HFInferenceEngine(tiny_model(seed=i), tokenizer()) for i, a in enumerate(["planner", "solver"])}


def _session(engines, *, window_s: float = 0.02, dispatcher=None, template: str = "plain") -> Session:
    specs = {a: AgentSpec(a, SAMPLING, BUILTIN[template], tokenizer(), CONTEXT) for a in engines}
    return Session("the-key", specs, {a: 0 for a in engines}, dispatcher or LocalDispatcher.of_engines(engines),
                   lambda i, t, a, c: 1000 * t + int(c.split(":")[1]), window_s=window_s)


@pytest.fixture
def endpoint(engines):
    """One trajectory's client, its session and its trajectory record."""
    gw = Gateway.shared()
    s = _session(engines)
    t = gw.open(s, "p0", 0, 0)
    client = openai.OpenAI(base_url=gw.base_url, api_key=t.key, max_retries=0)
    yield client, s, t
    gw.finish(t)
    gw.close(s)


def test_chat_completion_is_the_engines_sample_and_is_recorded(endpoint, engines):
    client, s, t = endpoint
    r = client.chat.completions.create(model="planner", messages=[{"role": "user", "content": "Q:1+2\nP:"}],
                                       logprobs=True)
    tok = tokenizer()
    prompt = tok.encode("Q:1+2\nP:", add_special_tokens=False)
    # The seed the endpoint derives for call 0 of trajectory 0 (the session's seed_of): the engine
    # alone, with that seed and the agent's sampling, samples the same response.
    ref = engines["planner"].generate([prompt], SAMPLING, seed=0)[0]
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ref.response_ids)
    assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx(ref.logprobs, abs=1e-6)
    rec = t.records[-1]
    assert (rec.agent, rec.call, rec.prompt_ids, rec.gen.response_ids) == ("planner", 0, prompt, ref.response_ids)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_sampling_fields_are_honoured(endpoint, engines):
    client, s, t = endpoint
    msgs = [{"role": "user", "content": "Q:4*5\nP:"}]
    greedy = [client.chat.completions.create(model="solver", messages=msgs, temperature=0).choices[0].message.content
              for _ in range(2)]
    prompt = tokenizer().encode("Q:4*5\nP:", add_special_tokens=False)
    ref = engines["solver"].generate([prompt], SAMPLING.model_copy(update={"temperature": 0.0}), seed=0)[0]
    assert greedy == [ref.text, ref.text]
    seeded = [client.chat.completions.create(model="solver", messages=msgs, seed=7, max_tokens=3).choices[0]
              for _ in range(2)]
    assert seeded[0].message.content == seeded[1].message.content
    assert all(len(r.gen.response_ids) <= 3 for r in t.records[-2:])
    many = client.chat.completions.create(model="solver", messages=msgs, n=3, top_p=0.9, stop=["7"])
    assert len(many.choices) == 3 and all("7" not in c.message.content for c in many.choices)
    assert [r.call for r in t.records[-3:]] == [4, 5, 6]  # each choice is a call of its own
    assert [r.gen.response_ids for r in t.records[-3:]] == [
        g.response_ids for g in engines["solver"].generate(
            [prompt] * 3, SAMPLING.model_copy(update={"top_p": 0.9, "stop": ["7"]}), seed=4)]


def test_completions_take_text_or_token_ids(endpoint):
    client, s, t = endpoint
    ids = tokenizer().encode("Q:2+2\nP:", add_special_tokens=False)
    by_text = client.completions.create(model="planner", prompt="Q:2+2\nP:", temperature=0, logprobs=1)
    by_ids = client.completions.create(model="planner", prompt=ids, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert t.records[-1].prompt_ids == t.records[-2].prompt_ids == ids
    assert len(by_text.choices[0].logprobs.token_logprobs) == len(t.records[-2].gen.response_ids)
    assert [m.id for m in client.models.list().data] == ["planner", "solver"]


def _status(fn) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as err:
        fn()
    return err.value.status_code, err.value.body


def test_bad_requests_get_openai_errors_and_the_endpoint_goes_on(endpoint):
    client, s, t = endpoint
    msgs = [{"role": "user", "content": "Q:1+1\nP:"}]
    code, body = _status(lambda: client.chat.completions.create(model="critic", messages=msgs))
    assert code == 404 and body["code"] == "model_not_found" and "planner" in body["message"]
    code, body = _status(lambda: client.chat.completions.create(model="planner", messages=[]))
    assert code == 400 and body["param"] == "messages"
    code, body = _status(lambda: client.chat.completions.create(
        model="planner", messages=[{"role": "user", "content": "9+" * CONTEXT}]))
    assert code == 400 and body["code"] == "context_length_exceeded" and str(CONTEXT) in body["message"]
    for field, value in [("presence_penalty", 0.5), ("top_logprobs", 2), ("logit_bias", {"5": 1}),
                         ("temperature", 3.0), ("top_p", 1.5)]:  # OpenAI's own bounds: 2 and 1
        code, body = _status(lambda f=field, v=value: client.chat.completions.create(
            model="planner", messages=msgs, **{f: v}))
        assert code == 400 and body["param"] == field, (field, body)
        assert len(body["message"]) < 300, body  # says what to do, never dumps the value whole
    code, body = _status(lambda: client.embeddings.create(model="planner", input="x"))
    assert code == 404 and "POST /v1/responses" in body["message"] and "POST /v1/chat/completions" in body["message"]
    code, body = _status(lambda: client.chat.completions.create(model="planner", messages=msgs, temperature=-1))
    assert code == 400 and body["param"] == "temperature"
    code, body = _status(lambda: client.chat.completions.create(model="planner", messages=msgs,
                                                                extra_body={"guided_json": {}}))
    assert code == 400 and body["param"] == "guided_json"
    code, body = _status(lambda: client.completions.create(model="planner", prompt=[10**6]))
    assert code == 400 and body["param"] == "prompt"
    wrong = openai.OpenAI(base_url=str(client.base_url), api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.chat.completions.create(model="planner", messages=msgs)
    assert err.value.body["code"] == "invalid_api_key"
    raw = httpx.post(f"{client.base_url}chat/completions", content=b"{not json",
                     headers={"Authorization": f"Bearer {t.key}", "Content-Type": "application/json"})
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    # Another trajectory's token under this op's key, or this token under another op's key: 401.
    for key in (f"{s.key}.no-such-trajectory", f"another-op.{t.token}"):
        gone = httpx.post(f"{client.base_url}chat/completions", json={"model": "planner", "messages": msgs},
                          headers={"Authorization": f"Bearer {key}"})
        assert gone.status_code == 401 and gone.json()["error"]["code"] == "invalid_api_key", key
    assert httpx.get(f"{client.base_url}nothing/here").json()["error"]["message"].startswith("GET")
    # Still serving, and none of the refused requests was recorded as a call.
    assert client.chat.completions.create(model="planner", messages=msgs).choices
    assert len(t.records) == 1 and s.error is None


def test_concurrent_calls_of_an_agent_decode_together(engines):
    """Eight trajectories call at once: with a window far longer than the test, only the
    'everyone is waiting' rule can release the batch, so it is one decode of eight requests."""
    gw = Gateway.shared()
    s = _session(engines, window_s=60.0)
    trajs = [gw.open(s, "p0", k, 0) for k in range(8)]
    out: list[str] = [""] * 8

    def call(k: int) -> None:
        c = openai.OpenAI(base_url=gw.base_url, api_key=trajs[k].key, max_retries=0)
        out[k] = c.chat.completions.create(model="planner", messages=[{"role": "user", "content": "Q:3+3\nP:"}],
                                           temperature=0).choices[0].message.content
        gw.finish(trajs[k])

    threads = [threading.Thread(target=call, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    gw.close(s)
    assert [(a, n) for a, n, _, _ in s.decodes] == [("planner", 8)]
    assert len(set(out)) == 1  # greedy: one answer, eight times


class _SlowClock:
    """The real engine, reporting each decode as 1000 s: the window the next batch waits on."""

    def __init__(self, inner: LocalDispatcher) -> None:
        self.inner = inner

    def capacity(self, agent: str) -> int:
        return 1

    def decode(self, agent, version, groups, stats: DecodeStats):
        out = self.inner.decode(agent, version, groups, stats)
        stats.seconds = 1000.0
        return out


def test_after_a_slow_decode_a_late_call_still_joins_the_batch(engines):
    """Once an agent's decode is slow, a batch waits up to a tenth of it for more calls: a call
    sent 0.3 s after another (15 windows of 20 ms) joins its decode instead of following it."""
    gw = Gateway.shared()
    specs = {"slowpoke": AgentSpec("slowpoke", SAMPLING, BUILTIN["plain"], tokenizer(), CONTEXT)}
    s = Session("the-key", specs, {"slowpoke": 0},
                _SlowClock(LocalDispatcher.of_engines({"slowpoke": engines["planner"]})),
                lambda i, t, a, c: 1000 * t + int(c.split(":")[1]), window_s=0.02)
    a = gw.open(s, "p0", 0, 0)

    def call(t, prompt: str) -> None:
        openai.OpenAI(base_url=gw.base_url, api_key=t.key, max_retries=0).chat.completions.create(
            model="slowpoke", messages=[{"role": "user", "content": prompt}])

    call(a, "Q:1+1\nP:")  # alone: everyone waits at once; the decode "takes" 1000 s
    b = gw.open(s, "p0", 1, 0)
    first = threading.Thread(target=call, args=(a, "Q:2+2\nP:"))
    first.start()
    while a.pending == 0 and first.is_alive():  # a's call is queued (or already answered: a failure below)
        threading.Event().wait(0.005)
    threading.Event().wait(0.3)
    call(b, "Q:3+3\nP:")
    first.join(60)
    gw.finish(a)
    gw.finish(b)
    gw.close(s)
    assert [(ag, n) for ag, n, _, _ in s.decodes] == [("slowpoke", 1), ("slowpoke", 2)]


class _Broken:
    def capacity(self, agent: str) -> int:
        return 1

    def decode(self, agent, version, groups, stats: DecodeStats):
        raise MachineryError(f"agent {agent!r}: no engine")


def test_a_failed_decode_is_a_503_kept_by_the_session(engines):
    gw = Gateway.shared()
    s = _session(engines, dispatcher=_Broken())
    t = gw.open(s, "p0", 0, 0)
    client = openai.OpenAI(base_url=gw.base_url, api_key=t.key, max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="planner", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 503 and "no engine" in str(err.value)
    assert isinstance(s.error, MachineryError) and t.records == []
    gw.finish(t)
    gw.close(s)


def test_every_trajectory_shares_one_base_url_and_a_finished_ones_key_is_refused(engines):
    """One base URL for the endpoint (a framework that keeps one HTTP client per base URL shares
    it); the key says whose call it is, and stops working once its op is closed."""
    gw = Gateway.shared()
    s = _session(engines)
    a, b = gw.open(s, "p0", 0, 0), gw.open(s, "p0", 1, 0)
    assert a.key != b.key
    msgs = [{"role": "user", "content": "Q:1+1\nP:"}]
    for t in (a, b):
        openai.OpenAI(base_url=gw.base_url, api_key=t.key, max_retries=0).chat.completions.create(
            model="planner", messages=msgs)
        gw.finish(t)
    assert [len(a.records), len(b.records)] == [1, 1]
    gw.close(s)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.base_url, api_key=a.key, max_retries=0).chat.completions.create(
            model="planner", messages=msgs)
