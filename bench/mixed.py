"""Mixed-adapter batches across rollout ops (`codesign.mixed_batch_window_s`), off against on,
side by side through the real run (Prefect flow, a Dask worker, MEG Store).

    python bench/mixed.py --json runs/bench/mixed.json [--config configs/tiny.yaml] [--window 0.05]

Both modes run a team whose agents are LoRA adapters on one base (`--base`, rank 8) on ONE
worker that runs one rollout of each agent at a time beside training (`ONE_WORKER`), so the
planner's micro-batch 1 runs beside the solver's micro-batch 0. Reports per mode: rollout ops,
decodes run (`agent/*/rollout/decodes` summed), `decodes_saved_frac` (1 - decodes / ops),
`mixed_row_frac` (rows decoded beside another agent's, of all rows), E2E s/it, stage CPU s/it,
and `same_tokens` (every agent's sampled tokens identical in both runs, tests/_golden.py's hash).
Repeats alternate which mode goes first, so machine noise hits both alike.

`--engine PRESET...` measures the decode alone instead (no flow): per preset, a shared-base
engine with two agents' adapters, a planner request (8 rows, 12 tokens) and a solver request
(8 rows, 6 tokens, stop at a newline), sampled at temperature 1: CPU seconds of ONE
`generate_requests` call for both against the two requests decoded one after the other, best
of `--repeats` interleaved runs (`engine.<preset>.{together,apart}_cpu_s`, `cpu_ratio`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ONE_WORKER = ("cluster.workers=[{{name: w0, nthreads: {n}, resources: {{{tags}, train: 1}}}}]")


def counted(run_dir: Path, metric: str) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics" / "iterations.jsonl").read_text().splitlines()]
    return sum(v for r in rows for k, v in r.items() if k.endswith(f"/rollout/{metric}"))


def engine_rows(presets: list[str], repeats: int) -> dict:
    """The decode alone: two requests in one `generate_requests` call vs one after the other."""
    import torch

    from flexmarl_core.config import LoraSpec, ModelConfig, SamplingConfig
    from flexmarl_core.inference.lora_engine import SharedBaseEngine
    from flexmarl_core.models import build_model, get_tokenizer
    from flexmarl_core.models.lora import initial_adapter_state

    torch.set_num_threads(1)
    tok, spec, out = get_tokenizer(), LoraSpec(rank=8), {}
    for preset in presets:
        base = build_model(ModelConfig(preset=preset), seed=0, tokenizer=tok)
        eng = SharedBaseEngine(base, tok)
        for i, a in enumerate(("planner", "solver")):
            g = torch.Generator().manual_seed(i)  # lora_B = 0 at init: give each adapter an effect
            st = initial_adapter_state(base, spec, seed=0, agent=a)
            eng.add(a, spec, {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in st.items()}, 0)
        reqs = [("planner", [f"Q:{i}+{i + 3}*2\nP:" for i in range(8)], SamplingConfig(max_new_tokens=12), 1),
                ("solver", [f"Q:{i}-4\nP:{i}-4\nA:" for i in range(8)],
                 SamplingConfig(max_new_tokens=6, stop=["\n"]), 2)]
        together, apart = [], []
        for _ in range(repeats + 1):  # the first round warms up
            t = time.process_time()
            eng.generate_requests(reqs)
            together.append(time.process_time() - t)
            t = time.process_time()
            for a, prompts, sampling, seed in reqs:
                eng.view(a).generate(prompts, sampling, seed)
            apart.append(time.process_time() - t)
        row = {"together_cpu_s": min(together[1:]), "apart_cpu_s": min(apart[1:])}
        row["cpu_ratio"] = row["together_cpu_s"] / row["apart_cpu_s"]
        out[preset] = row
        print(f"{preset}: one decode {row['together_cpu_s']:.3f} CPU-s, two decodes {row['apart_cpu_s']:.3f} "
              f"({row['cpu_ratio']:.2f}x)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    ap.add_argument("--base", default="tiny-1m", help="the shared base (a preset or a model folder)")
    ap.add_argument("--window", type=float, default=0.05, help="codesign.mixed_batch_window_s when on")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], help="extra config overrides")
    ap.add_argument("--engine", nargs="+", default=None, metavar="PRESET",
                    help="measure the decode alone on these presets (no flow)")
    args = ap.parse_args()
    if args.engine:
        res = {"engine": engine_rows(args.engine, max(args.repeats, 3))}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
        return 0

    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flexmarl.prefect_api import ensure_api
    from flexmarl_core.config import load_config
    from flows.train import train
    from tests._golden import fingerprint

    agents = [a.name for a in load_config(args.config).team.agents]
    tags = ", ".join(f"rollout:{a}: 1" for a in agents)
    common = [ONE_WORKER.format(n=len(agents) + 1, tags=tags), "codesign.load_balancing=false",
              "train.evaluate=false", "train.warm_start=none", f"train.iterations={args.iterations}",
              *[f"team.agents.{a}.model={{base: {args.base}, lora: {{rank: 8}}}}" for a in agents], *args.set]
    modes = {"off": "null", "on": str(args.window)}
    out_dir = REPO / "runs" / "bench-mixed"
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    hashes: dict[str, dict] = {}
    api, _ = ensure_api()
    t0 = time.time()
    with temporary_settings(updates={PREFECT_API_URL: api}):
        for rep in range(args.repeats):
            for mode in (list(modes) if rep % 2 == 0 else list(modes)[::-1]):
                run_dir = out_dir / f"{mode}-{rep}"
                state = train(args.config, [f"run_dir={run_dir}", f"codesign.mixed_batch_window_s={modes[mode]}",
                                            *common], progress=False, overwrite=True, return_state=True)
                if not state.is_completed():
                    print(f"{mode} rep {rep} failed: {state.message}", file=sys.stderr)
                    return 1
                s = state.result()["summary"]
                ops = args.iterations * len(agents) * load_config(args.config).batch.num_micro_batches
                rows = ops * load_config(args.config).batch.micro_batch_inputs * load_config(args.config).batch.group_size
                r = {"e2e_s_per_iteration": s["e2e_s_per_iteration"],
                     "stage_cpu_s_per_iteration": s["stage_cpu_s"] / args.iterations,
                     "rollout_ops": ops, "decodes": counted(run_dir, "decodes"),
                     "mixed_row_frac": counted(run_dir, "mixed_rows") / rows}
                r["decodes_saved_frac"] = 1.0 - r["decodes"] / ops
                runs[mode].append(r)
                if rep == 0:
                    hashes[mode] = {k: v["tokens_sha256"] for k, v in fingerprint(run_dir)["samples"].items()}
                print(f"{mode:4s} rep {rep}: {r['e2e_s_per_iteration']:.2f} s/it, stage CPU "
                      f"{r['stage_cpu_s_per_iteration']:.2f} s/it, {r['decodes']:.0f} decodes for {ops} rollout ops, "
                      f"mixed rows {100 * r['mixed_row_frac']:.0f}%", flush=True)
    res: dict = {"config": args.config, "base": args.base, "window_s": args.window,
                 "iterations": args.iterations, "repeats": args.repeats, "bench_wall_s": time.time() - t0}
    for mode in modes:
        for k in runs[mode][0]:
            res[f"{k}_{mode}"] = statistics.median(r[k] for r in runs[mode])
    res["e2e_ratio_on_over_off"] = res["e2e_s_per_iteration_on"] / res["e2e_s_per_iteration_off"]
    res["stage_cpu_ratio_on_over_off"] = res["stage_cpu_s_per_iteration_on"] / res["stage_cpu_s_per_iteration_off"]
    res["same_tokens"] = hashes["on"] == hashes["off"]
    res["runs"] = runs
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"decodes saved {100 * res['decodes_saved_frac_on']:.0f}%, mixed rows {100 * res['mixed_row_frac_on']:.0f}%, "
          f"E2E on/off {res['e2e_ratio_on_over_off']:.2f}, stage CPU on/off {res['stage_cpu_ratio_on_over_off']:.2f}, "
          f"same tokens: {res['same_tokens']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
