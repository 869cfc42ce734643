"""Trainer-state swap speed (training/handles.py put + get) against a plain memcpy of the same bytes.

What it measures, per model preset (tiny-1m, tiny-10m, tiny-50m; --quick: tiny-1m, tiny-10m):
a real trainer state (`make_trainer(...).state()` after one AdamW step, so fp32 weights plus
both Adam moments, step counters and the RNG state; S = the handle's `nbytes`), swapped

* out: `h = put(state, tier)`, and
* in:  `got = get(h)`,

for each tier: `memory` (this process: what on-demand allocation does within a host), `disk`
(a file under a cache dir) and `shared` (a file path in a directory standing in for shared
storage; --shared-dir points it at a real mount, default a temp dir on the same disk, so here it
measures the same thing as `disk`). `torch.save` is a reference row: the same state through
`torch.save` + `torch.load(weights_only=True)`, the file format the handles used before.

Bandwidth. A swap out and back in moves the state twice, so
    swap GB/s   = 2 * S / (t_out + t_in)
    memcpy GB/s = S / t_memcpy
    ratio       = swap GB/s / memcpy GB/s = 2 * t_memcpy / (t_out + t_in)
i.e. a swap round trip that costs exactly two memcpys of the state scores 1.0. The memcpy is
one flat copy of S bytes between two preallocated, already-written buffers; the faster (by
median) of numpy `copyto` (libc memcpy, one thread) and torch `copy_` (torch threads) is the
baseline. That is the strictest fair baseline: it pays no page faults and no per-tensor
dispatch, which a swap has to avoid (or pay for) itself. Files are not fsynced, so `disk` and
`shared` measure the page cache, which is what a swap that is read back soon touches.

Each repetition runs memcpy and every tier back to back (interleaved, so machine noise hits all
alike); times are medians over repetitions after one warm-up round, whose memory-tier times are
reported as `cold` (fresh pages: the first swap in a process). After every `get` the state is
compared with the original, byte for byte, dtype and shape; any difference aborts the bench.

Headline `swap_vs_memcpy`: the memory tier at the largest preset measured. Also
`swap_vs_memcpy_min` (memory tier, min over presets), `swap_vs_memcpy_disk`,
`swap_vs_memcpy_shared` and `swap_vs_memcpy_torch_save` (largest preset). Target: >= 0.8.

    python bench/swap.py --json runs/bench/swap.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flexmarl_core.config import AgentConfig, ModelConfig
from flexmarl_core.models import build_model, get_tokenizer, num_params
from flexmarl_core.training import Sample, drop, get, make_trainer, put

TIERS = ("memory", "disk", "shared", "torch.save")
TARGET = 0.8


def trainer_state(preset: str, tok: Any, vocab: int) -> tuple[dict[str, Any], int]:
    """State of a trainer for `preset` after one step on 4 random sequences of 48 tokens."""
    agent = AgentConfig(name="bench", template="{input}", model=ModelConfig(preset=preset))
    model = build_model(agent.model, seed=0, tokenizer=tok)
    trainer = make_trainer(agent, model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (4, 48), generator=g).tolist()
    samples = [
        Sample(prompt_ids=row[:16], response_ids=row[16:], logprobs=[-7.0] * 32, advantage=a)
        for row, a in zip(ids, [1.0, -1.0, 0.5, -0.5], strict=True)
    ]
    trainer.accumulate(samples, 1.0)
    trainer.step()
    return trainer.state(), num_params(model)


def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in tensors_of(v)]
    return []


def assert_exact(got: Any, want: Any, path: str = "state") -> None:
    """Same structure, equal scalars, and tensors with the same dtype, shape and bytes."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            raise RuntimeError(f"{path}: got {type(got).__name__} {getattr(got, 'dtype', '')} "
                               f"{tuple(getattr(got, 'shape', ()))}, want {want.dtype} {tuple(want.shape)}")
        a = got.detach().cpu().reshape(-1).view(torch.uint8)
        b = want.detach().cpu().reshape(-1).view(torch.uint8)
        if not torch.equal(a, b):
            raise RuntimeError(f"{path}: bytes differ after the round trip")
    elif isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            raise RuntimeError(f"{path}: keys differ after the round trip")
        for k in want:
            assert_exact(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, list | tuple):
        if type(got) is not type(want) or len(got) != len(want):
            raise RuntimeError(f"{path}: {type(got).__name__} of {len(got)} != {type(want).__name__}")
        for i, (x, y) in enumerate(zip(got, want, strict=True)):
            assert_exact(x, y, f"{path}[{i}]")
    elif got != want or type(got) is not type(want):
        raise RuntimeError(f"{path}: {got!r} != {want!r}")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_preset(preset: str, tok: Any, reps: int, work: Path, shared: Path) -> dict[str, Any]:
    state, params = trainer_state(preset, tok, len(tok))
    parts = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors_of(state)]
    src = np.concatenate(parts)
    nbytes = int(src.nbytes)
    dst = np.ones_like(src)  # written once: its pages are mapped, as for a warm memcpy
    src_t, dst_t = torch.from_numpy(src), torch.from_numpy(dst)

    def swap(tier: str, rep: int) -> tuple[float, float, int]:
        if tier == "torch.save":
            path = shared / f"{preset}-{rep}.pt"
            t_out, _ = timed(lambda: torch.save(state, path))
            t_in, got = timed(lambda: torch.load(path, weights_only=True))
            assert_exact(got, state)
            path.unlink()
            return t_out, t_in, nbytes
        where = {"memory": "memory", "disk": "disk", "shared": str(shared / f"{preset}-{rep}.state")}[tier]
        t_out, h = timed(lambda: put(state, where, cache_dir=work))
        t_in, got = timed(lambda: get(h))
        assert_exact(got, state)
        del got  # its buffer goes back to the pool, as after trainer.load_state(get(h))
        drop(h)
        return t_out, t_in, h.nbytes

    times: dict[str, list[tuple[float, float]]] = {t: [] for t in TIERS}
    memcpy: dict[str, list[float]] = {"numpy": [], "torch": []}
    cold: tuple[float, float] | None = None
    for rep in range(reps + 1):  # rep 0 is the warm-up
        t_np, _ = timed(lambda: np.copyto(dst, src))
        t_torch, _ = timed(lambda: dst_t.copy_(src_t))
        row = {}
        for tier in TIERS:
            t_out, t_in, stored = swap(tier, rep)
            if stored != nbytes:
                raise RuntimeError(f"{tier}: handle says {stored} bytes, state holds {nbytes}")
            row[tier] = (t_out, t_in)
        if rep == 0:
            cold = row["memory"]
            continue
        memcpy["numpy"].append(t_np)
        memcpy["torch"].append(t_torch)
        for tier, t in row.items():
            times[tier].append(t)
    med = {k: statistics.median(v) for k, v in memcpy.items()}
    t_memcpy = min(med.values())
    memcpy_gbs = nbytes / t_memcpy / 1e9
    tiers = {}
    for tier, ts in times.items():
        round_trip = statistics.median(o + i for o, i in ts)
        swap_gbs = 2 * nbytes / round_trip / 1e9
        tiers[tier] = {
            "t_out_ms": round(statistics.median(o for o, _ in ts) * 1e3, 2),
            "t_in_ms": round(statistics.median(i for _, i in ts) * 1e3, 2),
            "round_trip_ms": round(round_trip * 1e3, 2),
            "swap_gb_s": round(swap_gbs, 3),
            "ratio": round(swap_gbs / memcpy_gbs, 3),
            "best_ratio": round(2 * t_memcpy / min(o + i for o, i in ts), 3),
        }
    assert cold is not None
    return {
        "preset": preset,
        "params": params,
        "bytes": nbytes,
        "tensors": len(parts),
        "memcpy_ms": round(t_memcpy * 1e3, 2),
        "memcpy_gb_s": round(memcpy_gbs, 3),
        "memcpy_median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "memory_cold_ms": {"t_out": round(cold[0] * 1e3, 2), "t_in": round(cold[1] * 1e3, 2)},
        "tiers": tiers,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="skip tiny-50m and use 3 repetitions")
    ap.add_argument("--presets", nargs="*", default=None, help="override the preset list")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (after one warm-up)")
    ap.add_argument("--shared-dir", default=None, help="directory standing in for shared storage")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    presets = args.presets or (["tiny-1m", "tiny-10m"] if args.quick else ["tiny-1m", "tiny-10m", "tiny-50m"])
    reps = args.reps or (3 if args.quick else 7)

    load_start = os.getloadavg()  # other jobs on the box move absolute numbers
    tok = get_tokenizer()
    work = Path(tempfile.mkdtemp(prefix="flexmarl-bench-swap-"))
    shared = Path(args.shared_dir) if args.shared_dir else work / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"{'preset':<9} {'MB':>7} {'tier':<10} {'out ms':>8} {'in ms':>8} {'GB/s':>6} "
          f"{'memcpy GB/s':>11} {'ratio':>6}")
    try:
        for preset in presets:
            row = bench_preset(preset, tok, reps, work, shared)
            rows.append(row)
            for tier, r in row["tiers"].items():
                print(f"{preset:<9} {row['bytes'] / 1e6:>7.1f} {tier:<10} {r['t_out_ms']:>8.1f} "
                      f"{r['t_in_ms']:>8.1f} {r['swap_gb_s']:>6.2f} {row['memcpy_gb_s']:>11.2f} "
                      f"{r['ratio']:>6.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    last = rows[-1]["tiers"]
    result = {
        "bench": "swap",
        "swap_vs_memcpy": last["memory"]["ratio"],
        "swap_vs_memcpy_preset": rows[-1]["preset"],
        "swap_vs_memcpy_min": min(r["tiers"]["memory"]["ratio"] for r in rows),
        "swap_vs_memcpy_disk": last["disk"]["ratio"],
        "swap_vs_memcpy_shared": last["shared"]["ratio"],
        "swap_vs_memcpy_torch_save": last["torch.save"]["ratio"],
        "target": TARGET,
        "bit_exact": True,  # assert_exact raised otherwise
        "definition": "ratio = (2*bytes/(t_out+t_in)) / (bytes/t_memcpy); medians over reps",
        "rows": rows,
        "quick": args.quick,
        "reps": reps,
        "threads": args.threads,
        "shared_dir": args.shared_dir or "temp dir (same disk as 'disk')",
        "loadavg_start_end": [load_start[0], os.getloadavg()[0]],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    verdict = "ok" if result["swap_vs_memcpy"] >= TARGET else "BELOW TARGET"
    print(f"swap_vs_memcpy (memory tier, {rows[-1]['preset']}) = {result['swap_vs_memcpy']:.2f} "
          f"(target >= {TARGET}: {verdict}); min over presets {result['swap_vs_memcpy_min']:.2f}; "
          f"disk {result['swap_vs_memcpy_disk']:.2f}, shared {result['swap_vs_memcpy_shared']:.2f}, "
          f"torch.save {result['swap_vs_memcpy_torch_save']:.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
