"""What packing the training batch, encoding a group's prompt once in training and prefilling it
once in rollout save, side by side.

Three measurements on `tiny-1m` (one thread), each switched on and off in alternating order in the
same process, best of `--repeats`:

    packing   one forward+backward of a 64-sample micro-batch (`backend.packing`), padded
              against packed, for three length mixes: the arithmetic team's (prompts of 20-40
              tokens, answers of 2-8), a varied one (prompts 20-200, answers 4-60: multi-turn and
              tool samples), a long few-shot prompt (280-320, answers 4-16);
    share     one forward+backward of a GRPO batch (8 inputs x G = 8) with each sample's prompt in
              its own row against each group's prompt encoded once (`backend.share_prefix`),
              for prompts of about 10, 100 and 300 tokens;
    prefill   one decode of 8 inputs x G = 8 rows of 8 new tokens (`HFInferenceEngine.share_prefill`),
              each row prefilled against each distinct prompt once, for prompts of 30 and 300 tokens.

The switches leave what is computed unchanged (tests/unit/test_packing.py,
tests/unit/test_shared_prefix.py, tests/unit/test_inference.py); only the time moves.

    python bench/speedups.py --json runs/bench/speedups.json [--quick] [--repeats 5]

`--quick`: 2 repeats. JSON: `packing`, `share` and `prefill`, rows with the off and on seconds, their ratio
(`speedup`) and, for packing, the padding share of the batch's token cells before and after.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
MIXES = {"arithmetic": (20, 40, 2, 8), "varied": (20, 200, 4, 60), "long prompt": (280, 320, 4, 16)}


def samples(n: int, plo: int, phi: int, rlo: int, rhi: int, seed: int = 0) -> list:
    from flexmarl_core.training import Sample

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(plo, phi), rng.randint(rlo, rhi)
        out.append(Sample(prompt_ids=[rng.randrange(3, 1000) for _ in range(p)],
                          response_ids=[rng.randrange(3, 1000) for _ in range(r)],
                          logprobs=[-7.0] * r, advantage=rng.uniform(-1, 1)))
    return out


def off_on(run: Callable[[bool], Any], repeats: int) -> tuple[float, float, dict[bool, Any]]:
    """`run(False)` against `run(True)` in alternating order, a warm-up round first: (the best
    seconds off, the best on, each side's last result)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    out: dict[bool, Any] = {}
    for rep in range(repeats + 1):
        for on in ((False, True) if rep % 2 == 0 else (True, False)):
            t0 = time.perf_counter()
            out[on] = run(on)
            if rep:
                times[on].append(time.perf_counter() - t0)
    return min(times[False]), min(times[True]), out


def packing(repeats: int) -> list[dict]:
    from flexmarl_core.training import global_loss_scale
    from tests._models_util import tiny_model, trainer

    rows = []
    for name, shape in MIXES.items():
        batch = samples(64, *shape)
        base = tiny_model(0)
        trainers = {on: trainer(copy.deepcopy(base), packing=on, chunk_tokens=10**9) for on in (False, True)}
        scale = global_loss_scale([batch], trainers[False].loss_weight)
        off, on, out = off_on(lambda on, t=trainers, b=batch, sc=scale: t[on].accumulate(b, sc), repeats)
        pad = {k: o["tokens_padded"] / o["tokens_cells"] for k, o in out.items()}
        rows.append({"mix": name, "prompt_tokens": shape[:2], "answer_tokens": shape[2:], "samples": 64,
                     "padded_s": off, "packed_s": on, "speedup": off / on,
                     "padding_share_padded": pad[False], "padding_share_packed": pad[True]})
        print(f"packing  {name:12s} padded {off * 1e3:7.0f} ms (padding {pad[False]:.2f})  packed {on * 1e3:7.0f} ms "
              f"(padding {pad[True]:.2f})  x{off / on:.2f}", flush=True)
    return rows


def grouped(inputs: int, g: int, plo: int, phi: int, rlo: int, rhi: int, seed: int = 0) -> list:
    """`inputs` groups of `g` samples that share their input's prompt: a GRPO batch."""
    from flexmarl_core.training import Sample

    rng = random.Random(seed)
    out = []
    for _ in range(inputs):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(plo, phi))]
        for _ in range(g):
            r = rng.randint(rlo, rhi)
            out.append(Sample(prompt_ids=prompt, response_ids=[rng.randrange(3, 1000) for _ in range(r)],
                              logprobs=[-7.0] * r, advantage=rng.uniform(-1, 1)))
    return out


