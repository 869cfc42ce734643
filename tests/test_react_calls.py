"""bench/react_calls.py counts what each sampled tool call copied right, per iteration."""

import importlib.util
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]


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
