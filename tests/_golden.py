"""A golden run's fingerprint: what a run produced (every sample, the final weights), in a form
small enough to commit and exact enough to prove a refactor changed nothing.

- Samples: per agent and iteration, a SHA-256 over the sorted (sample_id, policy_version,
  response_ids) rows, so token identity is exact; logprob, reward and advantage sums in float64.
- Final weights: per tensor, the shape and 8 projections onto fixed pseudo-random unit vectors,
  computed in float64. Two weight sets that differ by `d` differ in a projection by a normal
  variable with deviation `|d| / sqrt(n)`: any change worth the name moves several of them.

    PYTHONPATH=. python tests/_golden.py RUN_DIR tests/golden/default.json   # record
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

N_PROJ = 8


def _projections(t: torch.Tensor, name: str) -> list[float]:
    flat = t.detach().to(torch.float64).reshape(-1)
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(N_PROJ, flat.numel(), generator=g, dtype=torch.float64)
    r /= r.norm(dim=1, keepdim=True)
    return (r @ flat).tolist()


def fingerprint(run_dir: str | Path) -> dict[str, Any]:
    from flexmarl_core.config import load_config
    from flexmarl_core.runtime.worker import load_weights
    from storage import MEGStore

    run_dir = Path(run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    store = MEGStore(load_config(str(run_dir / "config.yaml"), []).resolved_store_uri())
    samples: dict[str, Any] = {}
    weights: dict[str, Any] = {}
    iterations = cfg["train"]["iterations"]
    for a in cfg["team"]["agents"]:
        agent = a["name"]
        for it in range(iterations):
            rows = store.read_samples(agent, it).to_pylist()
            rows.sort(key=lambda r: (r["sample_id"], r["policy_version"]))
            h = hashlib.sha256()
            for r in rows:
                h.update(json.dumps([r["sample_id"], r["policy_version"], r["response_ids"]]).encode())
            samples[f"{agent}/{it}"] = {
                "n": len(rows),
                "tokens_sha256": h.hexdigest(),
                "logprob_sum": sum(float(x) for r in rows for x in r["logprobs"]),
                "reward_sum": sum(float(r["reward"] or 0.0) for r in rows),
                "advantage_sum_abs": sum(abs(float(r["advantage"] or 0.0)) for r in rows),
            }
        final = load_weights(run_dir, agent, iterations)
        weights[agent] = {k: {"shape": list(v.shape), "proj": _projections(v, f"{agent}/{k}")}
                          for k, v in sorted(final.items())}
    return {"samples": samples, "weights": weights}


def compare(got: dict[str, Any], want: dict[str, Any], *, atol: float) -> list[str]:
    """Every difference beyond `atol` (projections, sums), and every token-level mismatch."""
    bad = []
    for key, w in want["samples"].items():
        g = got["samples"].get(key)
        if g is None:
            bad.append(f"samples {key}: missing")
            continue
        for f in ("n", "tokens_sha256"):
            if g[f] != w[f]:
                bad.append(f"samples {key}: {f} differs")
        for f in ("logprob_sum", "reward_sum", "advantage_sum_abs"):
            # Sums over ~10^4 float32 values: allow the float32 resolution of each term.
            tol = atol * max(1.0, abs(w[f]))
            if abs(g[f] - w[f]) > tol:
                bad.append(f"samples {key}: {f} {g[f]} != {w[f]}")
    for agent, tensors in want["weights"].items():
        for name, w in tensors.items():
            g = got["weights"].get(agent, {}).get(name)
            if g is None or g["shape"] != w["shape"]:
                bad.append(f"weights {agent}/{name}: missing or reshaped")
                continue
            diff = max(abs(a - b) for a, b in zip(g["proj"], w["proj"], strict=True))
            if diff > atol:
                bad.append(f"weights {agent}/{name}: projection differs by {diff:.3g}")
    return bad


if __name__ == "__main__":
    out = Path(sys.argv[2])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fingerprint(sys.argv[1]), indent=1) + "\n")
    print(f"wrote {out}")
