"""bench/gpu_check.py's program-endpoint check (`endpoint/<preset>`): a team program's calls
through flexmarl's OpenAI-compatible endpoint in front of the HF engine on the device and, where
vLLM imports, in front of vLLM, against the same endpoint in front of the HF engine on the CPU.
Every call must be recorded with the reference's prompt, its tokens (a divergence passes only
at a near-tie, as in the greedy check) and logprobs within the fp32 bound; an unknown agent
must get OpenAI's 404. One call offers a tool with `tool_choice: required`, so the chatml
template's tool rendering and the parser's forced call prefix reach every backend alike. A
second program asks for JSON of a schema (`response_format`): each backend constrains its own
way (lm-format-enforcer on hf, vLLM's structured outputs), so its tokens are not compared, but
every answer must be JSON of the schema (`json_valid`)."""

from __future__ import annotations

import copy
import importlib.util
import json
from typing import Any

import openai
import torch

from bench.engines import gen_prompts
from bench.gpu_check import Plan, logit_scale, rel_tol
from flexmarl_core.config import SamplingConfig
from flexmarl_core.inference import HFInferenceEngine
from flexmarl_core.programs.chat import BUILTIN
from flexmarl_core.programs.engines import LocalDispatcher
from flexmarl_core.programs.gateway import AgentSpec, Gateway, Session
from flexmarl_core.programs.runner import run_program

AGENTS = ("planner", "solver")
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Compute one operation of two integers.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def _program(problem: str, client: openai.OpenAI) -> str:
    """Two calls whose prompts do not depend on an earlier answer, a tool call, then a refused one."""
    out = [client.completions.create(model=a, prompt=f"{problem}{a[0]}:").choices[0].text for a in AGENTS]
    r = client.chat.completions.create(model="solver", messages=[{"role": "user", "content": problem}],
                                       tools=TOOLS, tool_choice="required")
    out.append(r.choices[0].message.content or str(r.choices[0].message.tool_calls))
    try:
        client.completions.create(model="nobody", prompt=problem)
    except openai.NotFoundError:
        return "".join(out)
    raise AssertionError("an unknown agent was not refused with a 404")


SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"]}


def _structured(problem: str, client: openai.OpenAI) -> str:
    r = client.chat.completions.create(model="solver", messages=[{"role": "user", "content": problem}], max_tokens=160,
                                       response_format={"type": "json_schema", "json_schema": {"name": "v",
                                                                                               "schema": SCHEMA}})
    return r.choices[0].message.content or ""


def _json_valid(engine: Any, tok: Any, problems: list[str]) -> bool:
    specs = {a: AgentSpec(a, SamplingConfig(temperature=1.0, max_new_tokens=160), BUILTIN["chatml"], tok, 4096)
             for a in AGENTS}
    s = Session("j", specs, dict.fromkeys(AGENTS, 0), LocalDispatcher.of_engines(dict.fromkeys(AGENTS, engine)),
                lambda i, t, a, c: hash((i, t, a, c)) % 100_000)
    res = run_program(_structured, [(f"p{i}", 0, 0, p) for i, p in enumerate(problems)], s, Gateway.shared())
    try:
        return all(r.error is None and set(json.loads(r.answer or "")) == {"answer", "sure"} for r in res)
    except ValueError:
        return False


def _capture(engine: Any, tok: Any, problems: list[str], sampling: SamplingConfig) -> dict[tuple, Any]:
    specs = {a: AgentSpec(a, sampling, BUILTIN["chatml"], tok, 4096) for a in AGENTS}
    s = Session("k", specs, dict.fromkeys(AGENTS, 0), LocalDispatcher.of_engines(dict.fromkeys(AGENTS, engine)),
                lambda *_: 0, greedy=True)
    res = run_program(_program, [(f"p{i}", 0, 0, p) for i, p in enumerate(problems)], s, Gateway.shared())
    # an untrained model's forced tool call rarely parses: the policy's failure (MalformedToolCall),
    # whose calls are recorded and trained all the same; anything else is the endpoint's fault
    errors = [r.error for r in res if r.error and r.policy_error is None]
    if errors or s.error:
        raise AssertionError(f"program failed: {errors[:2] or s.error}")
    return {(r.input_id, c.agent, c.call): c for r in res for c in r.records}


def check_endpoint(model: Any, tok: Any, dev: torch.device, plan: Plan) -> dict[str, Any]:
    problems = gen_prompts(plan.check_prompts)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=plan.check_new)
    want = _capture(HFInferenceEngine(copy.deepcopy(model), tok), tok, problems, sampling)
    engines: dict[str, Any] = {"hf": HFInferenceEngine(copy.deepcopy(model).to(dev), tok)}
    if importable("vllm"):
        from flexmarl_core.inference.vllm_engine import VLLMInferenceEngine

        engines["vllm"] = VLLMInferenceEngine.from_model(copy.deepcopy(model), tok)
    tol = rel_tol(torch.float32, model, backward=False)
    bound = 2 * tol * logit_scale(model, [w.prompt_ids + w.gen.response_ids for w in want.values()])
    out: dict[str, Any] = {"calls": len(want), "logprob_bound": bound, "backends": list(engines)}
    try:
        for name, eng in engines.items():
            got = _capture(eng, tok, problems, sampling)
            lp, diverged = 0.0, []
            for key, w in want.items():
                g = got[key]
                a, b = w.gen.response_ids, g.gen.response_ids
                k = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                lp = max([lp, *(abs(x - y) for x, y in zip(w.gen.logprobs[:k], g.gen.logprobs[:k], strict=True))])
                if a == b:
                    continue
                tie = False
                if k < min(len(a), len(b)):
                    with torch.inference_mode():
                        z = model(input_ids=torch.tensor([w.prompt_ids + a[:k]])).logits[0, -1]
                    tie = float(z[a[k]] - z[b[k]]) <= bound
                diverged.append({"call": list(key), "step": k, "near_tie": tie})
            out[name] = {"calls_recorded": sorted(got) == sorted(want), "max_logprob_diff": lp,
                         "rows_diverged": len(diverged), "divergences": diverged,
                         "prompts_equal": all(got[k].prompt_ids == w.prompt_ids for k, w in want.items())}
            out[name]["json_valid"] = _json_valid(eng, tok, problems)
            out[name]["passed"] = (out[name]["calls_recorded"] and out[name]["prompts_equal"] and lp <= bound
                                   and all(d["near_tie"] for d in diverged) and out[name]["json_valid"])
    finally:
        if "vllm" in engines:
            engines["vllm"].close()
    out["passed"] = all(out[n]["passed"] for n in engines)
    return out


def importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None