#: GRPO batches of 8 inputs x G = 8: the peer bench's two workloads and a middle one
GROUPED = {"short (peer)": (8, 11, 2, 4), "few-shot 100": (90, 110, 4, 16), "long (peer)": (290, 310, 2, 4)}


def share(repeats: int) -> list[dict]:
    """One forward+backward of a GRPO batch, each sample's prompt in its own row (packing on, as
    by default) against each group's prompt encoded once (`backend.share_prefix`)."""
    from flexmarl_core.training import global_loss_scale
    from tests._models_util import tiny_model, trainer

    rows = []
    for name, shape in GROUPED.items():
        batch = grouped(8, 8, *shape)
        base = tiny_model(0)
        trainers = {on: trainer(copy.deepcopy(base), packing=True, share_prefix=on, chunk_tokens=10**9)
                    for on in (False, True)}
        scale = global_loss_scale([batch], trainers[False].loss_weight)
        off, on, out = off_on(lambda on, t=trainers, b=batch, sc=scale: t[on].accumulate(b, sc), repeats)
        cells = {k: o["tokens_cells"] for k, o in out.items()}
        rows.append({"batch": name, "prompt_tokens": shape[:2], "answer_tokens": shape[2:], "inputs": 8,
                     "group_size": 8, "per_sample_s": off, "shared_s": on, "speedup": off / on,
                     "cells_per_sample": cells[False], "cells_shared": cells[True]})
        print(f"share    {name:13s} each sample's prompt {off * 1e3:7.0f} ms ({cells[False]:6.0f} cells)  "
              f"once per group {on * 1e3:7.0f} ms ({cells[True]:6.0f} cells)  x{off / on:.2f}", flush=True)
    return rows


def prefill(repeats: int) -> list[dict]:
    from flexmarl_core.config import SamplingConfig
    from flexmarl_core.inference import HFInferenceEngine
    from tests._models_util import tiny_model, tokenizer

    eng = HFInferenceEngine(tiny_model(0), tokenizer())
    sp = SamplingConfig(temperature=1.0, max_new_tokens=8)
    rows = []
    for plen in (30, 300):
        prompts = [[(7 * i + 13 * k) % 900 + 50 for k in range(plen)] for i in range(8)]
        groups = [([p] * 8, sp, i) for i, p in enumerate(prompts)]

        def decode(on: bool, groups: list = groups) -> None:
            eng.share_prefill = on
            eng.generate_groups(groups)

        off, on, _ = off_on(decode, repeats)
        rows.append({"prompt_tokens": plen, "inputs": 8, "group_size": 8, "new_tokens": 8,
                     "per_row_s": off, "shared_s": on, "speedup": off / on})
        print(f"prefill  prompt {plen:3d} tokens, 8 inputs x G=8: each row {off * 1e3:6.0f} ms, once per group "
              f"{on * 1e3:6.0f} ms  x{off / on:.2f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    repeats = 2 if args.quick else args.repeats
    sys.path.insert(0, str(REPO))  # tests/_models_util builds the tiny model and tokenizer
    sys.path.insert(0, str(Path(__file__).parent))
    from _fresh import LoadSampler, machine

    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    load = LoadSampler()
    load.start()
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    t0 = time.time()
    result = {"bench": "speedups", "date": time.strftime("%Y-%m-%d"), "commit": commit,
              "start_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
              "load_before": load_before, "repeats": repeats,
              "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "packing": packing(repeats), "share": share(repeats), "prefill": prefill(repeats)}
    result.update(wall_s=time.time() - t0, load=load.stop())
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
