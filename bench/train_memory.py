"""Training memory against micro-batch size: peak RSS of one forward/backward of a micro-batch,
unchunked and under the token budget (`backend.train_chunk_tokens`, `training/memory.py`).

    python bench/train_memory.py --json runs/bench/train_memory.json [--preset tiny-10m]
        [--rows 32 64 128] [--tokens 110] [--memory-limit 6GiB]

Each measurement runs in a fresh process (peak RSS is per process), one thread. Reports, per
row count, the peak RSS above the loaded trainer (GiB) with no budget and with the default
budget of a worker with `--memory-limit`, and seconds per micro-batch for both.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def probe(preset: str, rows: int, tokens: int, budget: int | None) -> dict[str, float]:
    """One micro-batch's forward/backward in this process: peak RSS growth and seconds."""
    import random
    import resource
    import time

    import torch

    torch.set_num_threads(1)
    from flexmarl_core.algorithms import make_loss_fn, token_weight
    from flexmarl_core.config import AlgorithmConfig, ModelConfig
    from flexmarl_core.models import load_agent_model
    from flexmarl_core.training import Sample, TorchTrainer, TrainerOptions

    model, _ = load_agent_model(ModelConfig(preset=preset), seed=0)
    algo = AlgorithmConfig()
    tr = TorchTrainer(model, TrainerOptions(make_loss_fn(algo), token_weight),
                      chunk_tokens=budget if budget is not None else 10**12)
    rng = random.Random(0)
    batch = []
    for _ in range(rows):
        r = rng.randint(tokens // 4, tokens)  # long-tail-ish: responses of varied length
        batch.append(Sample(prompt_ids=[rng.randrange(3, 1000) for _ in range(16)],
                            response_ids=[rng.randrange(3, 1000) for _ in range(r)],
                            logprobs=[-7.0] * r, advantage=rng.uniform(-1, 1)))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    tr.accumulate(batch, 1.0 / (rows * tokens))
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_gib": (peak - base) / 1024**3, "s": dt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--preset", default="tiny-10m")
    ap.add_argument("--rows", type=int, nargs="*", default=[32, 64, 128])
    ap.add_argument("--tokens", type=int, default=110, help="longest response (tokens)")
    ap.add_argument("--memory-limit", default="6GiB")
    ap.add_argument("--probe", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        preset, rows, tokens, budget = args.probe
        print(json.dumps(probe(preset, int(rows), int(tokens), None if budget == "none" else int(budget))))
        return 0
    from dask.utils import parse_bytes

    from flexmarl_core.models import get_tokenizer
    from flexmarl_core.models.factory import preset_config
    from flexmarl_core.training.memory import default_chunk_tokens

    budget = default_chunk_tokens(preset_config(args.preset, get_tokenizer()),
                                  memory_limit=parse_bytes(args.memory_limit))
    res: dict = {"preset": args.preset, "tokens": args.tokens, "memory_limit": args.memory_limit,
                 "budget_tokens": budget, "rows": {}}
    print(f"{args.preset}, responses up to {args.tokens} tokens, default budget {budget} tokens "
          f"for a {args.memory_limit} worker")
    for rows in args.rows:
        row = {}
        for name, b in (("unchunked", "none"), ("budget", str(budget))):
            out = subprocess.run([sys.executable, __file__, "--json", "-", "--probe", args.preset,
                                  str(rows), str(args.tokens), b], capture_output=True, text=True, check=True)
            row[name] = json.loads(out.stdout.strip().splitlines()[-1])
        res["rows"][rows] = row
        print(f"{rows:4d} rows: unchunked {row['unchunked']['peak_gib']:.2f} GiB {row['unchunked']['s']:.1f} s; "
              f"budget {row['budget']['peak_gib']:.2f} GiB {row['budget']['s']:.1f} s", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
