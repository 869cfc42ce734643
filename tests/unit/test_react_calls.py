"""bench/react_calls.py counts what each sampled tool call copied right, per iteration."""

import importlib.util
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("react_calls", REPO / "bench" / "react_calls.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _call(expr: str) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'


def test_counts_operator_operands_and_exact_calls(tmp_path):
    prompt = "<|im_start|>user\nCompute 57+57<|im_end|>\n<|im_start|>assistant\n"
    rows = {0: [(_call("57+57"), 1.0), (_call("57*57"), 0.0), (_call("75+57"), 0.0), ("114", 0.0)],
            1: [(_call("57+57"), 1.0), (_call("57+57"), 1.0)]}
    for it, samples in rows.items():
        part = tmp_path / "run" / "store" / "samples" / "agent=solver" / f"iteration={it}"
        part.mkdir(parents=True)
        pq.write_table(pa.table({"prompt_text": [prompt] * len(samples),
                                 "response_text": [s for s, _ in samples],
                                 "reward": [r for _, r in samples]}), part / "part.parquet")
    got = _module().per_iteration(tmp_path / "run")
    assert [r["samples"] for r in got] == [4, 2]
    first, second = got
    assert (first["call"], first["op_ok"], first["args_ok"], first["call_ok"]) == (0.75, 0.5, 0.5, 0.25)
    assert first["reward"] == 0.25
    assert (second["call_ok"], second["reward"]) == (1.0, 1.0)


def test_a_folder_without_solver_samples_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no solver samples"):
        _module().per_iteration(tmp_path)


def test_samples_without_a_reward_leave_the_reward_out(tmp_path):
    part = tmp_path / "run" / "store" / "samples" / "agent=solver" / "iteration=0"
    part.mkdir(parents=True)
    prompt = "<|im_start|>user\nCompute 12*34<|im_end|>\n"
    pq.write_table(pa.table({"prompt_text": [prompt, prompt], "response_text": [_call("12*34"), _call("12-34")],
                             "reward": pa.array([None, None], pa.float64())}), part / "part.parquet")
    (row,) = _module().per_iteration(tmp_path / "run")
    assert row["reward"] is None
    assert (row["call_ok"], row["op_ok"], row["args_ok"]) == (0.5, 0.5, 1.0)


def test_a_problem_in_words_is_compared_with_its_symbols(tmp_path):
    part = tmp_path / "run" / "store" / "samples" / "agent=solver" / "iteration=0"
    part.mkdir(parents=True)
    prompt = "<|im_start|>user\nCompute 12 times 34<|im_end|>\n"
    pq.write_table(pa.table({"prompt_text": [prompt] * 3,
                             "response_text": [_call("12*34"), _call("12+34"), _call("21*34")],
                             "reward": [1.0, 0.0, 0.0]}), part / "part.parquet")
    (row,) = _module().per_iteration(tmp_path / "run")
    assert (row["call_ok"], row["op_ok"], row["args_ok"]) == (1 / 3, 2 / 3, 2 / 3)


def _operator_module():
    spec = importlib.util.spec_from_file_location("react_operator", REPO / "bench" / "react_operator.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_operator_probabilities_are_read_where_the_call_writes_the_operator():
    """A model scripted to write each problem's own call puts its mass on the problem's
    operator; one scripted to write `+` whatever the problem gives every problem the same row."""
    from tests._models_util import ScriptedLM, tiny_model, tokenizer

    mod, tok = _operator_module(), tokenizer()
    problems = [("12", "+", "34"), ("56", "-", "21"), ("47", "*", "23")]
    words = {"+": "plus", "-": "minus", "*": "times"}

    def prompt(a, op, b):
        return tok(f"<|im_start|>user\nCompute {a} {words[op]} {b}<|im_end|>\n<|im_start|>assistant\n",
                   add_special_tokens=False)["input_ids"]

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    pairs = [(prompt(a, op, b), _call(f"{a}{op}{b}")) for a, op, b in problems]
    right = ScriptedLM(tiny_model(), [(p, ids(t)) for p, t in pairs], boost=30.0).eval()
    plus = ScriptedLM(tiny_model(), [(p, ids(_call(f"{a}+{b}"))) for p, (a, _, b) in
                                     zip((p for p, _ in pairs), problems, strict=True)], boost=30.0).eval()
    got = mod.operator_probs(right, tok, pairs)
    assert set(got) == {"+", "-", "*"}
    assert all(got[op][op] > 0.99 for op in got)
    always = mod.operator_probs(plus, tok, pairs)
    assert all(always[op]["+"] > 0.99 for op in always)
    # Two symbols whose embeddings point the same way (one twice the other) have cosine 1.
    base, op = right.base, mod.op_ids(tok)
    with torch.no_grad():
        emb = base.get_input_embeddings().weight
        emb[op["-"]] = 2 * emb[op["+"]]
    cos = mod.embedding_cosine(base, tok)
    assert cos["+-"] == pytest.approx(1.0, abs=1e-4) and abs(cos["+*"]) < 0.9
